"""
An out_dir belongs to one run: a lock file in the local folder (and a lock object with a lease beside a gs://
out_dir's checkpoints), taken by rank 0 at the start and removed at every exit: the loop's end, a stop request, a
failed check, a hard exit (signals.BEFORE_HARD_EXIT), any other exit of the process (atexit). A dataset in use
carries a mark, removed with the locks, so a builder asked to replace it says that the run goes on with the old.
"""
import atexit
import contextlib
import errno
import fcntl
import json
import os
import socket
import threading
import time

from data import IN_USE

from . import gcs
from .signals import BEFORE_HARD_EXIT, STOP

LOCK_NAME = 'run.lock'
HELD = []  # the locks this process holds: local paths or gs:// URIs
# a gs:// lock's lease: its holder renews it every third of this; a run on another host (a replacement VM)
# takes over a lock whose lease ran out, and waits for one that has not, unless it is renewed meanwhile
LEASE_S = float(os.environ.get('TRM_LOCK_LEASE_S') or 120)
# the pid of the study.py that started this run (its environment), kept in the lock: a study rerun after the first
# was killed tells that study's train.py, which saves and stops on its own, from a run of somebody else's
STUDY_VAR = 'TRM_STUDY_PID'


def boot_id():
    """This boot of this host ('' off Linux): a lock from before a restart is stale whatever its pid."""
    try:
        with open('/proc/sys/kernel/random/boot_id') as f:
            return f.read().strip()
    except OSError:
        return ''


def proc_stat(pid):
    """The fields of /proc/<pid>/stat after the process's name (field 3 on), or None off Linux or when there is
    no such process: the name, in parentheses, may hold spaces."""
    try:
        with open(f'/proc/{int(pid)}/stat') as f:
            return f.read().rsplit(')', 1)[1].split()
    except (OSError, ValueError, IndexError, TypeError):
        return None


def started(pid):
    """When process `pid` started, in clock ticks since boot (None off Linux or when there is no such process):
    a pid outlives its process (a container restarted as pid 1, a host that reuses pids), a pid and its start
    do not."""
    fields = proc_stat(pid)
    try:
        return int(fields[19])  # field 22
    except (ValueError, IndexError, TypeError):
        return None


def ended(pid):
    """Whether process `pid` has ended but is not yet waited for by its parent (a zombie: it holds nothing; an
    orphan adopted by a container's first process that reaps nothing stays one)."""
    fields = proc_stat(pid)
    return bool(fields) and fields[0] in ('Z', 'X')  # field 3, the state


def lock_record():
    return dict(host=socket.gethostname(), pid=os.getpid(), since=time.strftime('%Y-%m-%d %H:%M:%S %Z'),
                boot=boot_id(), started=started(os.getpid()), renewed=time.time(), lease=LEASE_S,
                study=os.environ.get(STUDY_VAR))


def holder_gone(rec):
    """Whether the run holding a lock ran on this host and is gone (ended, killed, the host restarted, or its
    pid now another process's)."""
    if not isinstance(rec, dict) or rec.get('host') != socket.gethostname():
        return False  # another host's run: this host cannot tell
    if rec.get('boot') and rec['boot'] != boot_id():
        return True
    if rec.get('started') is not None and started(rec.get('pid')) not in (None, rec['started']) or \
            ended(rec.get('pid')):
        return True
    try:
        os.kill(int(rec['pid']), 0)
    except ProcessLookupError:
        return True
    except (OSError, KeyError, TypeError, ValueError):  # PermissionError: alive, another user's
        pass
    return False


def in_use(where, rec, remove, what='run', key='out_dir'):
    who = f"the {what} on {rec.get('host')}, pid {rec.get('pid')}, since {rec.get('since')}" \
        if isinstance(rec, dict) else f'a {what} whose lock cannot be read'
    return (f"{where} is in use by {who} (lock {remove}): wait for it to end, pick another --{key}, or "
            f"remove the lock if that {what} is gone")


def taken_over(rec, where, what='run'):
    """Whether the lock at `where`, holding rec, belongs to a run (or study) that is gone (and may be taken
    over: said so)."""
    if not holder_gone(rec):
        return False
    print(f"{where}: taking over the lock of a {what} that is gone (on {rec.get('host')}, pid {rec.get('pid')}, "
          f"since {rec.get('since')})")
    return True


@contextlib.contextmanager
def one_at_a_time(folder):
    """The block run by one process of this host at a time (an flock of the folder; where the filesystem has
    none, the block runs as it is): of two runs that find the same stale lock, the second must not remove the
    lock the first took over."""
    with contextlib.ExitStack() as stack:
        with contextlib.suppress(OSError):
            fd = os.open(folder, os.O_RDONLY)
            stack.callback(os.close, fd)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield


def lock_local(folder):
    """Rank 0: this folder's lock, taken atomically (create_lock); [] or [the problem]."""
    problems = create_lock(folder)
    if not problems:
        HELD.append(os.path.join(folder, LOCK_NAME))
    return problems


def create_lock(folder, name=LOCK_NAME, what='run', key='out_dir', where=None, bare_when_full=False):
    """The lock file <folder>/<name> taken, with this process's record in it, by one process of this host at a
    time (what, key and where: the holder and its option in the messages, and what is in use: folder); a lock of
    a holder that is gone is taken over once. [] or [the problem]. Releasing it is the caller's. A full disk
    refuses the lock, or with bare_when_full (a study, which re-evaluates and reports on a full disk) takes it
    without its record, said."""
    path = os.path.join(folder, name)
    with one_at_a_time(folder):
        for attempt in range(2):
            try:
                os.makedirs(folder, exist_ok=True)
                remove_left_records(path)
                if not place(path, json.dumps(lock_record()), bare_when_full):
                    print(f"{what}: cannot write its holder into the lock {path} (the disk is full); the lock holds")
                return []
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    return [f"cannot write the lock {path}: {e.strerror}; free some space in {folder}"]
                if not isinstance(e, FileExistsError) or not os.path.isdir(folder):  # folder: a file
                    return [f"cannot create the lock {path}: {e.strerror or e}; {key} must be a folder this "
                            f"{what} can write"]
                rec = local_record(path)
                if attempt == 0 and taken_over(rec, path, what):
                    os.remove(path)
                    continue
                return [in_use(where or folder, rec, path, what, key)]


def place(path, text, bare_when_full=False):
    """path created holding text (True), or where the disk is full and bare_when_full, empty (False);
    FileExistsError where it is there. The text is written beside it and linked into place, so the lock never
    exists empty: a process stopped at any point (a Ctrl-C, SIGKILL) leaves no lock or a whole one, which the next
    holder takes over, never an unreadable one that refuses every later run. A filesystem without hard links
    (some FUSE mounts) gets the lock created exclusively and written after."""
    tmp = f'{path}.{socket.gethostname()}.{os.getpid()}.tmp'  # remove_left_records knows these names
    try:
        try:
            with open(tmp, 'w') as f:
                f.write(text)
        except OSError as e:
            if not bare_when_full or e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            open(tmp, 'w').close()
            text = ''
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise
        except OSError:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            try:
                with os.fdopen(fd, 'w') as f:
                    f.write(text)
            except BaseException:
                os.remove(path)
                raise
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)
    return bool(text)


def remove_left_records(path):
    """The records beside the lock at path that a holder of this host stopped before removing (a kill between
    writing and linking it, or during the removal) are removed, so the folder keeps the lock alone."""
    folder, name = os.path.split(path)
    head, tail = f'{name}.{socket.gethostname()}.', '.tmp'  # place's names, the pid between
    for entry in os.listdir(folder):
        pid = entry[len(head):-len(tail)]
        if entry.startswith(head) and entry.endswith(tail) and pid.isdigit() and \
                holder_gone(dict(host=socket.gethostname(), pid=int(pid))):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(folder, entry))


def local_record(path):
    """The record of the local lock file at path; None where it cannot be read (gone, being written, not JSON)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def read_lock(uri, local):
    """The record of the lock object at uri (None: unreadable); gcs.NotFoundError when there is none."""
    copy = os.path.join(local, f'.{LOCK_NAME}.{os.getpid()}')
    gcs.download_file(uri, copy)
    with open(copy) as f:
        text = f.read()
    os.remove(copy)
    try:
        return json.loads(text)
    except ValueError:
        return None


def lease_ran_out(rec, uri, local):
    """Whether the lock of a run on another host has outlived its lease (and may be taken over: said so).
    One still within it is waited for (a stop ends the wait); a renewal meanwhile means its run is alive."""
    if not isinstance(rec, dict) or rec.get('host') == socket.gethostname() or \
            not isinstance(rec.get('renewed'), (int, float)):
        return False  # this host's runs: holder_gone decides; a lock without a lease: its run's to remove
    left = rec['renewed'] + float(rec.get('lease', LEASE_S)) - time.time()
    if left > 0:
        age = time.time() - rec['renewed']
        print(f"{uri}: held by the run on {rec['host']}, pid {rec.get('pid')}, renewed {age:.0f} s ago: "
              f"waiting {left:.0f} s for its lease to run out", flush=True)
        end = time.time() + left
        while time.time() < end:
            if STOP['requested']:
                return False
            time.sleep(min(1.0, end - time.time()))
        try:
            now = read_lock(uri, local)
        except gcs.NotFoundError:
            return True
        if now != rec:
            return False  # renewed (or taken by another run): in use
    print(f"{uri}: taking over the lock of the run on {rec['host']}, pid {rec.get('pid')}, since "
          f"{rec.get('since')}: its lease ran out (last renewed {time.time() - rec['renewed']:.0f} s ago)")
    return True


def lock_bucket(prefix, local):
    """Rank 0: the lock object beside a gs:// out_dir's checkpoints, created only if absent (a generation
    precondition), then renewed on a thread; [] or [the problem]. A bucket that cannot be reached: a warning
    (its uploads are retried)."""
    uri, mine = f"{prefix.rstrip('/')}/{LOCK_NAME}", lock_record()
    try:
        for attempt in range(2):
            if gcs.create_if_absent(uri, json.dumps(mine).encode()):
                HELD.append(uri)
                renew_lock(uri, mine, local)
                return []
            rec = read_lock(uri, local)
            if rec == mine:  # our own create, whose reply was lost and retried
                HELD.append(uri)
                renew_lock(uri, mine, local)
                return []
            if attempt == 0 and (taken_over(rec, uri) or lease_ran_out(rec, uri, local)):
                gcs.delete_object(uri)
                continue
            return [in_use(prefix, rec, uri)]
    except gcs.NotFoundError:  # removed between the create and the read: its run just ended
        return lock_bucket(prefix, local)
    except gcs.GCSError as e:
        print(f"warning: cannot lock {prefix} ({e}); a second run into it would not be stopped")
        return []


def renew_lock(uri, rec, local):
    """Rank 0: a daemon thread that rewrites the lock object's `renewed` every third of its lease while this
    process holds it; a lock found taken over (this run stalled past its lease) is said once, then left. Renewals
    that fail (an outage, credentials refused) are said at the first, and again when one works."""
    def renew():
        client, failing = gcs.GCS(retries=2, timeout=(5, 10)), False
        while True:
            time.sleep(LEASE_S / 3)
            if uri not in HELD:
                return
            try:
                now = read_lock(uri, local)
                if isinstance(now, dict) and (now.get('host'), now.get('pid')) != (rec['host'], rec['pid']):
                    print(f"warning: {uri} was taken over by the run on {now.get('host')}, pid "
                          f"{now.get('pid')} (this run's lease ran out): stop one of the two runs")
                    return
                client.put(uri, json.dumps(dict(rec, renewed=time.time())).encode())
                if failing:
                    print(f"{uri}: renewed again")
                failing = False
            except Exception as e:  # the next renewal tries again; the lease outlasts two failures
                if not failing:
                    print(f"warning: could not renew the lock {uri} ({e}); retried every {LEASE_S / 3:.0f} s "
                          f"(a run on another host may take it over after {LEASE_S:.0f} s without one)")
                failing = True
    threading.Thread(target=renew, daemon=True).start()


def mark_data(root, out_dir):
    """Rank 0: a mark in the dataset's folder while the run holds it, removed with the locks: a builder
    asked to replace the dataset says that this run goes on with the old one (a read-only folder: no mark)."""
    path = os.path.join(root, f"{IN_USE}{socket.gethostname()}.{os.getpid()}")
    try:
        with open(path, 'w') as f:
            json.dump(dict(host=socket.gethostname(), pid=os.getpid(), out_dir=out_dir), f)
        HELD.append(path)
    except OSError:
        pass


def release_locks(quick=False):
    """Remove the locks this process holds. A lock object gets a bounded wait, one short attempt after a stop
    request (a spot VM's notice is 30 s, the stop checkpoint's upload had most of it): one left behind
    expires with its lease."""
    while HELD:
        where = HELD.pop()
        try:
            if gcs.is_gcs(where):
                gcs.GCS(retries=0, timeout=(2, 3)).delete(where) if quick else \
                    gcs.GCS(retries=2, timeout=(5, 10)).delete(where)
            else:
                os.remove(where)
        except Exception as e:
            then = f"a run on another host takes it over once its lease ({LEASE_S:.0f} s) has run out" \
                if gcs.is_gcs(where) else "the next run on this host takes it over"
            print(f"warning: could not remove the lock {where} ({e}); {then}")


atexit.register(release_locks)
BEFORE_HARD_EXIT.append(release_locks)
