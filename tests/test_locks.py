"""
One run per out_dir: the local lock and the gs:// lock object with its lease, taken over when stale, removed at
every exit. The bucket side runs against a small server that honours create-only-if-absent preconditions.
"""
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import ThreadingHTTPServer

import pytest
import torch

from conftest import (BUCKET, ROOT, Preconditioned, assert_user_error, ckpts, finish, popen_train, read_until,
                      site_hook, start, train)
from runkeep import locks


def assert_unlocked(out):
    assert not os.path.exists(os.path.join(out, 'run.lock')), 'the run left its lock behind'


def test_one_run_per_out_dir_a_stale_lock_is_taken_over_and_every_exit_removes_it(toy, tmp_path):
    out = tmp_path / 'o'
    first = start(toy, out, '--epochs=200', '--log_interval=5')  # few lines: nobody reads them for a while
    try:
        read_until(first, 'step 5/')
        p = train(toy, out, '--init_from=resume', '--max_steps=2', check=False)
        assert_user_error(p, f'{out} is in use', socket.gethostname(), f'pid {first.pid}', 'since')
        lock = json.load(open(out / 'run.lock'))
        assert lock['pid'] == first.pid and lock['host'] == socket.gethostname()
    finally:
        first.send_signal(signal.SIGTERM)
    assert 'stopped cleanly' in finish(first, 120) and first.returncode == 0
    assert_unlocked(out)  # a SIGTERM stop
    # the lock of a process that has ended (killed with SIGKILL, its host crashed) is taken over
    gone = subprocess.Popen([sys.executable, '-c', 'pass'])
    gone.wait()
    lock = dict(lock, pid=gone.pid)
    json.dump(lock, open(out / 'run.lock', 'w'))
    step = torch.load(glob.glob(str(out / 'ckpt_*.pt'))[0], weights_only=True)['step']
    # the first run's epochs: its stop may come after FAST's last step (40), a checkpoint past which is refused
    p = train(toy, out, '--init_from=resume', '--epochs=200', f'--max_steps={step + 1}', '--checkpoint_interval=1')
    assert f'pid {gone.pid}' in p.stdout and 'taking over' in p.stdout
    assert_unlocked(out)  # a normal end
    p = train(toy, out, '--init_from=resume', '--hidden_size=64', check=False)
    assert_user_error(p, 'hidden_size=32')
    assert_unlocked(out)  # a refusal through fail_together
    p = train(toy, out, f"--init_from={out / ckpts(out)[-1]}", '--eval_only=True')
    assert 'eval on 200' in p.stdout
    assert_unlocked(out)  # eval_only


# both runs come to the lock together, and each is slow between judging a lock stale and removing it
BOTH_AT_THE_LOCK = """
if sys.argv[0].endswith('train.py'):
    from runkeep import locks
    lock_local, taken_over = locks.lock_local, locks.taken_over
    here = os.environ['AT_THE_LOCK']

    def together(folder):
        open(os.path.join(here, str(os.getpid())), 'w').close()
        while len(os.listdir(here)) < 2:
            time.sleep(0.01)
        return lock_local(folder)

    def slow(rec, where, *what):
        gone = taken_over(rec, where, *what)
        time.sleep(1)
        return gone

    locks.lock_local, locks.taken_over = together, slow
"""


def test_two_runs_that_find_the_same_stale_lock_do_not_both_take_it_over(toy, tmp_path):
    out, here = tmp_path / 'o', tmp_path / 'at_the_lock'
    out.mkdir()
    here.mkdir()
    gone = subprocess.Popen([sys.executable, '-c', 'pass'])
    gone.wait()
    json.dump(dict(locks.lock_record(), pid=gone.pid), open(out / 'run.lock', 'w'))  # a run killed with SIGKILL
    env = dict(site_hook(tmp_path / 'hook', BOTH_AT_THE_LOCK), AT_THE_LOCK=str(here))
    runs = [popen_train(toy, out, '--max_steps=4', env=env) for _ in range(2)]
    said = [r.communicate(timeout=300)[0].decode() for r in runs]
    assert sorted(r.returncode for r in runs) == [0, 1], said
    refused = said[[r.returncode for r in runs].index(1)]
    assert f'{out} is in use' in refused and 'Traceback' not in refused, refused[-3000:]
    assert_unlocked(out)


def test_a_lock_whose_pid_now_names_another_process_is_taken_over(toy, tmp_path):
    """A pid outlives its process: a container restarted as pid 1, a busy host reusing pids. The lock records its
    holder's start, so a live process of the same pid that started later is not the holder."""
    out = tmp_path / 'o'
    out.mkdir()
    other = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])
    try:
        rec = dict(locks.lock_record(), pid=other.pid, started=locks.started(other.pid))
        assert not locks.holder_gone(rec)  # `other` holds it: alive
        rec['started'] -= 1  # the holder started before `other` took its pid
        json.dump(rec, open(out / 'run.lock', 'w'))
        p = train(toy, out, '--max_steps=2')
        assert f'pid {other.pid}' in p.stdout and 'taking over' in p.stdout
        assert_unlocked(out)
        assert other.poll() is None  # only the lock was taken over
    finally:
        other.kill()



def test_a_lock_whose_holder_ended_but_is_not_reaped_is_stale():
    """A run that ended whose parent never waits for it (a killed study's train.py, adopted by a container's pid 1
    that reaps nothing) stays a zombie under its pid: it holds nothing, and a study rerun waiting for it, or a run
    refused by its lock, would wait or be refused for good."""
    ended = subprocess.Popen([sys.executable, '-c', 'pass'])
    while locks.proc_stat(ended.pid)[0] != 'Z':  # not waited for
        time.sleep(0.01)
    try:
        rec = dict(locks.lock_record(), pid=ended.pid, started=locks.started(ended.pid))
        assert locks.holder_gone(rec)
    finally:
        ended.wait()

LOCKER = """
import sys
from runkeep import locks
print(locks.lock_bucket(sys.argv[1], sys.argv[2]), flush=True)
sys.stdin.read()  # held until the test closes stdin (or kills this process)
"""


def serve(handler):
    srv = ThreadingHTTPServer(('127.0.0.1', 0), handler)
    threading.Thread(target=srv.serve_forever, kwargs=dict(poll_interval=0.05), daemon=True).start()
    return srv, f'127.0.0.1:{srv.server_address[1]}'


def test_a_gs_out_dir_s_lock_object_admits_one_run_is_taken_over_when_stale_and_removed_at_exit(tmp_path):
    srv, addr = serve(Preconditioned)
    env = dict(os.environ, STORAGE_EMULATOR_HOST=addr, PYTHONPATH=ROOT)
    prefix, obj = f'gs://{BUCKET}/r2', 'r2/run.lock'

    def locker():
        p = subprocess.Popen([sys.executable, '-c', LOCKER, prefix, str(tmp_path)], env=env, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        return p, p.stdout.readline()
    try:
        first, said = locker()
        assert said.strip() == '[]' and json.loads(Preconditioned.objects[obj])['pid'] == first.pid, said
        second, said = locker()  # the first still runs: refused, naming it
        assert f'{prefix} is in use by the run on {socket.gethostname()}, pid {first.pid}' in said, said
        second.communicate('', timeout=60)
        first.kill()  # gone without removing its lock (SIGKILL, a crashed VM): the next run takes it over
        first.wait()
        third, said = locker()
        assert 'taking over the lock of a run that is gone' in said and f'pid {first.pid}' in said, said
        assert third.stdout.readline().strip() == '[]'
        assert json.loads(Preconditioned.objects[obj])['pid'] == third.pid
        third.communicate('', timeout=60)  # a normal exit removes the lock object
        assert obj not in Preconditioned.objects
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_gs_lock_has_a_lease_its_run_renews_and_another_host_takes_over_once_it_ran_out(tmp_path):
    srv, addr = serve(Preconditioned)
    env = dict(os.environ, STORAGE_EMULATOR_HOST=addr, PYTHONPATH=ROOT, TRM_LOCK_LEASE_S='3')
    prefix, obj = f'gs://{BUCKET}/r9', 'r9/run.lock'

    def locker():
        p = subprocess.Popen([sys.executable, '-c', LOCKER, prefix, str(tmp_path)], env=env, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        said = []
        while not said or not said[-1].startswith('['):
            said.append(p.stdout.readline())
            assert said[-1], said
        return p, ''.join(said)
    procs = []
    try:
        first, said = locker()
        procs.append(first)
        assert said.strip() == '[]', said
        renewed, deadline = json.loads(Preconditioned.objects[obj])['renewed'], time.time() + 3
        while json.loads(Preconditioned.objects[obj])['renewed'] == renewed:  # every third of the lease
            assert time.time() < deadline, 'the lock was not renewed within its lease of 3 s'
            time.sleep(0.05)
        first.communicate('', timeout=60)
        assert obj not in Preconditioned.objects

        # the lock of a VM that was hard-stopped a moment ago (another host, a lease of 15 s)
        dead = dict(host='old-vm', pid=4242, since='then', boot='x', renewed=time.time(), lease=15.0)
        Preconditioned.objects[obj] = json.dumps(dead).encode()
        second, said = locker()
        procs.append(second)
        assert 'old-vm' in said and 'waiting' in said and 'taking over' in said and said.endswith('[]\n'), said
        assert json.loads(Preconditioned.objects[obj])['pid'] == second.pid

        # a lock of another host that its run renews while this one waits: in use, not taken
        alive = dict(dead, host='live-vm', renewed=time.time())
        second.kill()
        second.wait()
        Preconditioned.objects[obj] = json.dumps(alive).encode()
        stop = threading.Event()

        def renew():  # the live run, every second
            while not stop.wait(1.0):
                Preconditioned.objects[obj] = json.dumps(dict(alive, renewed=time.time())).encode()
        threading.Thread(target=renew, daemon=True).start()
        try:
            third, said = locker()
        finally:
            stop.set()
        procs.append(third)
        assert f'{prefix} is in use by the run on live-vm' in said, said
        assert json.loads(Preconditioned.objects[obj])['host'] == 'live-vm'
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        srv.shutdown()
        srv.server_close()


class Refusing(Preconditioned):
    """Preconditioned, answering 403 to every request while `refuse` is set (credentials revoked mid-run)."""
    refuse = False

    def refused(self):
        if Refusing.refuse:
            self.reply(403, json.dumps(dict(error=dict(code=403, message='permission denied'))).encode())
        return Refusing.refuse

    def do_GET(self):
        self.refused() or super().do_GET()

    def do_POST(self):
        self.refused() or super().do_POST()


def test_a_lock_renewal_that_fails_for_a_while_is_said_once_and_again_when_it_works(tmp_path):
    srv, addr = serve(Refusing)
    env = dict(os.environ, STORAGE_EMULATOR_HOST=addr, PYTHONPATH=ROOT, TRM_LOCK_LEASE_S='1.5')
    obj = 'r12/run.lock'
    p = subprocess.Popen([sys.executable, '-c', LOCKER, f'gs://{BUCKET}/r12', str(tmp_path)], env=env, text=True,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert p.stdout.readline().strip() == '[]'
        Refusing.refuse = True  # renewals every 0.5 s: several fail
        time.sleep(3)
        Refusing.refuse = False
        renewed, deadline = json.loads(Refusing.objects[obj])['renewed'], time.time() + 30
        while json.loads(Refusing.objects[obj])['renewed'] == renewed:
            assert time.time() < deadline, 'the lock was not renewed once the bucket answered again'
            time.sleep(0.05)
        time.sleep(0.5)
        out = p.communicate('', timeout=60)[0]
    finally:
        Refusing.refuse = False
        if p.poll() is None:
            p.kill()
            p.wait()
        srv.shutdown()
        srv.server_close()
    assert out.count('could not renew the lock') == 1 and 'HTTP 403' in out, out
    assert out.count('renewed again') == 1, out


# A Ctrl-C (KeyboardInterrupt raised where the signal's would be) or a kill (os._exit: no finally runs, as under
# SIGKILL) at the n-th audited operation (a file opened, a folder locked, a link, a removal...) of taking a lock,
# in a process of its own: between two steps of the code
INTERRUPTED_AT = """
import json, os, sys
from runkeep import locks
folder, name, what, n, stop = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
seen = 0
def ctrl_c(event, args):
    global seen
    if armed:
        seen += 1
        if seen == n and stop == 'kill':
            os._exit(3)
        if seen == n:
            raise KeyboardInterrupt
armed = False
sys.addaudithook(ctrl_c)
armed = True
try:
    problems = locks.create_lock(folder, name, what)
    armed = False
    print(json.dumps(dict(done=True, problems=problems, pid=os.getpid())))
except KeyboardInterrupt:
    armed = False
    print(json.dumps(dict(done=False)))
"""


@pytest.mark.parametrize('stop', ['ctrl_c', 'kill'])
@pytest.mark.parametrize('name, what', [('run.lock', 'run'), ('.publishing.lock', 'publish'),
                                        ('study.lock', 'study')])
def test_a_stop_at_any_point_of_taking_a_lock_leaves_none_that_refuses_the_next_holder(tmp_path, name, what, stop):
    """A lock created empty and written after (O_EXCL, then its record) left an empty file by a Ctrl-C between the
    two: unreadable, never stale, it refused every later run, publish or study in that folder until removed by
    hand. Stopped at every step in turn, taking the lock leaves none, or one whose holder is gone; and the next
    holder leaves the folder with its lock alone, no record a killed holder left half placed beside it."""
    folder = tmp_path / 'out'
    for n in range(1, 200):
        p = subprocess.run([sys.executable, '-c', INTERRUPTED_AT, str(folder), name, what, str(n), stop], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == (3 if stop == 'kill' else 0) or p.stdout, p.stderr[-3000:]
        said = json.loads(p.stdout.splitlines()[-1]) if p.stdout else dict(done=False)
        if said['done']:  # past the last step: taken whole
            assert said['problems'] == [] and locks.local_record(str(folder / name))['pid'] == said['pid']
            assert n > 5, 'the steps of taking a lock were not seen'
            break
        assert locks.create_lock(str(folder), name, what) == [], f'stopped at step {n}'
        assert locks.local_record(str(folder / name))['pid'] == os.getpid()
        assert sorted(os.listdir(folder)) == [name], f'stopped at step {n}'
        os.remove(folder / name)
    else:
        raise AssertionError('taking the lock was interrupted at each of 199 steps')
