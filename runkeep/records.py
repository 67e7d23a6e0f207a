"""
A run's records: what a person or a study reads of it, during the run and after.
    Records                  metrics.jsonl (a line per log step and evaluation) and results.json
    start_wandb, TensorBoardWriter   the same scalars in W&B and TensorBoard, never fatal
    Uploads                  a gs:// run's records (and checkpoints) sent to its bucket, with bounded waits
    log_line, device_figures, groups   a training log line's values, and how W&B and TensorBoard group them
    RunRecords               all of these for one run (rank 0 writes; every rank calls), behind Run's verbs
Nothing here imports torch.
"""
import atexit
import contextlib
import glob
import json
import netrc
import numbers
import os
import re
import shutil
import threading
import time
import urllib.parse

import numpy as np

from configurator import Tee  # the script's output: rank 0 also copies it to train.log (Run)

from . import gcs
from .signals import BEFORE_HARD_EXIT

# -----------------------------------------------------------------------------
# metrics.jsonl and results.json

def write_atomic(path, write, mode='w', newline=None):
    """write(f) into path, through path.tmp and a rename: readers see the old file or the whole new one. A
    failed write (a full disk) raises OSError naming path; no failure (a Ctrl-C, write's own error) leaves a .tmp
    behind. newline as open's (csv wants '', or Windows doubles its '\r')."""
    try:
        with open(path + '.tmp', mode, newline=newline) as f:
            write(f)
        os.replace(path + '.tmp', path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(path + '.tmp')
        if not isinstance(e, OSError) or e.errno is None:
            raise
        raise OSError(e.errno, e.strerror, path) from e  # a write's or a close's error names no file


def write_json_atomic(path, obj):
    """obj as JSON in path, as write_atomic writes."""
    write_atomic(path, lambda f: json.dump(obj, f, indent=1, default=float))


def flat_scalars(vals):
    """(name, number) pairs of a metrics dict as W&B and TensorBoard chart them: the exact accuracy at each
    test-time step count (exact_at_steps_NN) and each view count's accuracies (vote@NN, ...) one by one."""
    for k, v in vals.items():
        if k == 'exact_by_steps':
            yield from ((f'exact_at_steps_{i + 1:02d}', a) for i, a in enumerate(v))
        elif k == 'by_views':
            yield from ((f'{m}@{row["views"]:02d}', a) for row in v for m, a in row.items() if m != 'views')
        elif isinstance(v, numbers.Real) and not isinstance(v, bool):  # numpy's too
            yield k, v


class Records:
    """metrics.jsonl (one JSON line per log step and per evaluation) and results.json (written once, at the
    end), in the run's folder and mirrored to the bucket. A resumed run drops the lines past its checkpoint's
    step, so it appends without duplicates."""
    def __init__(self, local, remote, step):
        self.path, self.remote = os.path.join(local, 'metrics.jsonl'), remote
        copies = []  # (the lines up to `step`, the steps of those past it) of each copy
        try:
            for path in [self.path] + ([self.fetch(step)] if remote and step > 0 else []):
                if path and os.path.exists(path):
                    # a torn last line goes; bytes that are no UTF-8 (a damaged block) make their line unreadable
                    with open(path, errors='replace') as f:
                        whole = [l for i, l in enumerate(f, 1) if l.endswith('\n') and self.readable(l, i, path)]
                    at = [json.loads(l).get('step') or 0 for l in whole]  # an older watchdog's: null
                    copies.append(([l for l, s in zip(whole, at) if s <= step], [s for s in at if s > step]))
        finally:
            if os.path.exists(self.path + '.bucket'):
                os.remove(self.path + '.bucket')
        # the newest copy: the local one, or the bucket's on a new machine or on one whose folder another machine's
        # resume has overtaken since (it may hold more lines, of steps since undone)
        lines, past = max(copies, key=lambda c: (c[0] and json.loads(c[0][-1]).get('time') or 0, len(c[0])),
                          default=([], []))
        write_atomic(self.path, lambda f: f.writelines(lines))
        if past and step:  # a run killed past its last checkpoint, or one rolled back to an older one: said
            print(f"note: {len(past)} line(s) of {self.path} past step {step} (up to step {max(past)}) dropped: the "
                  f"run goes on from step {step}")
        elif past:  # --overwrite, or a run that never saved a checkpoint: another run's lines
            print(f"note: {len(past)} line(s) of an earlier run (up to step {max(past)}) dropped from {self.path}: "
                  "this run starts anew")
        self.results = os.path.join(local, 'results.json')
        self.lost = 0  # lines not appended since the last one that was

    def fetch(self, step):
        """The bucket's metrics.jsonl in a file beside the local one, or None (none there, or unreachable)."""
        return gcs.download_if_there(f"{self.remote.rstrip('/')}/metrics.jsonl", self.path + '.bucket',
                                     f"metrics.jsonl up to step {step} is rebuilt from {self.path} alone")

    @staticmethod
    def readable(line, number, path):
        """A line that is a JSON record whose step and time are numbers (or null); another (torn by a crash,
        then appended to; damaged; hand-edited) is dropped with a warning: the resume orders lines by them."""
        try:
            rec = json.loads(line)
            ok = isinstance(rec, dict) and all(isinstance(rec.get(k), (int, float, type(None)))
                                               for k in ('step', 'time'))
        except ValueError:
            ok = False
        if not ok:
            print(f"warning: {path} line {number} is not a JSON record (torn by a crash?): dropped: "
                  f"{line.strip()[:80]!r}")
        return ok

    def log(self, kind, values):
        """A line of metrics.jsonl; a failed write (a full disk) is a warning, once until a line is appended
        again, the file is cut back to its last whole line, and the run goes on."""
        line = (json.dumps(dict(kind=kind, time=time.time(), **values), default=float) + '\n').encode()
        end = None
        try:
            with open(self.path, 'ab') as f:
                end = f.tell()
                f.write(line)
        except OSError as e:
            if end is not None:  # a full disk takes the part of the line that fits: the next line would be glued to it
                with contextlib.suppress(OSError):
                    os.truncate(self.path, end)
            if not self.lost:
                print(f"warning: could not append to {self.path} ({e.strerror or e}): this {kind} line and the "
                      "next ones until there is room are not recorded there")
            self.lost += 1
            return
        if self.lost:
            print(f"note: {self.path} is appended to again; {self.lost} line(s) before this one are not in it")
            self.lost = 0

    def logged(self, kind, step):
        try:
            with open(self.path) as f:
                return any((r := json.loads(l)).get('kind') == kind and r.get('step') == step for l in f)
        except (OSError, ValueError, AttributeError):
            return False

    def finish(self, results):
        """results.json; a failed write is a warning: the next --init_from=resume writes it."""
        try:
            write_json_atomic(self.results, results)
        except OSError as e:
            print(f"warning: could not write {self.results} ({e.strerror or e}); rerun with "
                  "--init_from=resume once the disk has room, and it is written")


def save_and_upload(local, remote, name, write, what, retries):
    """write(path) for path = <local>/name; a gs:// run (remote) uploads it to <remote>/name. A failed write or
    upload is a warning: `what` not saved (`what`: its subject and verb). Returns the path or None."""
    path = os.path.join(local, name)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write(path)
        if remote:
            gcs.GCS(retries=retries).upload(path, f"{remote.rstrip('/')}/{name}")
    except (OSError, gcs.GCSError) as e:
        print(f"warning: {what} not saved to {path}{' or its bucket' if remote else ''} "
              f"({getattr(e, 'strerror', None) or e})")
        return None
    return path


def save_evaluation(local, remote, name, record, retries):
    """record as JSON in <local>/name, written atomically, and in the bucket (save_and_upload); a failure is a
    warning (the evaluation was printed). Returns the path or None."""
    path = save_and_upload(local, remote, name, lambda p: write_json_atomic(p, record), 'the evaluation was',
                           retries)
    if path:
        print(f"evaluation saved to {path}")
    return path


def save_submission(local, remote, name, arc, step, retries):
    """ARC's submission (arc: arc.ARCVotes) in <local>/name, the ARC Prize's format exactly, as
    save_evaluation saves a record; returns what the record it belongs to says of it: its file (None: not
    saved), the step of the checkpoint that answered, and the vote it follows."""
    path = save_evaluation(local, remote, name, arc.submission(), retries)
    return dict(file=name if path else None, step=step, vote=arc.submission_vote())


def save_answers(local, remote, name, arc, step, steps, retries):
    """With arc_answers: the final evaluation's answer of every test row (arc.ARCVotes.kept_rows) in <local>/name,
    numpy's npz, with the step of the checkpoint that answered and the supervision steps each row ran: solve.py
    --task=FILE.json shows the votes from it. A failed write or upload is a warning (the submission is written)."""
    rows = arc.kept_rows()
    save_and_upload(local, remote, name, lambda p: write_atomic(
        p, lambda f: np.savez_compressed(f, step=step, steps=steps, **rows), 'wb'), 'the answers were', retries)


# -----------------------------------------------------------------------------
# W&B and TensorBoard: the same scalars, never a reason to lose a run

def start_wandb(cfg, local, run_id):
    """A W&B run; where W&B cannot be reached or is not logged in, an offline one in the run's folder (one
    warning line, `wandb sync` later); where that cannot start either, one warning line and None. W&B is never a
    reason to lose a run."""
    try:
        import wandb
    except Exception as e:  # not installed, or an install it cannot load
        print(f"warning: W&B cannot be imported ({e}): pip install wandb; training goes on without W&B")
        return None
    kw = dict(project=cfg['wandb_project'], name=cfg['wandb_run_name'] or None, id=run_id, resume='allow',
              config=cfg, dir=local, settings=wandb.Settings(init_timeout=30))
    offline = os.environ.get('WANDB_MODE', 'online') in ('offline', 'disabled')
    unavailable = None
    if not offline:
        try:
            if not wandb_key_set():
                raise RuntimeError("not logged in (wandb login, or WANDB_API_KEY)")
            import requests  # a quick look first: wandb.init itself waits long for a server that is not there
            requests.head(os.environ.get('WANDB_BASE_URL', 'https://api.wandb.ai'), timeout=5)
            return wandb.init(**kw)
        except Exception as e:
            unavailable = first_line(e)
    try:
        run = wandb.init(**kw, **(dict(mode='offline') if unavailable else {}))
    except Exception as e:  # the offline run's folder cannot be written: no `wandb sync` to promise
        print(f"warning: W&B {f'unavailable ({unavailable}), and its offline run ' if unavailable else ''}cannot "
              f"start in {local}/wandb ({first_line(e)}); training goes on without W&B")
        return None
    if unavailable:
        print(f"warning: W&B unavailable ({unavailable}); logging offline in {local}/wandb: "
              f"`wandb sync {local}/wandb/offline-run-*` uploads it later")
    return run


def first_line(e):
    """An exception's first line, short (W&B's errors carry pages of detail)."""
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__


def wandb_key_set():
    """Whether W&B has an API key here: WANDB_API_KEY, or the .netrc entry of its server that `wandb login`
    writes. Looked up without wandb, whose own lookup (wandb.api) is deprecated and warns at every call."""
    if os.environ.get('WANDB_API_KEY'):
        return True
    server = urllib.parse.urlsplit(os.environ.get('WANDB_BASE_URL') or 'https://api.wandb.ai').netloc
    files = [os.environ['NETRC']] if os.environ.get('NETRC') else ['~/.netrc', '~/_netrc']
    for path in (os.path.expanduser(f) for f in files):
        if os.path.exists(path):
            try:
                return netrc.netrc(path).authenticators(server) is not None
            except (OSError, netrc.NetrcParseError):
                return False
    return False


def wandb_log_safe(run, values, step):
    """run.log(values) at `step`; a W&B that fails (its service process killed, a full disk under an offline run)
    is one warning, and its run is let go: W&B's own exit would only fail again. Returns whether W&B goes on."""
    try:
        if values:
            run.log(values, step=step)
        return True
    except Exception as e:
        print(f"warning: W&B failed at step {step} ({first_line(e)}); training goes on without W&B "
              "(metrics.jsonl and TensorBoard keep every line)")
        with contextlib.suppress(Exception):
            import wandb
            wandb.teardown()  # its exit hook goes, and with it a traceback at the process's exit
        return False


class TensorBoardWriter:
    """TensorBoard's event files of a run (rank 0), written by torch's SummaryWriter into <run>/tb: one file
    per process, which begins by purging the steps after the one it continues from (TensorBoard's Python reader
    drops them from the files before it), and the files before it are first cut to that step (its fast loader
    ignores the purge), so a resumed run shows every step once, as metrics.jsonl does (a gs:// run on a new
    machine fetches its bucket's files first: cut here, the resume sends them back). A failure (a full or
    read-only disk) is one warning, and the run goes on without events; a tb/ deleted under the run is made
    again, and the rest of the history goes into a new file there."""

    def __init__(self, writer):
        self.writer = writer
        self.path = writer.file_writer.event_writer._file_name

    @property
    def name(self):  # the event file's, under tb/ in the bucket too
        return os.path.basename(self.path)

    @classmethod
    def open(cls, local, step, cfg, remote=None):
        try:
            if remote and step:  # a resume: what its catch_up sends back cut
                fetch_events(remote, os.path.join(local, 'tb'))
            # from scratch (a new run over an earlier one: --overwrite): none of the earlier records are this run's,
            # its config text at step 0 neither, here or in the bucket
            cut_events(os.path.join(local, 'tb'), step if step else -1)
            if remote and not step:
                drop_events(remote)
            board = cls(cls.summary_writer(os.path.join(local, 'tb'), step + 1))
            if step == 0:  # the config once, as a table
                board.writer.add_text('config', '\n'.join(['| key | value |', '|---|---|'] + [
                    f'| {k} | {v!r} |' for k, v in cfg.items()]), 0)
            atexit.register(board.close)  # an exit by an error (divergence, a failed check) keeps its lines
            return board
        except Exception as e:
            print(f"warning: TensorBoard events cannot be written in {local}/tb ({e}); the run goes on "
                  "without them")
            return None

    @staticmethod
    def summary_writer(folder, purge_step):
        from torch.utils.tensorboard import SummaryWriter
        if threading.excepthook is not quiet_event_writers:
            quiet_event_writers.default, threading.excepthook = threading.excepthook, quiet_event_writers
        return SummaryWriter(folder, purge_step=purge_step, flush_secs=30)

    def log(self, groups, step):
        if self.writer is None:
            return
        try:
            try:
                self.write(groups, step)
            except Exception:
                if os.path.exists(self.path):
                    raise
                self.write(groups, step)  # tb/ deleted while this line was written: made again, written again
        except Exception as e:
            print(f"warning: TensorBoard events cannot be written in {os.path.dirname(self.path)} at step "
                  f"{step} ({e}); the run goes on without them")
            self.close()
            self.writer = None

    def write(self, groups, step):
        if not os.path.exists(self.path):  # tb/ (or its file) deleted under the run
            folder = os.path.dirname(self.path)
            self.close()
            self.writer = self.summary_writer(folder, step)
            self.path = self.writer.file_writer.event_writer._file_name
            print(f"warning: {folder} was deleted under the run: made again, its TensorBoard events go on "
                  f"from step {step} in {os.path.basename(self.path)}")
        for prefix, vals in groups.items():
            for k, v in flat_scalars(vals):
                self.writer.add_scalar(f'{prefix}/{k}', v, step)
        self.writer.flush()  # each line on disk as it is printed, as metrics.jsonl's: a killed run keeps them all

    def snapshot(self, path):
        """A copy of the event file as written so far (flushed first), or None."""
        if self.writer is None:
            return None
        try:
            self.writer.flush()
            shutil.copyfile(self.path, path)
            return path
        except Exception as e:
            print(f"warning: cannot copy the TensorBoard events for their upload ({e})")
            return None

    def close(self):
        with contextlib.suppress(Exception):
            self.writer.close()


def cut_events(folder, step):
    """The event files in folder (earlier processes') without their records past `step`, nor past the step
    before the one a later file's process resumed from (its purge: a machine back on the run holds in its own file
    the steps another machine undid since), each rewritten through cut.tmp (no 'tfevents' in its name:
    TensorBoard reads no leftover of it), or removed where none is left; a torn last record goes too. A record is
    TFRecord's: an 8-byte length, its 4-byte CRC, the Event, the Event's CRC, both CRCs checked; the records kept are
    copied as they are. A file that cannot be cut (a damaged record) is a warning, and kept whole."""
    from tensorboard.compat.proto.event_pb2 import Event, SessionLog
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
    tmp = os.path.join(folder, 'cut.tmp')
    for path in sorted(glob.glob(os.path.join(folder, '*tfevents*')), reverse=True):  # the latest purge first
        try:
            with open(path, 'rb') as f:
                data = f.read()
            kept, at, starts = [], 0, []
            while at + 12 <= len(data):
                # a length its CRC does not match: a damaged block, whose later records a cut would drop as a torn
                # tail's, or the zeros a crash left past the last record
                if masked_crc32c(data[at:at + 8]) != int.from_bytes(data[at + 8:at + 12], 'little'):
                    if data[at:].strip(b'\0'):
                        raise ValueError(f"a damaged record at byte {at}, records after it")
                    break
                if (end := at + 16 + int.from_bytes(data[at:at + 8], 'little')) > len(data):
                    break
                if masked_crc32c(data[at + 12:end - 4]) != int.from_bytes(data[end - 4:end], 'little'):
                    raise ValueError(f"a damaged record at byte {at}")
                event = Event.FromString(data[at + 12:end - 4])
                if event.step <= step:
                    kept.append(data[at:end])
                if event.session_log.status == SessionLog.START:
                    starts.append(event.step)
                at = end
            if not kept:
                os.remove(path)
            elif sum(map(len, kept)) < len(data):
                with open(tmp, 'wb') as f:
                    f.writelines(kept)
                os.replace(tmp, path)
            step = min([step] + [s - 1 for s in starts])
        except Exception as e:
            print(f"warning: cannot cut {path} to the steps up to {step} ({e}); TensorBoard's fast loader may "
                  "show its later steps (tensorboard --load_fast=false does not)")
        finally:
            with contextlib.suppress(OSError):
                os.remove(tmp)


def fetch_events(remote, folder):
    """The event files under the bucket's <remote>/tb that folder lacks (a new machine's), fetched into it, each
    through fetch.tmp (no 'tfevents' in its name); one that cannot be fetched is a warning."""
    try:
        there = gcs.list_objects(f"{remote.rstrip('/')}/tb/")
    except gcs.GCSError as e:
        print(f"warning: cannot list {remote}/tb ({e}); its earlier event files may show steps past the resumed "
              "checkpoint in TensorBoard's fast loader (tensorboard --load_fast=false does not)")
        return
    for uri, _ in there:
        path = os.path.join(folder, uri.rsplit('/', 1)[1])
        if 'tfevents' in os.path.basename(path) and not os.path.exists(path):
            tmp = gcs.download_if_there(uri, os.path.join(folder, 'fetch.tmp'), "it is left as it is")
            if tmp:
                os.replace(tmp, path)


def drop_events(remote):
    """The event files under the bucket's <remote>/tb deleted (an earlier run's, which TensorBoard on the bucket
    would show beside this one's)."""
    drop_in_bucket(f"{remote.rstrip('/')}/tb/", lambda name: 'tfevents' in name,
                   "event files", "TensorBoard on the bucket shows them beside this run's")


def drop_in_bucket(prefix, wanted, what, then):
    """An earlier run's objects under the bucket's prefix whose names `wanted` takes, deleted; a bucket that cannot
    delete one is a warning naming `what` and what follows (`then`)."""
    try:
        for uri, _ in gcs.list_objects(prefix):
            if wanted(uri.rsplit('/', 1)[1]):
                gcs.delete_object(uri)
    except gcs.GCSError as e:
        print(f"warning: cannot delete the earlier run's {what} in {prefix.rstrip('/')} ({e}); {then}")


def quiet_event_writers(args):
    """threading.excepthook: an event writer's thread that failed (a full disk) says nothing, as its writer's
    next use raises that failure, which TensorBoardWriter says once; any other thread's goes on as before."""
    if type(args.thread).__name__ != '_AsyncWriterThread':
        quiet_event_writers.default(args)


# -----------------------------------------------------------------------------
# uploads of a gs:// run's files: its records, its checkpoints, its profile

# copies of growing files (train.log, metrics.jsonl, TensorBoard's events) taken for an upload, removed once
# uploaded
GROWING = ('train.log', 'metrics.jsonl')
SNAPSHOTS = tuple(f'.{name}.' for name in GROWING) + ('.tb.',)
# a checkpoint's name: eight digits at least (a ninth from step 10^8 on). The lister, the pruning, the uploads'
# order and solve.py's hint read names by CKPT_RE alone: a name by itself, or ending a path or URI
CKPT_RE = re.compile(r'(?:^|/)ckpt_(\d{8,})\.pt$')


def checkpoint_name(step):
    return f'ckpt_{step:08d}.pt'


def snapshot_of(path):
    """What an upload's local file stands for (a snapshot: the file it copies)."""
    name = os.path.basename(path)
    copied = [n for n in GROWING if name.startswith(f'.{n}.')]
    return copied[0] if copied else 'tb' if name.startswith('.tb.') else name


class Uploads:
    """Rank 0 of a gs:// run: files of its local folder sent to the same names under the bucket's out_dir, in
    order (but the newest checkpoint first: order), on a thread (gcs.Uploader). on_checkpoint() runs after each
    upload of a checkpoint (the bucket is pruned like the local folder)."""

    def __init__(self, local, remote, on_checkpoint):
        self.local, self.remote, self.on_checkpoint = local, remote.rstrip('/'), on_checkpoint
        self.uploader = gcs.Uploader(on_success=self.uploaded, order=self.order)
        self.snapshots, self.newest = 0, -1  # the step of the newest checkpoint submitted

    def order(self, jobs):
        """The waiting uploads in the order they go: the newest checkpoint first, then the rest as submitted, and
        the older checkpoints last, newer first. After an outage a resume needs the newest, and a VM lost while
        the queue drains would leave the bucket an older one as its newest; the older ones are still kept here,
        so still wanted there."""
        def rank(job):  # sorted() keeps the submit order within a rank
            step = int(m.group(1)) if (m := CKPT_RE.search(job[1])) else None
            return (1, 0) if step is None else (0, 0) if step >= self.newest else (2, -step)
        return sorted(jobs, key=rank)

    def submit(self, path, name=None):
        """path to <out_dir>/name (name: its path under the run's folder)."""
        uri = f"{self.remote}/{name or os.path.relpath(path, self.local).replace(os.sep, '/')}"
        if m := CKPT_RE.search(uri):
            self.newest = max(self.newest, int(m.group(1)))
        self.uploader.submit(path, uri)

    def supersede(self, name):
        """The older snapshots of <out_dir>/name that wait for their turn, or failed, deleted: a newer one is
        coming, and the uploader skips a file deleted before its turn. In an outage every checkpoint queues its
        snapshots; kept, each would wait on disk and then be sent, ahead of the newest checkpoint, once the bucket
        answers. The first pending upload is left alone: the uploader may have it open."""
        uri, up = f"{self.remote}/{name}", self.uploader
        for path, to in list(up.pending)[1:] + list(up.failed):
            if to == uri and os.path.basename(path).startswith(SNAPSHOTS):
                with contextlib.suppress(OSError):
                    os.remove(path)

    def wait(self, timeout=None):
        return self.uploader.wait(timeout=timeout)

    def checkpoint_s(self):
        """The slowest checkpoint upload so far in seconds, None before the first (--max_minutes keeps time for the
        final one: the end waits for it)."""
        return max((s for uri, s in list(self.uploader.took.items()) if CKPT_RE.search(uri)), default=None)

    def log(self, name='train.log'):
        """A growing file of the run's folder (GROWING: train.log, metrics.jsonl) as it is now (a preempted VM's
        disk goes with the VM, and a resume on a new machine goes on with the bucket's). It grows while it
        uploads, so a snapshot goes, `.<name>.N`, one per upload (they run in order: the newest wins); each is
        deleted once uploaded or once a newer one is queued (supersede), what is left at exit too."""
        self.snapshots += 1
        snapshot = os.path.join(self.local, f'.{name}.{self.snapshots}')
        try:
            shutil.copyfile(os.path.join(self.local, name), snapshot)
        except OSError:
            return
        self.supersede(name)
        self.submit(snapshot, name)

    def board(self, board):
        """The TensorBoard event file as it is now to <out_dir>/tb/ (a snapshot, as train.log's)."""
        if board:
            self.snapshots += 1
            snap = board.snapshot(os.path.join(self.local, f'.tb.{self.snapshots}'))
            if snap:
                self.supersede(f'tb/{board.name}')
                self.submit(snap, f'tb/{board.name}')

    def folder(self, path):
        """Every file under the run's folder `path` (a profile)."""
        if path and os.path.isdir(path):
            for folder, _, names in os.walk(path):
                for name in names:
                    self.submit(os.path.join(folder, name))

    def catch_up(self, checkpoint, done, skip=()):
        """At a resume: what the run's earlier processes left only here (the bucket unreachable at their end) sent
        now, ahead of this process's files, where the bucket lacks it or holds another size: the checkpoint
        resumed (a local path), metrics.jsonl, the files of tb/ and profile/ but `skip` (this process's own,
        still written), and for a run found `done` its results.json (and ARC's submission.json; otherwise a
        results.json here is an earlier finish's, not this run's). train.log, which this process extends, goes
        with its first checkpoint or at its end, as always."""
        try:
            there = dict(gcs.list_objects(self.remote + '/'))
        except gcs.GCSError as e:
            print(f"warning: cannot list {self.remote} ({e}); files only in {self.local} are sent by the next "
                  "resume")
            return
        names = ['metrics.jsonl'] + (['submission.json', 'results.json'] if done else [])
        paths = ([] if gcs.is_gcs(checkpoint) else [checkpoint]) + [os.path.join(self.local, n) for n in names]
        for sub in ('tb', 'profile'):
            for folder, _, files in sorted(os.walk(os.path.join(self.local, sub))):
                paths += [os.path.join(folder, n) for n in sorted(files)]
        sent = []
        for path in paths:
            name = os.path.relpath(path, self.local).replace(os.sep, '/')
            if name not in skip and os.path.isfile(path) and \
                    there.get(f'{self.remote}/{name}') != os.path.getsize(path):
                self.log(name) if name == 'metrics.jsonl' else self.submit(path, name)
                sent.append(name)
        if sent:
            print(f"{self.remote} lacks what an earlier process left in {self.local}: uploading {', '.join(sent)}")

    def uploaded(self, path, uri):
        """After each upload: a snapshot goes; a checkpoint prunes the bucket's older ones."""
        if os.path.basename(path).startswith(SNAPSHOTS):
            with contextlib.suppress(OSError):  # already gone: removed at exit
                os.remove(path)
        else:
            self.on_checkpoint()

    def settle(self, interrupted):
        """A wait for the uploads, bounded at 18 s after a stop request (a spot VM has ~30 s: the checkpoint gets
        most of it), else 30 s plus 1 s per 20 MB to send, announced after 3 s. Returns whether all are done."""
        up = self.uploader
        size = sum(os.path.getsize(p) for p, _ in list(up.pending) if os.path.exists(p))
        limit = 18 if interrupted else 30 + size / 20e6
        if up.wait(timeout=3):
            return True
        print(f"waiting up to {limit - 3:.0f} s for {len({uri for _, uri in up.pending})} upload(s) to "
              f"{self.remote}", flush=True)
        return up.wait(timeout=limit - 3)

    def finish(self, interrupted, records, board):
        """The records' uploads, then their bounded wait (settle); then the files that did not reach the bucket
        are named. metrics.jsonl goes as a snapshot, as train.log does, so it replaces the one queued with the
        last checkpoint: each record is sent once at the end, the newest copy."""
        up = self.uploader
        if records:
            self.log('metrics.jsonl')
            if os.path.exists(records.results):
                self.submit(records.results)
        self.log()
        self.board(board)
        self.settle(interrupted)
        for what, jobs in (('still running at exit', list(up.pending)), ('failed', list(up.failed))):
            left = [p for p, _ in jobs if os.path.exists(p)]  # a file pruning deleted was replaced by a newer
                                                              # one
            names = list(dict.fromkeys(snapshot_of(p) for p in left))
            if names:
                print(f"warning: {len(names)} upload(s) to {self.remote} {what}; only in {self.local}: "
                      f"{', '.join(names)}")
        for name in os.listdir(self.local):
            if name.startswith(SNAPSHOTS):
                with contextlib.suppress(OSError):  # (the upload thread may remove it too)
                    os.remove(os.path.join(self.local, name))


# -----------------------------------------------------------------------------
# a training log line: what train.py prints, metrics.jsonl keeps, W&B and TensorBoard chart


def log_line(m, step, n_steps, seconds, epoch, lr, batch, q_continue):
    """A log line's values from the metric sums m of the last n_steps steps of `batch` examples each. The
    accuracies and steps are means over the rows that halted in them, and absent where none did (undefined,
    not 0). The loss's terms (loss = lm_loss + 0.5 * (q_halt_loss + q_continue_loss)) each on its own;
    q_continue_loss only where it is learned."""
    cnt = m['count']
    halted = {k: m[k] / cnt for k in ('accuracy', 'exact_accuracy', 'q_halt_accuracy', 'steps')} if cnt else {}
    terms = ('lm_loss', 'q_halt_loss') + (('q_continue_loss',) if q_continue else ())
    return dict(step=step, epoch=epoch, loss=m['loss'] / (batch * n_steps), **halted,
                grad_norm=m['grad_norm'] / n_steps, lr=lr,
                **{k: m[k] / (batch * n_steps) for k in terms if k in m},
                examples_per_s=batch * n_steps / max(seconds, 1e-9),
                ms_per_step=1e3 * seconds / n_steps)


def device_figures(dev, n_steps, host_s, mark, seconds, flops_per_s, xla_then):
    """The device's side of a log line over its n_steps in `seconds`: on XLA the host's and the device's
    milliseconds per step (which one bounds a step: the host's tracing or the device's execution, the time it
    was busy since `mark`, execution_mark's), MFU where the chip's peak is
    known (the model's FLOPs per second over the chips' peak), memory in use (TPU: HBM; CUDA: allocated; else
    the RSS), and XLA's compilations since xla_then."""
    out, peak = {}, dev.peak_tflops()  # one chip's dense bf16 TFLOP/s (None on a CPU)
    if dev.type == 'xla':
        out.update(host_ms=1e3 * host_s / n_steps, device_ms=1e3 * dev.busy_fraction(mark) * seconds / n_steps)
    if peak:
        out['mfu'] = flops_per_s / (peak * 1e12 * dev.world_size)
    mem, out['memory'] = dev.memory_in_use()
    out.update(memory_gib=mem / 2 ** 30, **xla_since(dev.xla_counters(), xla_then))
    return out


def warn_recompiles(line, first, last):
    """XLA graphs compiled in steps first..last, past the warm-up: said once per log line."""
    if line.get('xla_compiles'):
        print(f"warning: {line['xla_compiles']} XLA graph compilation(s) ({line['xla_compile_s']:.1f} s) in "
              f"steps {first}-{last}, after warm-up: a shape or a Python value that changes reaches the "
              "step's graph, and every step may be compiling anew")


def eval_line(step, res, raw, xla):
    """An evaluation's line of metrics.jsonl (the raw weights' results too, when evaluated; on XLA the graphs
    it compiled) and its scalars for W&B and TensorBoard."""
    compiles = {'xla_compiles': xla['xla_compiles']} if xla else {}
    return (dict(step=step, **res, **(dict(raw=raw) if raw else {}), **compiles),
            dict(eval=charted(res), eval_raw=charted(raw or {}),
                 xla=dict(eval_compiles=xla['xla_compiles']) if xla else {}))


def charted(res):
    """An evaluation's results as W&B and TensorBoard chart them: where no test row has a known answer (a hidden
    test set's), its accuracies, losses and steps over those rows are over none, and their zeros no figures (the
    console says so): only its count, steps run, views, cost and ARC's counts are."""
    if not res or res['count']:
        return res
    return {k: v for k, v in res.items() if k in ('count', 'steps', 'views', 'eval_flops') or k.startswith('arc_')}


def xla_since(now, then):
    """XLA's counters at a log line: the compilations since the last one (their count, seconds) and the
    totals so far; {} off XLA."""
    if not now:
        return {}
    return dict(xla_compiles=now['compiles'] - then['compiles'],
                xla_compile_s=now['compile_s'] - then['compile_s'], xla_compiles_total=now['compiles'],
                xla_execute_s=now['execute_s'], xla_transfers=now['transfers'])


def groups(line):
    """A train line's scalars as W&B and TensorBoard show them: train/, perf/ and xla/."""
    perf = ('examples_per_s', 'ms_per_step', 'mfu', 'host_ms', 'device_ms', 'memory_gib')
    return dict(train={k: v for k, v in line.items() if k not in perf and not k.startswith('xla_')
                       and k not in ('step', 'epoch', 'memory')},
                perf={k: line[k] for k in perf if k in line},
                xla={k[4:]: v for k, v in line.items() if k.startswith('xla_')})


# -----------------------------------------------------------------------------
# the run folder's log, leftovers and results.json

def start_log(local, gs_out, resuming):
    """Rank 0: stdout and stderr also into <local>/train.log; a gs:// run resumed on a new machine first
    fetches the bucket's log, so it goes on with it, and so does one on a machine whose log the bucket's goes on
    from (another machine resumed the run since). Returns where this process's lines begin there (a byte offset),
    for drop_earlier_log."""
    log = os.path.join(local, 'train.log')
    if gs_out and resuming:
        here = f"{log} goes on as it is" if os.path.exists(log) else "train.log starts anew here"
        take_bucket_log(log, gs_out, Tee.own_part(log), f"{here}, and its upload replaces the bucket's")
    start = os.path.getsize(log) if os.path.isfile(log) else 0
    Tee.log_to(log)
    return start


def drop_earlier_log(local, start):
    """Rank 0, a new run over an earlier one (--overwrite=True): train.log keeps this process's lines alone, from
    byte `start` (its header) on, as metrics.jsonl keeps this run's; `grep` or `tail` of it would mix two runs.
    A log that study.py writes for this process is left as it is: it appends there from its own open file. What
    cannot be rewritten is a warning, and the log goes on as it was."""
    log = os.path.join(local, 'train.log')
    if not start or Tee.log is None or Tee.log.name != log:
        return
    with Tee.lock:  # another thread's line waits, so none goes to the file being replaced
        try:
            with open(log, 'rb') as f:
                f.seek(start)
                ours = f.read()
            write_atomic(log, lambda f: f.write(ours), mode='wb')
            Tee.log = Tee.log.reopened()
            return
        except OSError as e:
            why = e
        if Tee.log.f.closed:  # replaced, but not open again: the terminal alone has the output from here
            Tee.log = None
    print(f"warning: cannot drop the earlier run's lines from {log} ({why.strerror or why}): this run's lines "
          "follow them there")


def take_bucket_log(log, gs_out, start, otherwise):
    """The local train.log at `log` made the bucket's with the local one's part from byte `start` on after it
    (None: none), where the bucket's goes on from the local one's first `start` bytes (a new machine's log, or one
    another machine's process went on from since) and is not in the local one already. Under a study, which
    writes its header for a process (and the process's output) into the log itself, that part is the
    process's. A bucket that cannot be read is a warning saying what happens `otherwise`."""
    bucket = gcs.download_if_there(f"{gs_out.rstrip('/')}/train.log", log + '.bucket', otherwise)
    if not bucket:
        return
    try:
        ours = b''
        if os.path.exists(log):
            with open(log, 'rb') as f:
                ours = f.read()
        start = len(ours) if start is None else min(start, len(ours))
        with open(bucket, 'rb') as f:
            theirs = f.read()
        if len(theirs) > start and theirs.startswith(ours[:start]) and not ours.startswith(theirs):
            with open(bucket, 'ab') as f:
                f.write(ours[start:])
            os.replace(bucket, log)
    except OSError as e:  # a full disk: the log is never a reason to lose a run
        print(f"warning: cannot put {log} after the bucket's train.log ({e.strerror or e}); {otherwise}")
    with contextlib.suppress(OSError):
        os.remove(bucket)


def remove_unfinished(local):
    """Rank 0: temporary files of saves and downloads that never finished, tb/'s too (a resume's catch-up would
    send them to the bucket with the event files)."""
    for folder in (local, os.path.join(local, 'tb')):
        for name in os.listdir(folder) if os.path.isdir(folder) else []:
            if (name.endswith('.tmp') or name.startswith(('.rank',) + SNAPSHOTS)) and \
                    os.path.isfile(os.path.join(folder, name)):
                os.remove(os.path.join(folder, name))


def results_step(path):
    """The step a results.json belongs to, or None (no such file, or not readable as one)."""
    try:
        with open(path) as f:
            return json.load(f).get('step')
    except (OSError, ValueError, AttributeError):
        return None


def results_of_step(local, gs_out, step):
    """Whether the run's results.json is that of checkpoint `step`, here or (a new machine) in its bucket,
    whose copy is then fetched."""
    path = os.path.join(local, 'results.json')
    if results_step(path) == step:
        return True
    if not gs_out:
        return False
    bucket = gcs.download_if_there(f"{gs_out.rstrip('/')}/results.json", path + '.bucket', "evaluating again")
    if bucket and results_step(bucket) == step:
        os.replace(bucket, path)
        return True
    if bucket:
        os.remove(bucket)
    return False


def drop_results(local, gs_out, submission=False):
    """Rank 0, before a process's first checkpoint: results.json of an earlier finish (and with `submission`,
    an ARC run's, the submission.json and answers.npz beside it) removed, local and in the bucket, since they
    would sit beside a checkpoint of another step, or of the same step of another run (--overwrite, a roll-back)
    that keeps no answers; the end of the run writes its own. A bucket that cannot delete one is a
    warning: a resume compares results.json's step with the checkpoint's, and results.json names its
    submission's step. Returns True (done)."""
    for name in ('results.json',) + (('submission.json', 'answers.npz') if submission else ()):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(local, name))
        if gs_out:
            uri = f"{gs_out.rstrip('/')}/{name}"
            try:
                gcs.delete_object(uri)
            except gcs.GCSError as e:
                print(f"warning: cannot delete {uri} ({e}), an earlier finish's: it is not this run's result")
    return True


def drop_earlier_records(local, gs_out):
    """Rank 0, a new run over an earlier one (--overwrite=True): the earlier run's --eval_only records (evals/,
    ARC's submissions with them) removed, local and in the bucket, since a study would take one of the same step
    and name for this run's; its profiler traces (profile/), local and in the bucket, since they would pass for
    this run's; and its W&B folder (local only: it is never uploaded), since the `wandb sync` that this run's
    offline warning prints would upload the earlier run's offline runs beside this one. What cannot be deleted
    is a warning."""
    for name, why in (('evals', "a study would take its records for this run's"),
                      ('profile', "its traces would pass for this run's"),
                      ('wandb', "`wandb sync` of this run would upload the earlier run too")):
        path = os.path.join(local, name)
        try:
            shutil.rmtree(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            print(f"warning: could not delete the earlier run's {path} ({e.strerror or e}): {why}")
    if gs_out:
        for name, what in (('evals', "evaluations"), ('profile', "profiler traces")):
            drop_in_bucket(f"{gs_out.rstrip('/')}/{name}/", lambda _: True, what, "they are not this run's")


# -----------------------------------------------------------------------------
# one run's records, as Run (run.py) keeps them: rank 0 writes, every rank calls at the same points

class LogWindow:
    """The steps since the last training log line: when it began, the host's seconds in them (XLA: tracing and
    dispatch), the device's execution mark and XLA's counters at its start (an evaluation's or a save's
    time, device work and graphs are skipped: not the training's)."""

    def __init__(self):
        self.dev, self.start_step = None, 0

    def start(self, dev, step):
        self.dev, self.start_step = dev, step
        self.reset(step)

    def reset(self, step):
        self.t0, self.last_step, self.host_s = time.time(), step, 0.0
        self.mark, self.then = self.dev.execution_mark(), self.dev.xla_counters()

    def skip(self, seconds):
        """An evaluation's or a save's `seconds` taken out of the window, and its graphs and device work: each
        comes right after a log line, so the device's work since the window began is theirs alone."""
        if self.dev is not None:
            self.t0 += seconds
            self.mark, self.then = self.dev.execution_mark(), self.dev.xla_counters()


class RunRecords:
    """A run's records as one object: metrics.jsonl, W&B, TensorBoard and a gs:// run's uploads, open from
    open() on rank 0 (every rank calls; other ranks hold none), the training line's window, results.json and an
    --eval_only record."""

    def __init__(self, cfg, dev, local, gs_out):
        self.cfg, self.dev, self.master, self.local, self.gs_out = cfg, dev, dev.master, local, gs_out
        self.records = self.wandb = self.uploads = self.board = None
        self.window = LogWindow()

    def open(self, step, run_id, prune):
        """Rank 0: metrics.jsonl from `step` on, W&B, TensorBoard, and a gs:// run's uploads (after each upload
        of a checkpoint, prune() prunes the bucket like the local folder); [] or [the problem]."""
        if not self.master:
            return []
        try:
            self.records = Records(self.local, self.gs_out, step)
        except OSError as e:  # a full disk: its metrics.jsonl is kept as it was
            return [f"cannot write {e.filename or self.local} ({e.strerror or e}); free some space and rerun with "
                    "--init_from=resume"]
        if self.cfg['wandb_log']:
            self.wandb = start_wandb(self.cfg, self.local, run_id)
            # an offline run's file is written whole only by finish(): a hard exit (a hang, a stop that could not
            # be acted on) finishes it too, or the history since the last full block would be lost
            BEFORE_HARD_EXIT.append(lambda quick=False: self.finish_wandb(1 if quick else 4))
        if self.cfg['tensorboard']:
            self.board = TensorBoardWriter.open(self.local, step, self.cfg, self.gs_out)
        if self.gs_out:
            self.uploads = Uploads(self.local, self.gs_out, prune)
            # the bucket's train.log is the earlier process's until this one's first upload: a report made where
            # there is no local copy would read its last line (a study's word on how it ended) as this run's
            self.uploads.log()
        return []

    def log(self, kind, values, step, groups):
        """Rank 0: a line of metrics.jsonl, and the scalars of `groups` ({prefix: dict}) in W&B and
        TensorBoard."""
        if not self.master:
            return
        self.records.log(kind, values)
        if self.wandb and not wandb_log_safe(self.wandb, {f'{prefix}/{k}': v for prefix, vals in groups.items()
                                                          for k, v in flat_scalars(vals)}, step):
            self.wandb = None
        if self.board:
            self.board.log(groups, step)

    def log_watchdog(self, values):
        """The watchdog's firing, a line of metrics.jsonl where the records are open (not in --eval_only)."""
        if self.records:
            self.log('watchdog', values, values['step'] or 0, {})

    def train_line(self, sums, step, epoch, lr, flops_per_example):
        """A training line's values over the window's steps, from the metric sums of every rank."""
        w, cfg = self.window, self.cfg
        n, seconds = step - w.last_step, time.time() - w.t0
        line = log_line(sums, step, n, seconds, epoch, lr, cfg['global_batch_size'], not cfg['no_ACT_continue'])
        line.update(device_figures(self.dev, n, w.host_s, w.mark, seconds, flops_per_example * line['examples_per_s'],
                                   w.then))
        return line

    def log_train(self, line, step):
        """The line logged, XLA's compilations past the warm-up said, and the next window begun."""
        w = self.window
        if self.master and w.last_step >= w.start_step + 10:  # past the warm-up's graphs
            warn_recompiles(line, w.last_step + 1, step)
        self.log('train', line, step, groups(line))
        w.reset(step)

    def log_eval(self, step, res, raw, xla_before):
        values, scalars = eval_line(step, res, raw, xla_since(self.dev.xla_counters(), xla_before))
        self.log('eval', values, step, scalars)

    def uploaded(self, path):
        """Rank 0: a checkpoint written at path goes to the bucket, with the records so far (a run killed later
        leaves there the history up to its checkpoint)."""
        if self.uploads:
            self.uploads.submit(path)
            self.uploads.log()
            self.uploads.board(self.board)
            self.uploads.log('metrics.jsonl')

    def catch_up(self, checkpoint, done, prune):
        """Rank 0 of a gs:// run that resumed `checkpoint`: what its earlier processes left only in the local
        folder goes to the bucket (Uploads.catch_up), the uploads opened where open() did not (a run found
        done); the end waits for them as for its own."""
        if self.master and self.gs_out and checkpoint:
            self.uploads = self.uploads or Uploads(self.local, self.gs_out, prune)
            self.uploads.catch_up(checkpoint, done, [f'tb/{self.board.name}'] if self.board else [])

    def upload_folder(self, path):
        if self.master and self.uploads:
            self.uploads.folder(path)

    def finish(self, step, final_eval, best, run_id, checkpoint_id, wall, device_s, parameters, flops_per_example,
               arc=None):
        """Rank 0: results.json (wall: seconds by phase over every process of the run, device_s their
        device-seconds), and ARC's submission.json first, which results.json names with its step and vote (the
        file itself is the ARC Prize's format)."""
        if not self.master:
            return
        cfg, dev = self.cfg, self.dev
        sub = arc and save_submission(self.local, self.gs_out, 'submission.json', arc, step, cfg['gcs_retries'])
        if arc and arc.keep:
            save_answers(self.local, self.gs_out, 'answers.npz', arc, step,
                         cfg['eval_steps'] or cfg['halt_max_steps'], cfg['gcs_retries'])
        wall = dict(wall, total=sum(wall.values()))
        self.records.finish(dict(
            config=cfg, parameters=parameters, run_id=run_id, checkpoint_id=checkpoint_id,
            flops_per_example_step=flops_per_example,
            device=dev.name(), world_size=dev.world_size, final_eval=final_eval, best_eval=best,
            **(dict(arc_submission=sub) if sub else {}), step=step, examples_seen=step * cfg['global_batch_size'],
            train_flops=flops_per_example * step * cfg['global_batch_size'], wall_s=wall,
            device_hours=device_s / 3600))

    def write_evaluation(self, res, step, seconds, checkpoint, checkpoint_id, arc=None):
        """Rank 0, --eval_only: <out_dir>/evals/<name>.json, one re-evaluation of a checkpoint (what a study
        reads for its test-time views and steps), and with an ARC evaluation's votes its submission beside it
        (<name>.submission.json, which the record names with its step and vote); a failed write or upload is a
        warning."""
        cfg, dev = self.cfg, self.dev
        name = f"views{cfg['eval_views']}-steps{cfg['eval_steps'] or cfg['halt_max_steps']}"
        sub = arc and save_submission(self.local, self.gs_out, f'evals/{name}.submission.json', arc, step,
                                      cfg['gcs_retries'])
        record = dict(step=step, checkpoint=checkpoint, checkpoint_id=checkpoint_id, seconds=seconds,
                      device=dev.name(), world_size=dev.world_size, config=cfg, eval=res)
        record.update(dict(submission=sub) if sub else {})
        return save_evaluation(self.local, self.gs_out, f'evals/{name}.json', record, cfg['gcs_retries'])

    def results_missing(self, step):
        """Whether the run lacks a results.json of checkpoint `step` in its folder and its bucket (rank 0
        looks; every rank learns it): a run that reached its last step without it (a stop during the final
        evaluation, a failed write), or one whose results.json is an earlier finish's (trained on, then
        stopped)."""
        missing = self.master and not results_of_step(self.local, self.gs_out, step)
        return self.dev.agree([float(missing)], 'max')[0] > 0

    def logged(self, kind, step):
        """Rank 0: whether metrics.jsonl holds a `kind` line of this step."""
        return bool(self.records) and self.records.logged(kind, step)

    def close(self, interrupted):
        """Rank 0: bounded waits for the uploads and for W&B (what did not reach it stays for `wandb sync`)."""
        if self.board:
            self.board.close()
        if self.uploads:
            self.uploads.finish(interrupted, self.records, self.board)
        self.finish_wandb(4 if interrupted else 60)

    def finish_wandb(self, seconds):
        """Rank 0: W&B's run finished, waiting `seconds` at most (on a thread: a W&B that hangs never holds the
        exit; what did not reach it stays for `wandb sync`)."""
        run, self.wandb = self.wandb, None
        if run:
            finish = threading.Thread(target=run.finish, daemon=True)
            finish.start()
            finish.join(timeout=seconds)
