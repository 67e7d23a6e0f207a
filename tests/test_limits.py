"""
Memory limits: what a run may allocate is the smallest of the machine's available memory, the address space
its RLIMIT_AS leaves (prlimit --as, a shared host's ulimit -v) and its cgroup's memory limit (a container's);
test-time views beyond it are refused in one line before anything runs, and a MemoryError while building them
is the same kind of line. Real train.py processes on a 4-step 4x4 Sudoku run.
    python -m pytest -q tests/test_limits.py
"""
import os
import shutil

from conftest import ROOT, SUDOKU, assert_user_error, run

LIMITED = ['-c', 'import os, resource, sys; n = int(sys.argv[1]); resource.setrlimit(resource.RLIMIT_AS, (n, n)); '
           'os.execv(sys.executable, [sys.executable] + sys.argv[2:])']  # prlimit --as=N python ...


def evaluate(trained, sudoku4, tmp_path, *extra, env=None, limit=None):
    out = tmp_path / 'o'
    shutil.copytree(trained, out)
    cmd = ['train.py', f'--data_path={sudoku4}', f'--out_dir={out}', '--init_from=resume', '--eval_only=True']
    cmd += SUDOKU + list(extra)
    return run((LIMITED + [str(limit)] if limit else []) + cmd, env=env, check=False, timeout=900)


def test_views_beyond_the_address_space_limit_are_refused_in_one_line(trained, sudoku4, tmp_path):
    # 40,000 views of 50 puzzles: about 9.5 GB by the estimate, within this machine's memory but not within
    # the 6 GB of address space (torch and its libraries map 4-5 GB of it at start-up)
    p = evaluate(trained, sudoku4, tmp_path, '--eval_views=40000', limit=6_000_000_000)
    assert_user_error(p, 'config error: eval_views=40000', 'RLIMIT_AS 6.0 GB', 'views at this batch size')
    assert not os.path.exists(tmp_path / 'o' / 'evals')


def test_views_beyond_the_cgroup_s_limit_are_refused_in_one_line(trained, sudoku4, tmp_path):
    cgroup = tmp_path / 'cgroup'  # a container's cgroup (v2) of 1 GB, 0.3 GB of it in use
    cgroup.mkdir()
    (cgroup / 'memory.max').write_text('1000000000\n')
    (cgroup / 'memory.current').write_text('300000000\n')
    (cgroup / 'memory.stat').write_text('anon 200000000\ninactive_file 100000000\n')
    p = evaluate(trained, sudoku4, tmp_path, '--eval_views=8000', env=dict(TRM_CGROUP_ROOT=str(cgroup)))
    assert_user_error(p, 'config error: eval_views=8000', "the cgroup's memory.max 1.0 GB less the 0.2 GB")


def test_a_memory_error_while_building_the_views_is_one_line(trained, sudoku4, tmp_path):
    # the estimate said yes, then the memory went elsewhere (another process took it meanwhile): the allocation
    # of the views fails, as numpy's does, in every process of the run (a sitecustomize.py on PYTHONPATH)
    hook = tmp_path / 'hook'
    hook.mkdir()
    (hook / 'sitecustomize.py').write_text(f'''import sys
sys.path.insert(0, {ROOT!r})
import puzzles


def views(self, K, B, seed, batch):
    raise MemoryError(f"Unable to allocate 1.00 GiB for an array with shape ({{K * B}}, {{self.L}}) and data type int64")


puzzles.Grid.views = views
''')
    p = evaluate(trained, sudoku4, tmp_path, '--eval_views=4', env=dict(PYTHONPATH=str(hook)))
    assert_user_error(p, 'eval_views=4', 'ran out of memory', 'Unable to allocate 1.00 GiB', 'lower eval_views')
    assert len([l for l in p.stderr.splitlines() if l.strip()]) == 1, p.stderr
