"""
A failing test leaves no process behind: what it started (a child, and that child's own child in a session of
its own) is killed at its teardown, as conftest.py's guard does for every test.
    python -m pytest -q tests/test_teardown.py
"""
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import alive, command

TESTS = os.path.dirname(os.path.abspath(__file__))

INNER = '''
import os, subprocess, time


def test_fails_with_its_processes_running(tmp_path):
    quiet = dict(stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    child = subprocess.Popen(['sleep', '600'], **quiet)
    shell = subprocess.Popen(['sh', '-c', 'sleep 600 & echo $! > grandchild; wait'], cwd=tmp_path,
                             start_new_session=True, **quiet)
    deadline = time.time() + 30
    while not (tmp_path / 'grandchild').exists() or not (tmp_path / 'grandchild').read_text().endswith('\\n'):
        assert time.time() < deadline, 'the shell never started its sleep'
        time.sleep(0.05)
    grandchild = int((tmp_path / 'grandchild').read_text())
    open({pids!r}, 'w').write(f'{{child.pid}} {{shell.pid}} {{grandchild}}')
    assert False, 'the test fails with its processes running'
'''


def running(pid):
    """Whether pid is one of the inner test's processes and has not ended (a zombie has: killed, not yet reaped
    by the init process it was handed to)."""
    return alive(pid) and 'sleep 600' in command(pid)


@pytest.mark.skipif(not os.path.exists('/proc/self/stat'), reason='the guard reads /proc')
def test_a_failed_test_s_child_and_grandchild_are_killed_at_its_teardown(tmp_path):
    (tmp_path / 'test_inner.py').write_text(INNER.format(pids=str(tmp_path / 'pids')))
    (tmp_path / 'pytest.ini').write_text('')  # the inner session's own settings: none of the repository's
    env = {k: v for k, v in os.environ.items() if not k.startswith('PYTEST_')}
    env.update(PYTHONPATH=os.pathsep.join([TESTS] + [p for p in [env.get('PYTHONPATH')] if p]),
               PYTEST_DISABLE_PLUGIN_AUTOLOAD='1')
    pids = []
    try:
        p = subprocess.run([sys.executable, '-m', 'pytest', '-p', 'conftest', '-p', 'no:cacheprovider', '-q',
                            '-c', str(tmp_path / 'pytest.ini'), '--rootdir', str(tmp_path), 'test_inner.py'],
                           cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           timeout=300)
        out = p.stdout + p.stderr
        assert p.returncode == 1 and '1 failed' in out and 'the test fails with its processes running' in out, out
        pids = [int(pid) for pid in (tmp_path / 'pids').read_text().split()]
        deadline = time.time() + 30
        while any(running(pid) for pid in pids) and time.time() < deadline:
            time.sleep(0.1)
        assert [pid for pid in pids if running(pid)] == [], f'still running after the failed test {pids}:\n{out}'
    finally:
        for pid in pids:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
