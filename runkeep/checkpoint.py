"""
The checkpoint files of a run, in a local folder or under a gs:// prefix (gcs.py is the storage client
underneath): their format and names, atomic saves, loading, listing and pruning; and what a run does with
them at start (which checkpoint to resume, whether it fits this run, its state loaded) and at a save (the
weights checked sane, the carry gathered). run.Run calls these; solve.py and bench.py read and write the
files: solve.py's checkpoint is read here (ours or a reference state dict), and weights that do not fit its model
are told in words (which keys to check).
A checkpoint (ckpt_<step>.pt) holds: model, ema, optimizer, step, loader, carry (the ACT carry of the global
batch), rng (rank 0's random streams), rng_ranks (every rank's, in rank order; None on XLA and TorchTPU pods),
config, best, run_id, timing, data (the shape it trained on), identifiers (whose puzzles the rows of its
puzzle-embedding table are: identifiers_of), data_digest (which examples it trained on: startup.sampled_rows),
eval_owed (a stop came before its step's evaluation was done: the resume evaluates it first; 'final': it was the
run's final one, the time budget's last step), checkpoint_id (this save's random id, which results.json and an
--eval_only record name), and with a pooled ARC vote arc_pool.
"""
import dataclasses
import hashlib
import json
import os
import glob
import pickle
import re
import time
import zipfile

import numpy as np
import torch

from configurator import fail
from data import steps_for
from model import TRMConfig, from_reference_state_dict, swiglu_inter
from puzzles import puzzle_for, seq_len_for_vocab
from step import lr_at

from . import gcs
from .records import CKPT_RE, checkpoint_name
from .startup import data_shape, describe_data, fail_if_ranks_differ, fail_together, newest_in

# a weight above this is divergence, not learning: trained TRM weights stay near their init scale (about 1 at
# most), and float32 activations overflow within a few blocks of weights this large
MAX_WEIGHT = 1e4


class CheckpointError(RuntimeError):
    errno = None  # a write's OS error: whether room would help


class UnreadableCheckpoint(CheckpointError):
    """The OS would not read the file (its mode, an I/O error): its bytes are not known to be corrupt."""


def save_atomic(obj, path):
    """torch.save to path.tmp, then rename: readers see the old file or the whole new one, never half. A
    failure (a full disk) removes the .tmp and raises CheckpointError naming the path and the OS error."""
    tmp = path + '.tmp'
    try:
        with open(tmp, 'wb') as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except Exception as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        cause = e if getattr(e, 'errno', None) else e.__cause__ or e.__context__ or e  # torch's own error is within
        why = os.strerror(cause.errno) if getattr(cause, 'errno', None) else str(e)
        error = CheckpointError(f"could not write {path}: {why}")
        error.errno = getattr(cause, 'errno', None)
        raise error from e


def torch_file_start(path):
    """Whether the file begins as torch.save begins one: a zip archive, or a pickle (its legacy format), so that a
    truncated or damaged checkpoint still reads as one."""
    with open(path, 'rb') as f:
        head = f.read(2)
    return head == b'PK' or head[:1] == b'\x80'


def load_checkpoint(path, name=None, mmap=False):
    """A checkpoint as a dict of CPU tensors; weights_only refuses pickles that would run code. name: what
    errors call the file (the bucket URI of a downloaded copy); mmap: the tensors mapped, not read. A file that
    does not load is one line naming it (torch's own text advises weights_only=False, which would run whatever
    an unknown file holds)."""
    try:  # mmap needs torch's zip format: a file of the legacy format is read, a truncated one says what it is
        return torch.load(path, map_location='cpu', weights_only=True, mmap=mmap and zipfile.is_zipfile(path))
    except Exception as e:
        if isinstance(e, OSError) and e.errno is not None:
            raise UnreadableCheckpoint(f"cannot read {name or path} ({e.strerror})") from e
        m = re.search(r'WeightsUnpickler error:\s*(.*?)\s*(?:Check the documentation|$)', str(e), re.S)
        why = ' '.join((m[1] if m and m[1] else str(e)).split())[:200]
        if not why or isinstance(e, KeyError):  # a KeyError's text: a bare byte that the unpickler looked up
            why = 'the file is empty' if os.path.isfile(path) and os.path.getsize(path) == 0 else \
                'not a PyTorch file' if isinstance(e, KeyError) else type(e).__name__
        if os.path.isfile(path) and os.path.getsize(path) and not torch_file_start(path):
            why = 'not a PyTorch file'  # a config, a JSON, an array: what the unpickler tripped on says nothing
        if isinstance(e, pickle.UnpicklingError) and why.startswith('Unsupported global'):
            what = why.split(' was not an allowed global')[0].removeprefix('Unsupported global: ')
            raise CheckpointError(f"{name or path} holds objects other than tensors and plain values ({what}); "
                                  "not loaded") from e
        raise CheckpointError(f"checkpoint {name or path} is corrupt or truncated and was not loaded: "
                              f"{why}") from e


def weights_in(ckpt):
    """What a loaded checkpoint file holds: dict(weights in this model's names (the EMA's when there are),
    config: the training run's or None, step, data: the shape it trained on, ema: whether they are the
    EMA's, identifiers: identifiers_of its dataset or None), or None when it is neither a checkpoint of
    train.py nor a state dict (the reference's keys or ours)."""
    if isinstance(ckpt, dict) and isinstance(ckpt.get('model'), dict):
        saved = ckpt.get('config') if isinstance(ckpt.get('config'), dict) else {}
        return dict(weights=dict(ckpt.get('ema') or ckpt['model']), config=saved, step=ckpt.get('step'),
                    data=ckpt.get('data'), ema=bool(ckpt.get('ema')), identifiers=ckpt.get('identifiers'))
    if isinstance(ckpt, dict) and ckpt and all(torch.is_tensor(v) for v in ckpt.values()):
        return dict(weights=from_reference_state_dict(ckpt), config=None, step=None, data=None, ema=False,
                    identifiers=None)
    return None


# -----------------------------------------------------------------------------
# the puzzle-embedding table: one row per identifier of the dataset it trained on

def identifiers_digest(data_path):
    """(a digest of the names in the dataset's identifiers.json, ''), or (None, why there is none: the file
    missing, or unreadable and why)."""
    path = os.path.join(data_path, 'identifiers.json')
    try:
        with open(path) as f:
            names = json.load(f)
    except FileNotFoundError:
        return None, f"{path} is missing"
    except (OSError, ValueError) as e:
        return None, f"{path} cannot be read ({' '.join((getattr(e, 'strerror', None) or str(e)).split())})"
    if not isinstance(names, list):  # valid JSON of another shape (a hand edit): no names to digest
        return None, f"{path} cannot be read (it holds no list of names)"
    return hashlib.sha256(json.dumps(names, separators=(',', ':')).encode()).hexdigest(), ''


def identifiers_of(data_path, meta):
    """What a puzzle-embedding table is bound to: dict(count: the dataset's num_puzzle_identifiers, sha256: a
    digest of the names in identifiers.json, or None where the dataset has no readable such file). A dataset
    rebuilt with another seed keeps its count while its names (which augmentation each row stands for)
    change."""
    return dict(count=int(meta['num_puzzle_identifiers']), sha256=identifiers_digest(data_path)[0])


def table_rows(weights):
    """The rows of a state dict's puzzle-embedding table (our names), or None without one."""
    t = weights.get('puzzle_emb')
    return int(t.shape[0]) if torch.is_tensor(t) and t.dim() == 2 else None


_NOTED = set()  # checkpoints said to carry no identifiers digest (once per process)


def given_data(typed, data_path):
    """The words for the dataset a run reads: the data_path typed, and for a gs:// one the copy read here (a
    folder the user never typed)."""
    return data_path if typed == data_path else f"{typed} (its copy in {data_path})"


def identifier_mismatch(found, path, data_path, meta, say=True, given=None):
    """'' when the puzzle-embedding table of a checkpoint (found: weights_in's dict) belongs to the dataset in
    data_path (meta: its train split's dataset.json), else one sentence naming the checkpoint, the dataset and
    both identifier counts. A checkpoint of train.py records its dataset's identifiers (identifiers_of); one
    saved before that, one trained on a dataset without a readable identifiers.json, and a reference state
    dict can only be checked by their table's row count, which is said once (say=True). A checkpoint that
    records the names, against a dataset whose identifiers.json is missing or unreadable, is refused (SystemExit):
    the count alone cannot tell a dataset rebuilt with another seed. A model without a puzzle embedding
    (puzzle_emb_ndim 0) is checked by the count alone: its table's rows stand for nothing. given: the words for
    the dataset (given_data), where they are not data_path."""
    ours, now, given = found.get('identifiers'), identifiers_of(data_path, meta), given or data_path
    rows = table_rows(found['weights'])
    saved = ours['count'] if isinstance(ours, dict) else rows
    if saved is None:
        return ''
    if saved != now['count']:
        return (f"{path} holds a puzzle-embedding table of {saved} identifiers; the dataset {given} has "
                f"{now['count']}")
    if (found.get('config') or {}).get('puzzle_emb_ndim', 1) == 0:
        return ''  # no puzzle embedding: its table's rows stand for nothing, whatever the names
    recorded = isinstance(ours, dict) and ours.get('sha256')
    if recorded and not now['sha256']:
        raise SystemExit(f"{path} records which puzzles its puzzle-embedding rows stand for, but "
                         f"{identifiers_digest(data_path)[1]}: the dataset {given} cannot be checked to hold "
                         f"the same ones (a rebuild with another --seed keeps their count, {saved}). Restore "
                         "identifiers.json, or rebuild the dataset with the command that built it")
    if recorded and ours['sha256'] != now['sha256']:
        return (f"{path} was trained on other puzzle identifiers than the dataset {given} holds ({saved} "
                f"each, but identifiers.json names other puzzles: a rebuild with another --seed?), so its "
                f"puzzle-embedding rows would each serve another puzzle")
    if not recorded and say and path not in _NOTED:
        _NOTED.add(path)
        what = 'is a state dict, which records' if found.get('config') is None else \
            'was saved before checkpoints recorded' if not isinstance(ours, dict) else \
            'was trained on a dataset without a readable identifiers.json: it records'
        print(f"note: {path} {what} no dataset identifiers: only their count is checked ({saved}, as the "
              f"dataset {given} has)")
    return ''


def list_checkpoints(folder):
    """{step: path} of the complete checkpoints in a local folder or gs:// prefix (temporary files and
    half-done uploads never match: local writes are renamed when whole, GCS objects appear when whole)."""
    if gcs.is_gcs(folder):
        names = [uri for uri, _ in gcs.list_objects(folder.rstrip('/') + '/ckpt_')]
    else:
        names = glob.glob(os.path.join(folder, 'ckpt_*.pt'))
    return {int(m.group(1)): n for n in names if (m := CKPT_RE.search(n))}


def prune_checkpoints(folder, keep_last_n, best_step, corrupt=(), protect=-1, delete_all=False):
    """Keep the newest keep_last_n checkpoints that are not known to be corrupt (0: keep all), the best, and
    the newest one at or below step `protect` (the newest known to train on: a divergence sets aside every one
    after it, so it must outlive the newer ones); a known-corrupt file holds no slot. delete_all: remove every
    checkpoint (a run started over)."""
    found = list_checkpoints(folder)
    good = sorted(s for s, p in found.items() if p not in corrupt)
    trusted = max((s for s in good if s <= protect), default=None)  # `protect` is a step, seldom a saved one
    keep = set() if delete_all else \
        set(good if keep_last_n == 0 else good[-keep_last_n:]) | {best_step, trusted}
    for step, path in found.items():
        if step not in keep:
            try:
                gcs.delete_object(path) if gcs.is_gcs(path) else os.remove(path)
            except Exception as e:
                print(f"warning: could not delete old checkpoint {path}: {e}")


def bucket_checkpoints(out_dir, resume):
    """Rank 0 at start: ({step: uri} of out_dir's checkpoints or None, [problem]). The listing is also the
    check that the bucket lets this run in: a bucket that answers no (it does not exist, no permission: HTTP
    4xx) or credentials that cannot be used (a broken key file) stop the run at start, as does a bucket that
    cannot be reached when resuming (no checkpoint could be picked); a new run goes on without it (its uploads
    are retried)."""
    bucket = gcs.split_gcs(out_dir)[0]
    try:
        return list_checkpoints(out_dir), []
    except gcs.Stopped as e:
        return None, [f"{e}; nothing was started"]
    except gcs.GCSError as e:
        if isinstance(e, gcs.CredentialsFailed):  # no request was sent: the key file or the token endpoint said no
            return None, [f"out_dir={out_dir}: {e}"]
        if e.refused:
            return None, [f"out_dir={out_dir}: the bucket {bucket} answered HTTP {e.status} ({e}): check "
                          "that the bucket exists and that this identity may read and write it"]
        if resume:
            return None, [f"cannot list the checkpoints in {out_dir} ({e}); retry when the bucket is "
                          "reachable"]
        print(f"warning: cannot list {out_dir} ({e}); not checked for an earlier run's checkpoints; training "
              "goes on, its uploads are retried")
        return None, []


def resume_parts(init_from):
    """(whether the run resumes out_dir's newest checkpoint, the file whose weights it starts from otherwise:
    '' for scratch). 'resume:FILE' resumes, and with no checkpoint yet starts from FILE (an adaptation that a
    preempted job or a study reruns with the same command)."""
    if init_from == 'resume' or init_from.startswith('resume:'):
        return True, init_from[len('resume:'):]
    return False, '' if init_from == 'scratch' else init_from


def start_file_missing(cfg, nothing_to_resume):
    """[message] when init_from=resume:FILE finds no checkpoint of the run to resume and FILE is missing on this
    host (with a checkpoint to resume, FILE is not needed: it may be gone)."""
    resume, init_file = resume_parts(cfg['init_from'])
    if not (resume and init_file and nothing_to_resume) or os.path.isfile(init_file):
        return []
    return [f"init_from={cfg['init_from']}: {init_file} is missing (no such file on this host), and "
            f"{cfg['out_dir']} holds no checkpoint of the run to resume instead"]


def checkpoint_problems(cfg, dev, local):
    """Rank 0 at start: the checkpoints already in out_dir that this run would mix with or delete: [message].
    A new run (scratch, or a file's weights) stops at an earlier run's checkpoints unless --overwrite=True;
    a gs:// out_dir's listing is also the check that the bucket lets this run in."""
    (resume, init_from), out_dir, problems = resume_parts(cfg['init_from']), cfg['out_dir'], []
    fresh = not resume and not cfg['eval_only']  # a new run's files: scratch, or a file's weights
    if fresh and cfg['overwrite'] and dev.master and os.path.isfile(init_from) and CKPT_RE.search(init_from) \
            and os.path.isdir(local) and os.path.samefile(os.path.dirname(os.path.abspath(init_from)), local):
        problems.append(f"init_from={init_from} lies in {local}, whose checkpoints --overwrite=True deletes: "
                        "copy it elsewhere first and start from the copy")
    new_run = fresh and not cfg['overwrite'] and dev.master
    held = {local: list_checkpoints(local)} if new_run else {}
    if gcs.is_gcs(out_dir) and dev.master:
        found, why = bucket_checkpoints(out_dir, resume)
        problems += why
        if new_run and found:
            held[out_dir] = found
    for folder, steps in held.items():
        if steps:
            problems.append(f"{folder} already holds checkpoints {sorted(steps)}: continue them with "
                            "--init_from=resume, pick another --out_dir, or replace them with "
                            "--overwrite=True")
    return problems


def delete_all_checkpoints(folders):
    """Rank 0, a new run with --overwrite=True: the old run's checkpoints deleted, those a divergence set aside
    too (*.diverged, local only: the bucket's copies went at the divergence); [problem] where a bucket cannot be
    reached (nothing trained yet: better to stop than to mix two runs' files)."""
    problems = []
    for folder in folders:
        try:
            prune_checkpoints(folder, 0, -1, delete_all=True)
            if not gcs.is_gcs(folder):
                for path in glob.glob(os.path.join(folder, 'ckpt_*.pt.diverged')):
                    try:
                        os.remove(path)
                    except OSError as e:
                        print(f"warning: could not delete the earlier run's {path}: {e.strerror or e}")
        except gcs.GCSError as e:
            problems.append(f"--overwrite=True cannot delete the checkpoints in {folder} ({e}); retry when "
                            "the bucket is reachable")
    return problems


def load_weights(path, model, ema_model, meta, data_path, adapt, published=False, given=None):
    """init_from=FILE: the weights of a checkpoint of ours (its EMA when there is one, for the raw weights and
    the EMA alike) or a reference state dict; ours only on data of the shape and kind it trained on (a 4x4
    Sudoku's weights fit a 4x4 maze's tensors, not its puzzles). A table of another dataset's puzzle
    identifiers (identifier_mismatch) is refused, or with `adapt` (a training run) replaced: the dataset's
    size, every row the checkpoint's mean row (the reference's load_checkpoint does the same), so that new
    puzzles start from what the trained ones share. published: the model keys came from an all_config.yaml
    beside it (hub.resolve_init_from), which names them in a refusal. given: the words for the dataset
    (given_data), where they are not data_path. Returns the line that says what was loaded, and (the
    checkpoint's step, its checkpoint_id), both None for a reference state dict."""
    given = given or data_path
    try:  # mapped: of a checkpoint of ours, only the weights taken are read, not the optimizer's moments or carry
        ckpt = load_checkpoint(path, mmap=True)
    except CheckpointError as e:
        raise SystemExit(f"init_from: {e}")
    found = weights_in(ckpt)
    if found is None:
        raise SystemExit(f"init_from={path} is neither a checkpoint of this trainer nor a state dict of the "
                         f"reference implementation: it holds {what_it_holds(ckpt)}")
    length_note = ''
    if found['config'] is not None:
        (was, their_path), now = trained_on(ckpt), data_shape(meta)
        if was and was['seq_len'] != now['seq_len'] and all(now.get(k) == v for k, v in was.items()
                                                             if k != 'seq_len'):
            # the same kind and vocabulary, another length: a fine-tune, not a mistake; attention with RoPE or
            # no positions runs on any length (MLP-t's and learned positions' weights are refused below)
            length_note = (f"; note: it trained on seq_len {was['seq_len']} ({their_path}), {given} holds "
                           f"seq_len {now['seq_len']}: its weights meet a length they never learned")
        else:
            for problem in data_problems(ckpt, path, meta, given, "Its weights learned that data: point "
                                         "--data_path at a dataset of that kind, or train from scratch"):
                raise SystemExit(f"init_from={problem}")
    sd = fill_absent_table(found['weights'], model)  # a reference state dict of a model without puzzle table
    why = identifier_mismatch(found, path, data_path, meta, given=given)
    if why and not adapt:
        raise SystemExit(f"init_from={why}. Its puzzle embedding answers for that dataset's puzzles: "
                         f"evaluate it on the dataset it trained on, or adapt it to this one first "
                         f"(train.py --init_from={path} without --eval_only: a new table, trained)")
    old, want = sd.get('puzzle_emb'), model.puzzle_emb.shape
    if why and old is not None and old.shape[1:] == want[1:]:  # (another width: another model, refused below)
        sd = dict(sd, puzzle_emb=old.mean(0, dtype=torch.float64).to(old.dtype).expand(want).contiguous())
    try:
        load_into(model, sd)
    except RuntimeError:  # which keys to check: the weights' shapes against the model's (the dataset's too)
        published = published and found['config'] is None
        where = "all_config.yaml's model keys" if published else "this run's model keys"
        # the data's length, where it is the only difference: the weights hold it (MLP-t's, learned positions')
        raise SystemExit(mismatch_message(sd, model, model.config, path, f"{where} and the dataset at {given}",
                                          published or bool(length_note), typed=not published))
    load_into(ema_model, sd)
    saved = (found['step'], ckpt.get('checkpoint_id') if found['config'] is not None else None)
    if not why:
        return f"loaded weights from {path}{length_note}", saved
    origin = f"step {found['step']}" if found['step'] is not None else 'the reference state dict'
    other = ' (of other puzzles)' if old.shape[0] == want[0] else ''
    return (f"init_from={path}: network from {origin}{' (its EMA weights)' if found['ema'] else ''}; "
            f"puzzle-embedding table replaced: {old.shape[0]} -> {want[0]} identifiers{other}, every row the "
            f"checkpoint's mean row{length_note}"), saved


def load_into(module, sd):
    """module.load_state_dict(sd), its checks and errors; on an XLA device every tensor then also gets fresh
    device data from sd: torch_xla's dynamo bridge keeps a tensor that the compiled step only reads (H_init,
    L_init) as a constant of its graph, and the output of the copy that load_state_dict ran is a placeholder
    there, which crashed the first step ('an async operation is in flight')."""
    module.load_state_dict(sd)
    with torch.no_grad():
        for name, t in module.state_dict(keep_vars=True).items():
            if t.device.type == 'xla':
                t.data = sd[name].to(t.device, t.dtype)


def data_problems(ckpt, path, meta, data_path, advice):
    """[message] when a checkpoint of train.py was trained on data of another kind or shape than meta's (its
    model, and a resume's carry, are bound to it)."""
    was, their_path = trained_on(ckpt)
    now = {k: v for k, v in data_shape(meta).items() if k in (was or {})}
    if not was or was == now:
        return []
    return [f"{path} was trained on {describe_data(was)} (data_path={their_path!r}); "
            f"{data_path} holds {describe_data(now)}. {advice}"]


def trained_on(ckpt):
    """(data_shape's dict of the data a checkpoint of train.py trained on, or the part of it saved; its
    data_path). Checkpoints from before `data` was saved: the carry's width is the sequence length."""
    carry, saved = ckpt.get('carry'), ckpt.get('config') if isinstance(ckpt.get('config'), dict) else {}
    was = ckpt.get('data')
    if not was and isinstance(carry, dict) and 'inputs' in carry:
        was = dict(seq_len=int(carry['inputs'].shape[-1]))
    return was, saved.get('data_path')


def set_aside_diverged(local, remote, uploads, first_bad):
    """Rename local checkpoints of step >= first_bad to *.diverged (an upload of one not yet begun then skips
    it), and drop their bucket copies once the uploads under way are done (uploads: records.Uploads, whose wait is
    bounded), so a resume never picks weights that diverge. A bucket that cannot be reached, or uploads that
    outlast the wait, are one warning: the divergence's own message follows. Returns the newest checkpoint
    left."""
    for step, path in list_checkpoints(local).items():
        if step >= first_bad:
            os.replace(path, path + '.diverged')
    if remote:
        try:
            why = '' if not uploads or uploads.settle(interrupted=False) else 'uploads still under way may add one'
            for step, uri in list_checkpoints(remote).items():
                if step >= first_bad:
                    gcs.delete_object(uri)
        except gcs.GCSError as e:
            why = str(e)
        if why:
            print(f"warning: the checkpoints from step {first_bad} on in {remote} could not all be set aside "
                  f"({why}): delete them there before a resume, which could pick them")
    left = list_checkpoints(local)
    return left[max(left)] if left else None


# -----------------------------------------------------------------------------
# resuming: the newest checkpoint every rank can load, checked against this run, its state loaded

def find_resume_checkpoint(dev, local, remote, corrupt, last_step, eval_only):
    """(the newest checkpoint that every rank can load, its path), or (None, None); rank 0 picks the step.
    Non-zero ranks read the bucket copy (the same bytes as rank 0's); paths found corrupt are added to
    `corrupt`, and a file the OS will not read (its mode, an I/O error) or the bucket does not send stops every
    rank, naming it. A corrupt newest checkpoint gives way to an older one only for training on: one at
    `last_step` (the run's final weights) or one to be evaluated (eval_only) is refused, never replaced by
    an earlier one. Checkpoints found but none loadable, or a bucket that cannot be listed, is an error:
    never a fresh start that would overwrite them."""
    found, problems = {}, []
    if os.path.isdir(local):
        found.update(list_checkpoints(local))
    if remote:
        try:
            for step, uri in list_checkpoints(remote).items():
                if not dev.master or step not in found:
                    found[step] = uri
        except Exception as e:
            problems.append(f"cannot list the checkpoints in {remote} ({e}); retry when the bucket is "
                            "reachable")
    fail_together(dev, problems, 'init_from=resume')
    candidates, newest = sorted(found, reverse=True) if dev.master else [], None
    for i in range(len(candidates) + 1 if dev.master else 10 ** 9):
        step = int(dev.agree([candidates[i] if i < len(candidates) else -1.0 if dev.master else 0.0])[0])
        if step < 0:
            break
        if newest and (eval_only or newest[0] == last_step):  # an older one would be used in its place
            what = 'the one to evaluate' if eval_only else f"this run's last (step {last_step})"
            fail_together(dev, [f"{newest[1]}. It is the newest checkpoint, {what}: an older one is not used "
                                "in its place; move it aside to use the one before"] if newest[1] else [],
                          'init_from=resume')
        path = found.get(step) or f"{remote.rstrip('/')}/{checkpoint_name(step)}"
        ckpt, why = load_training_checkpoint(path, step, local, dev.rank)
        # a file that may be whole is never passed over: the resume would train its steps again, and its first save
        # would delete it
        fail_together(dev, [f"{why}: it may be whole, so no older checkpoint is used in its place; rerun once it "
                            "can be read, or move it aside to resume from the one before"]
                      if isinstance(why, UnreadableCheckpoint) else [], 'init_from=resume')
        if dev.agree([float(ckpt is None)], 'max')[0] == 0:
            return ckpt, path
        newest = newest or (step, why and str(why))
        if why:  # the newest at the run's last step, or the one to evaluate, is not passed over: the next turn refuses
            then = '' if i == 0 and (eval_only or step == last_step) else '; trying an older checkpoint'
            print(f"warning: rank {dev.rank}: {why}{then}")
            corrupt.append(path)
    if found:
        fail_together(dev, [f"checkpoints found ({', '.join(found[s] for s in sorted(found))}) but none "
                            "could be loaded; nothing was overwritten"] if dev.master else [],
                      'init_from=resume')
    return None, None


def load_training_checkpoint(path, step, local, rank):
    """(the checkpoint at path, None) (downloaded first from a bucket, to a temporary file in `local` removed
    on every path), or (None, the error that says why it cannot be used)."""
    dest = os.path.join(local, f'.rank{rank}_{checkpoint_name(step)}')
    try:
        if gcs.is_gcs(path):
            os.makedirs(local, exist_ok=True)
            gcs.download_file(path, dest)
            ckpt = load_checkpoint(dest, name=path)
        else:
            ckpt = load_checkpoint(path)
        if not isinstance(ckpt, dict):
            raise CheckpointError(f"{path} is not a training checkpoint of this trainer (it holds a "
                                  f"{type(ckpt).__name__})")
        for k in ('model', 'step', 'carry', 'config', 'optimizer'):
            if k not in ckpt:
                raise CheckpointError(f"{path} is not a training checkpoint of this trainer (no '{k}')")
        return ckpt, None
    except gcs.Stopped as e:
        raise SystemExit(f"{e}; nothing was changed")
    except gcs.GCSError as e:  # an object listed a moment ago: one gone since is passed over, one not sent may be whole
        return None, e if isinstance(e, gcs.NotFoundError) else UnreadableCheckpoint(str(e))
    except Exception as e:
        return None, e
    finally:
        if os.path.exists(dest):
            os.remove(dest)


def parts_problem(ckpt, path):
    """'' when the parts of a training checkpoint that a resume reads are there and of the types train.py saves
    them in, else why not (another trainer's or version's file, or an edited one: it may be whole, so it is kept)."""
    for k, kind in dict(model=dict, optimizer=dict, loader=dict, carry=dict, config=dict, rng=dict, best=dict,
                        step=int).items():
        if not isinstance(ckpt.get(k), kind) or isinstance(ckpt.get(k), bool):
            what = 'missing' if k not in ckpt else f"{type(ckpt[k]).__name__!r}, not {kind.__name__!r}"
            return (f"{path} does not hold what this trainer resumes from (its {k!r} is {what}); the file is "
                    "kept. Move it aside to resume from the one before, or resume with the trainer that saved it")
    return ''


def check_resume(dev, ckpt, path, cfg, resume_fixed, meta, data_path, digest):
    """The checkpoint at path against this run: it must have been saved with this run's `resume_fixed` keys
    and trained on data of this shape (its model and carry are bound to it), and a training run on its examples
    (digest: startup.sampled_rows of data_path; a checkpoint records its own), or every rank stops naming the
    difference. Rank 0 says the keys that did change."""
    fail_together(dev, [why] if (why := parts_problem(ckpt, path)) else [], 'resume')
    # a model key the saving trainer did not have yet (a fork's new key) ran as its default: a new key keeps the old
    # model by default (docs/forking.md), so another value is another model on the same weights
    was = {f.name: f.default for f in dataclasses.fields(TRMConfig) if f.default is not dataclasses.MISSING}
    saved = {**{k: was[k] for k in resume_fixed if k in was}, **ckpt['config']}
    changed = [k for k in resume_fixed if k in saved and saved[k] != cfg[k]]
    fail_together(dev, [f"{path} was saved with {', '.join(f'{k}={saved[k]!r}' for k in changed)}; this "
                        f"run has {', '.join(f'{k}={cfg[k]!r}' for k in changed)}. A resume must keep them: "
                        "start a new run (another out_dir) to change them"] if changed else [], 'resume')
    # a trainer that saved 'wandb_run_id' (not 'run_id') averaged at ema_rate from step 0; this one's EMA warms up
    # (step.ema_update_), so below the warm-up's end the resumed run would average otherwise
    step, rate = ckpt['step'], cfg['ema_rate']
    old_ema = 'run_id' not in ckpt and 'wandb_run_id' in ckpt and cfg['ema'] and not cfg['eval_only'] and \
        not cfg['freeze_weights'] and (1 + step) / (10 + step) < rate
    fail_together(dev, [f"{path} was saved by an older trainer whose EMA averaged at ema_rate={rate} from step 0; "
                        f"this one's decay is min(ema_rate, (1 + step) / (10 + step)), {(1 + step) / (10 + step):.4g} "
                        f"at step {step}, so the resumed run would average otherwise: finish it with the trainer "
                        "that saved it, or start a new run (another out_dir)"] if old_ema else [], 'resume')
    if dev.master:
        other = {k: (saved[k], cfg[k]) for k in cfg if k in saved and saved[k] != cfg[k]}
        print(f"resuming from {path} (step {ckpt['step']})"
              + ''.join(f"\n  {k}: {a!r} -> {b!r}" for k, (a, b) in other.items()))
    given = given_data(cfg['data_path'], data_path)
    fail_together(dev, data_problems(ckpt, path, meta, given, "A resume keeps the data's shape: point "
                                     "--data_path at that dataset, or start a new run (another out_dir)"),
                  'resume')
    why = identifier_mismatch(weights_in(ckpt), path, data_path, meta, say=dev.master, given=given)
    advice = ("Evaluate it on the dataset it trained on, or adapt it to this one first (train.py "
              f"--init_from={path} in another out_dir: a new table, trained)") if cfg['eval_only'] else \
        ("A resume keeps its table: point --data_path at the dataset it trained on, or adapt its network to "
         f"this one in a new run (--init_from={path}, another out_dir)")
    fail_together(dev, [f"{why}. {advice}"] if why else [], 'resume')
    # other examples of the same shape (a rebuild with another seed, another dataset): the run would train and
    # evaluate on two datasets, its best checkpoint chosen across them. An evaluation may take any test split.
    other = ckpt.get('data_digest') not in (None, digest) and not cfg['eval_only']
    fail_together(dev, [f"{path} trained on other examples than the dataset at {given} holds (data_path was "
                        f"{ckpt['config'].get('data_path')!r}; a digest of 64 rows of every array differs): a resume "
                        "keeps its data: point --data_path at the dataset it trained on (a copy elsewhere is fine), "
                        f"or train on from its weights in a new run (--init_from={path}, another out_dir)"]
                  if other else [], 'resume')


def load_state(dev, ckpt, path, cfg, model, ema_model, opt, loader):
    """The checkpoint's weights, optimizer, data order and random state loaded; returns this rank's rows of
    the ACT carry. A file that loads but whose parts do not fit this model (edited, or another trainer's):
    named, and every rank stops."""
    want, have = model.state_dict(), ckpt['model'] if isinstance(ckpt['model'], dict) else {}
    other = [f"{k} {list(have[k].shape)} in the file, {list(want[k].shape)} here" for k in want
             if torch.is_tensor(have.get(k)) and have[k].shape != want[k].shape][:3]
    for what, keys in (('missing', [k for k in want if k not in have]),
                       ('unexpected', [k for k in have if k not in want])):
        if have and keys:
            other.append(f"{len(keys)} {what} ({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})")
    # the same keys and data (check_resume), yet another model: the code that builds it changed since the save
    fail_together(dev, [f"{path} holds the weights of another model than this code builds: {'; '.join(other)}. "
                        "model.py changed since it was saved; the file is kept: resume with the code that saved "
                        "it, or start a new run (another out_dir)"] if other else [], 'resume')
    try:
        if ema_model is not model:  # first: the puzzle embedding they share is the raw model's
            ema_model.load_state_dict(ckpt['ema'] or ckpt['model'])
        model.load_state_dict(ckpt['model'])
        opt.load_state_dict(ckpt['optimizer'])
        loader.load_state_dict(ckpt['loader'])
        problems = []
    except (RuntimeError, ValueError, KeyError) as e:
        problems = [f"{path} does not fit this run ({' '.join(str(e).split())[:300]}); the file is kept. "
                    "Move it aside to resume from the one before"]
    fail_together(dev, problems, 'resume')
    was = ckpt['loader'].get('groups')  # the same kind and shape (check_resume), but a rebuild can change the count
    if dev.master and was is not None and was != loader.n_groups:
        print(f"  groups: {was} -> {loader.n_groups} (the dataset at {cfg['data_path']} was rebuilt since this "
              "checkpoint: the epochs, the LR schedule and the rest of this epoch's order follow the new count)")
    if dev.master and not cfg['eval_only'] and (said := schedule_change(ckpt, cfg, loader)):
        print(said)
    if dev.master and bool(ckpt.get('ema')) != (ema_model is not model):  # --ema turned off or on at this resume
        if cfg['eval_only']:  # an evaluation trains and saves nothing: it takes the raw weights either way
            print("  the checkpoint's EMA weights are not evaluated (--ema=False): its raw weights are"
                  if ckpt.get('ema') else "  the checkpoint holds no EMA weights: its raw weights are evaluated")
        else:
            print("  the checkpoint's EMA weights are dropped: evaluations and checkpoints hold the raw weights from "
                  "here" if ckpt.get('ema') else f"  the EMA starts from the raw weights of step {ckpt['step']} and "
                  f"averages on at ema_rate={cfg['ema_rate']}")
    step, lb = ckpt['step'], cfg['global_batch_size'] // dev.world_size  # (the carry of the global batch)
    # the latents in this run's forward dtype: the network computes in theirs, and a refill's mix of fresh rows
    # and another dtype's is the wider one, so a float32 carry would keep a bfloat16 run in float32 to its end
    carry = {k: v[dev.rank * lb:(dev.rank + 1) * lb].to(model.forward_dtype if v.is_floating_point() else v.dtype)
             for k, v in ckpt['carry'].items()}
    streams = ckpt.get('rng_ranks')
    if streams and len(streams) == dev.world_size:  # each rank's own: bit for bit, exploration included
        dev.set_rng_state(streams[dev.rank])
    elif dev.rank == 0:
        dev.set_rng_state(ckpt['rng'])
    else:  # another world size, a pod, an older checkpoint: the other ranks' exploration streams reseeded
        dev.manual_seed(cfg['seed'] + dev.rank + 1000003 * step)
    weights = float(sum(p.double().nan_to_num().sum() for p in ckpt['model'].values()
                        if p.is_floating_point()))  # a fingerprint of the loaded bytes, on the host
    fail_if_ranks_differ(dev, [weights], lambda _: "the ranks loaded different weights")
    return carry


def schedule_change(ckpt, cfg, loader):
    """A line on the LR schedule from the checkpoint's step on where this run's differs from the one it trained
    under (another lr, warmup or floor; a cosine's total stretched by other epochs, or by a dataset rebuilt with
    another group count), or ''. A checkpoint whose config lacks a key of it (an older trainer's): ''."""
    saved, step, keys = ckpt['config'], ckpt['step'], ('lr', 'lr_warmup_steps', 'lr_min_ratio', 'epochs')
    if any(k not in saved for k in keys):
        return ''
    was_total = steps_for(saved['epochs'], ckpt['loader'].get('groups', loader.n_groups),
                          loader.meta['mean_puzzle_examples'], saved['global_batch_size'])
    total = loader.steps_for(cfg['epochs'])
    if [saved[k] for k in keys[:3]] == [cfg[k] for k in keys[:3]] and (was_total == total or cfg['lr_min_ratio'] == 1):
        return ''
    was, now = (float(lr_at(torch.tensor(float(step)), c['lr'], c['lr_warmup_steps'], t, c['lr_min_ratio']))
                for c, t in ((saved, was_total), (cfg, total)))
    then = 'constant' if cfg['lr_min_ratio'] == 1 else \
        f"a cosine to {cfg['lr'] * cfg['lr_min_ratio']:.3g} at step {total} (it ended at step {was_total})"
    return f"  the LR schedule: {now:.3g} at step {step + 1} (the checkpoint's schedule: {was:.3g}), then {then}"


# -----------------------------------------------------------------------------
# saving: only sane weights, written atomically, the older ones pruned

def checkpoint_tensors(dev, model, ema_model, carry):
    """[are the weights sane, the carry of the global batch...]: one reduction, collectives on every rank.
    Sane: finite and below MAX_WEIGHT (NaN fails the comparison too)."""
    params = list(model.parameters()) + (list(ema_model.parameters()) if ema_model is not model else [])
    largest = torch.stack([p.detach().abs().max().float() for p in params]).max()
    return [(largest <= MAX_WEIGHT).float().reshape(1)] + [dev.all_gather(carry[k]) for k in sorted(carry)]


def write_checkpoint(state, path, tag, keep_last_n, best_step, corrupt, protect):
    """Rank 0: the file (its time said), then the pruning of older ones in its folder; a whole new file under
    a corrupt one's name is no longer corrupt."""
    from device import to_cpu
    t_save = time.time()
    save_atomic(to_cpu(state), path)
    print(f"saved {path}{tag} ({os.path.getsize(path) / 1e6:.1f} MB in {time.time() - t_save:.1f} s)")
    if path in corrupt:
        corrupt.remove(path)
    prune_checkpoints(os.path.dirname(path), keep_last_n, best_step, corrupt, protect=protect)


def what_it_holds(obj):
    """A few words on a loaded file that is neither a checkpoint of train.py nor a reference state dict."""
    if isinstance(obj, dict) and {'weights', 'optimizers', 'step'} <= set(obj):
        return ("a train state (step_<N>_train_state.pt: optimizer moments and raw weights); the weights to "
                "start from are step_<N> beside it")
    if isinstance(obj, dict):
        names = ', '.join(repr(k) for k in list(obj)[:6]) + (', ...' if len(obj) > 6 else '')
        tensors = sum(type(v).__name__ in ('Tensor', 'Parameter') for v in obj.values())
        return f"a dict of {len(obj)} entries ({names}), {tensors} of them tensors"
    if hasattr(obj, 'shape'):
        return f"a single tensor of shape {list(obj.shape)}"
    return f"a {type(obj).__name__}"


def fill_absent_table(sd, model):
    """The reference has no puzzle table when puzzle_emb_ndim is 0; this model keeps a width-1 table of
    zeros there, which a state dict without one leaves as it is."""
    if 'puzzle_emb' not in sd and model.config.puzzle_emb_ndim == 0:
        sd['puzzle_emb'] = model.puzzle_emb
    return sd


# -----------------------------------------------------------------------------
# solve.py's checkpoint: ours ({'model', 'ema', 'config', ...}) or a reference state dict, and what its weights'
# shapes say where the model keys or the dataset do not fit them

def numpy_scalar_types():
    """The numpy types that checkpoints of earlier train.py versions hold in their results (numpy scalars)."""
    core = getattr(np, '_core', None) or np.core
    return [core.multiarray.scalar, np.dtype] + [
        type(np.dtype(t)) for t in ('float16', 'float32', 'float64', 'int32', 'int64', 'uint8', 'bool')]


def read_checkpoint(path):
    """solve.py's --init_from=path: (state dict in our names, the training config or None, a few words on where
    the weights came from, the shape of the data it was trained on or None, its dataset's identifiers or None);
    a file that is none of these is refused in one line. The tensors are mapped, not read: a caller that keeps
    only the config (--task=FILE.json before it adapts) reads none of the gigabytes of a checkpoint at ARC size."""
    if not path:
        fail("solve.py needs a checkpoint: --init_from=out/RUN/ckpt_XXXXXXXX.pt (or a reference state dict)")
    # a run's folder or a published one, or a file missing from one (the step a shorter run did not reach): the
    # newest checkpoint in that folder is the likely one
    newest = newest_in(path if os.path.isdir(path) else os.path.dirname(path))
    newest = f"--init_from={newest}" if newest else ''
    if os.path.isdir(path):
        fail(f"init_from={path} is a folder, not a checkpoint file" + (f": name one in it, such as {newest}"
                                                                          if newest else ''))
    if not os.path.isfile(path):
        fail(f"init_from={path}: no such file" + (f"; the newest in its folder: {newest}" if newest else ''))
    try:
        ckpt = load_checkpoint(path, mmap=True)
    except CheckpointError:
        try:  # checkpoints of earlier train.py versions hold numpy scalars in their results: allow those only
            with torch.serialization.safe_globals(numpy_scalar_types()):
                ckpt = load_checkpoint(path, mmap=True)
        except CheckpointError as e:
            fail(f"init_from: {e}")  # as train.py and publish.py say it
    found = weights_in(ckpt)
    if found is None:
        fail(f"init_from={path} is neither a checkpoint of train.py nor a state dict of the reference "
             f"implementation: it holds {what_it_holds(ckpt)}")
    if found['config'] is None:
        return found['weights'], None, 'state dict (reference format)', None, None
    step = f" of step {found['step']}" if found['step'] is not None else ''
    weights = 'EMA weights' if found['ema'] else 'model weights (it holds no EMA)'
    what = f"train.py checkpoint{step}, {weights}"
    return found['weights'], found['config'], what, found['data'], found['identifiers']


def shapes_in(sd):
    """What the weights' shapes say about the model and the dataset: {key: value} (only what they tell)."""
    found = {}
    if 'embed_tokens.embedding_weight' in sd:
        found['vocab_size'], found['hidden_size'] = map(int, sd['embed_tokens.embedding_weight'].shape)
    layers = {int(k.split('.')[2]) for k in sd if k.startswith('net.layers.') and k.split('.')[2].isdigit()}
    if layers:
        found['L_layers'] = max(layers) + 1
    if any('.mlp_t.' in k for k in sd):
        found['mlp_t'] = True
        found['total_len'] = int(sd['net.layers.0.mlp_t.gate_up_proj.weight'].shape[1]) \
            if 'net.layers.0.mlp_t.gate_up_proj.weight' in sd else None
    elif any('.self_attn.' in k for k in sd):
        found['mlp_t'] = False
    if 'embed_pos.embedding_weight' in sd:
        found['pos_encodings'] = 'learned'
        found['total_len'] = int(sd['embed_pos.embedding_weight'].shape[0])
    if 'puzzle_emb' in sd and sd['puzzle_emb'].dim() == 2:
        found['num_puzzle_identifiers'] = int(sd['puzzle_emb'].shape[0])
        width = int(sd['puzzle_emb'].shape[1])  # a model without puzzle embedding keeps width 1
        found['puzzle_emb_ndim'] = width if width > 1 else 0
    if found.get('total_len') is None:
        found.pop('total_len', None)
    return found


def meta_from_weights(sd, cfg, trained_on=None):
    """Dataset metadata for a checkpoint whose dataset is not on this machine: the puzzle kind and length the
    checkpoint recorded (trained_on, a data_shape dict), or else inferred from the weights' shapes; None unless
    they say unambiguously which puzzle it is (a 4x4 Sudoku's vocabulary is a maze's)."""
    s = shapes_in(sd)
    V = s.get('vocab_size')
    if V is None:
        return None
    kind = (trained_on or {}).get('puzzle_type')
    if kind:
        seq_len = int(trained_on['seq_len'])
    elif 'total_len' in s:
        prefix = cfg.get('puzzle_emb_len', TRMConfig.puzzle_emb_len)
        has_prefix = cfg.get('puzzle_emb_ndim', TRMConfig.puzzle_emb_ndim) > 0
        seq_len = s['total_len'] - (prefix if has_prefix else 0)
    elif seq_len_for_vocab(V):
        seq_len = seq_len_for_vocab(V)
    else:
        return None
    meta = dict(vocab_size=V, seq_len=seq_len, num_puzzle_identifiers=s.get('num_puzzle_identifiers', 1),
                pad_id=0, ignore_label_id=0, blank_identifier_id=0, **({'puzzle_type': kind} if kind else {}))
    return meta if puzzle_for(meta) else None


def mismatch_message(sd, model, cfg, given, where, ours, typed=False):
    """The weights do not fit the model built from the config and the dataset: which keys to check."""
    want = model.state_dict()
    missing = [k for k in want if k not in sd]
    unexpected = [k for k in sd if k not in want]
    reshaped = [k for k in want if k in sd and tuple(sd[k].shape) != tuple(want[k].shape)]
    parts = []
    for what, keys in (('missing', missing), ('unexpected', unexpected), ('of another shape', reshaped)):
        if keys:
            shapes = (f": {list(sd[keys[0]].shape)} in the file, {list(want[keys[0]].shape)} here"
                      if what == 'of another shape' else '')
            parts.append(f"{len(keys)} {what} (e.g. {keys[0]}{shapes})")
    found, mine = shapes_in(sd), dict(vars(cfg), total_len=cfg.total_len)
    differ = [k for k in found if k in mine and found[k] != mine[k]]
    down = sd.get('net.layers.0.mlp.down_proj.weight')
    if 'expansion' not in differ and 'hidden_size' in found and down is not None and \
            down.shape[1] != swiglu_inter(found['hidden_size'], cfg.expansion, cfg.mlp_multiple):
        differ.append('expansion')
    data_keys = {'vocab_size', 'num_puzzle_identifiers', 'total_len'}
    names = {'total_len': 'positions (seq_len + puzzle_emb_len)'}
    says = ', '.join(f"{names.get(k, k)}={found[k]}"
                     + (f" (here {mine[k]})" if k in differ and k in mine else '')
                     for k in found)
    check = [k for k in differ if k not in data_keys]
    if any(k in data_keys for k in differ):
        check += (['puzzle_emb_len', 'puzzle_emb_ndim'] if 'total_len' in differ else []) + ['data_path']
    if not check:
        check = ['expansion', 'pos_encodings', 'puzzle_emb_ndim', 'puzzle_emb_len', 'data_path']
    # the model keys came from the checkpoint or its all_config.yaml: only the dataset can be wrong; where flags may
    # have set them too (typed), a model key that differs is named
    if ours and not (typed and any(k not in data_keys for k in differ)):
        check = ['data_path']
        if 'total_len' in differ:  # its prefix is this model's: the rest is the length of the puzzles it learned
            says += (f": puzzles of seq_len {found['total_len'] - (cfg.total_len - cfg.seq_len)}, the dataset's "
                     f"are seq_len {cfg.seq_len}")
    return (f"init_from={given}: the weights do not fit the model built from {where}: {'; '.join(parts)}. "
            f"The weights say {says}. Check {', '.join('--' + k for k in dict.fromkeys(check))}")
