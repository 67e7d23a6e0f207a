"""
Seeing a run as TPU users do: TensorBoard's event files read back with TensorBoard's own reader and its own
server (its fast loader too), equal to metrics.jsonl, after a stop and a resume too, in a gs:// bucket (the GCS
emulator), off when asked; XLA's compilations, the memory in use and the evaluation loss in the records; a
profile of chosen steps that its viewer's loader parses (torch.profiler on the CPU, torch_xla's profiler on XLA),
a range past the run's last step said at start, a profile a full disk did not let through not reported as
written; the pace after an evaluation or a save is the steps' alone; a test set without answers charts no accuracy.
    python -m pytest -q tests/test_tensorboard.py
"""
import contextlib
import glob
import gzip
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import requests
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from runkeep import gcs
from conftest import BUCKET, SUDOKU, TOY_ARGS, XLA_ENV, free_port, run, site_hook
from disks import small_disk

FAST = TOY_ARGS + ['--epochs=2', '--eval_every_epochs=1', '--log_interval=4']  # 40 steps; evaluations: 20, 40


def train(toy, out, *extra, env=None):
    return run(['train.py', f'--data_path={toy}', f'--out_dir={out}'] + FAST + list(extra), env=env)


def records(folder, kind):
    with open(os.path.join(folder, 'metrics.jsonl')) as f:
        return [r for r in map(json.loads, f) if r['kind'] == kind]


def board(folder):
    acc = EventAccumulator(str(folder), size_guidance={'scalars': 0, 'tensors': 0})
    acc.Reload()
    return acc


def series(acc, tag):
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def assert_board_equals_records(folder, tb=None):
    """Every train and eval scalar TensorBoard reads equals metrics.jsonl's (float32, as events store them),
    at exactly metrics.jsonl's steps, once each."""
    acc = board(tb or os.path.join(folder, 'tb'))
    train, evals = records(folder, 'train'), records(folder, 'eval')
    assert train and evals
    for tag, key, rows in [('train/loss', 'loss', train), ('train/exact_accuracy', 'exact_accuracy', train),
                           ('train/lr', 'lr', train), ('perf/memory_gib', 'memory_gib', train),
                           ('perf/examples_per_s', 'examples_per_s', train),
                           ('eval/exact_accuracy', 'exact_accuracy', evals), ('eval/loss', 'loss', evals),
                           ('eval/exact_ci_high', 'exact_ci_high', evals)]:
        assert series(acc, tag) == [(r['step'], np.float32(r[key])) for r in rows if key in r], tag
    return acc


# -----------------------------------------------------------------------------
# the event files, the records, a profile of chosen steps (CPU)

def test_events_equal_the_records_and_a_profile_of_chosen_steps_loads(toy, tmp_path):
    out = tmp_path / 'o'
    train(toy, out, '--profile_steps=3:6')
    acc = assert_board_equals_records(out)
    tags = acc.Tags()['scalars']
    for tag in ('train/grad_norm', 'train/q_halt_accuracy', 'train/steps', 'perf/ms_per_step',
                'eval_raw/exact_accuracy', 'eval/exact_accuracy_q_halt',
                'eval/steps_q_halt', 'eval/exact_at_steps_04', 'eval/lm_loss', 'train/lm_loss',
                'train/q_halt_loss'):
        assert tag in tags, (tag, tags)
    assert not any(t.startswith('xla/') for t in tags)  # not on the CPU
    assert 'config/text_summary' in acc.Tags()['tensors']
    # memory in use at each log line, the evaluation's loss (near the training's at the same step)
    train_rows, evals = records(out, 'train'), records(out, 'eval')
    assert all(r['memory'] == 'process RSS' and 0.01 < r['memory_gib'] < 64 for r in train_rows)
    at20 = next(r for r in train_rows if r['step'] == 20)
    for r in train_rows:  # the loss's terms, each logged (no q_continue_loss: no_ACT_continue=True)
        assert 'q_continue_loss' not in r and r['loss'] == pytest.approx(r['lm_loss'] + 0.5 * r['q_halt_loss'],
                                                                         rel=1e-4), r
    assert all(np.isfinite(e['loss']) and 0 < e['lm_loss'] <= e['loss'] for e in evals)
    assert abs(evals[0]['lm_loss'] - at20['lm_loss']) < 0.5 * at20['lm_loss'], (evals[0], at20)
    # the profile: a Chrome trace of steps 4-6 (json.load is Perfetto's and chrome://tracing's format)
    [trace] = glob.glob(str(out / 'profile' / '*'))
    assert trace.endswith('trace_3_6.json')
    events = json.load(open(trace))['traceEvents']
    assert sum(e.get('name') == 'train_step' for e in events) == 3
    assert any(e.get('name', '').startswith('aten::') for e in events)


def test_a_profile_range_past_the_last_step_says_so_at_start(sudoku4, tmp_path):
    out = tmp_path / 'o'
    p = run(['train.py', f'--data_path={sudoku4}', f'--out_dir={out}', '--max_steps=4', '--profile_steps=5:10']
            + SUDOKU + ['--log_interval=2'], timeout=300)
    said = [l for l in p.stdout.splitlines() if 'profile_steps=5:10' in l]
    assert len(said) == 1 and 'step 4' in said[0], p.stdout
    assert p.stdout.index(said[0]) < p.stdout.index('step 2/'), p.stdout  # at start, before training
    assert not glob.glob(str(out / 'profile' / '*'))


def test_a_profile_a_full_disk_did_not_let_through_is_not_reported_written(sudoku4, tmp_path):
    out = tmp_path / 'o'
    with small_disk(out / 'profile', '64k'):
        p = run(['train.py', f'--data_path={sudoku4}', f'--out_dir={out}', '--max_steps=6', '--profile_steps=2:5']
                + SUDOKU + ['--log_interval=2'], check=False, timeout=300)
        written = [l for l in p.stdout.splitlines() if l.startswith('profile of steps')]
        traces = [f for f in os.listdir(out / 'profile') if f.endswith('.json')]
        assert not traces, traces  # the trace did not fit
        assert not written, p.stdout
        assert 'profile' in p.stdout + p.stderr and str(out / 'profile') in p.stdout + p.stderr
    assert os.path.exists(out / 'results.json')  # a lost profile is no reason to lose the run


def test_q_continue_s_loss_is_logged_when_it_is_learned(toy, tmp_path):
    out = tmp_path / 'o'
    train(toy, out, '--no_ACT_continue=False', '--max_steps=8')
    rows = records(out, 'train')
    assert [r['step'] for r in rows] == [4, 8]
    for r in rows:
        assert r['q_continue_loss'] > 0 and r['loss'] == pytest.approx(
            r['lm_loss'] + 0.5 * (r['q_halt_loss'] + r['q_continue_loss']), rel=1e-4), r
    assert [v for _, v in series(board(out / 'tb'), 'train/q_continue_loss')] == \
        [np.float32(r['q_continue_loss']) for r in rows]


def test_a_window_where_no_row_halted_has_no_accuracy_or_steps(toy, tmp_path):
    """Rows halt only at halt_max_steps=4 here (q_halt starts far below 0), so the lines of steps 1-3 cover
    no halted row: their accuracies and steps are undefined, not 0, on the console, in metrics.jsonl and in
    TensorBoard (W&B logs the same scalars)."""
    out = tmp_path / 'o'
    p = train(toy, out, '--max_steps=6', '--log_interval=1')
    rows, halted = records(out, 'train'), ('accuracy', 'exact_accuracy', 'q_halt_accuracy', 'steps')
    assert [r['step'] for r in rows] == list(range(1, 7))
    none = [r['step'] for r in rows if not any(k in r for k in halted)]
    assert none and 4 not in none, rows
    assert all(all(k in r for k in halted) and r['steps'] >= 1 for r in rows if r['step'] not in none), rows
    for s in none:
        line = next(l for l in p.stdout.splitlines() if l.startswith(f'step {s}/6 '))
        assert '| acc n/a | exact n/a | steps n/a |' in line, line
    acc = board(out / 'tb')
    for key in halted:
        assert series(acc, f'train/{key}') == [(r['step'], np.float32(r[key])) for r in rows if key in r], key
    assert [s for s, _ in series(acc, 'train/loss')] == list(range(1, 7))


SLOW_EVALUATION_AND_SAVE = """import evaluate
import runkeep.run

real, shift = time.time, [0.0]
time.time = lambda: real() + shift[0]


def slow(call):
    def day_long(*args, **kwargs):
        done = call(*args, **kwargs)
        shift[0] += 86400  # the clock jumps a day ahead within it: a day in the wrong place shows on any CPU
        return done
    return day_long


evaluate.evaluate = slow(evaluate.evaluate)
runkeep.run.write_checkpoint = slow(runkeep.run.write_checkpoint)
"""


def test_the_pace_after_an_evaluation_or_a_save_is_the_training_s_alone(toy, tmp_path):
    """Each evaluation and save comes right after a log line: its seconds (here a day each, the clock's jump) were
    counted in the next line's steps, so perf/ms_per_step and examples/s dipped after every one as if training had
    slowed."""
    out = tmp_path / 'o'
    train(toy, out, '--max_steps=32', '--checkpoint_interval=8', '--watchdog_minutes=0',  # saves at 8, 16;
          env=site_hook(tmp_path / 'hook', SLOW_EVALUATION_AND_SAVE))                    # evaluations at 20, 32
    steps = {r['step']: r for r in records(out, 'train')}
    for step in (12, 24):  # steps 9-12 after the save at 8, 21-24 after the evaluation (and save) at 20
        assert steps[step]['ms_per_step'] < 3.6e6, steps[step]  # under an hour a step: no day in it
    assert_board_equals_records(out)


def test_an_evaluation_of_no_row_with_a_known_answer_charts_no_accuracy_or_loss(tmp_path):
    """A hidden test set (labels all ignored, as ARC's without solutions): the evaluation's accuracies and losses
    are over no row, undefined (the console says so); TensorBoard charted them as zeros, a run that looked like it
    solved nothing. What the evaluation did count (its rows, its cost) is charted."""
    from data import write_split
    data, rng = tmp_path / 'hidden', np.random.default_rng(0)
    for split, n in (('train', 200), ('test', 40)):
        x = rng.integers(2, 6, (n, 8))
        write_split(str(data), split, x, x[:, ::-1] if split == 'train' else np.zeros_like(x), np.zeros(n),
                    np.arange(n + 1), np.arange(n + 1), vocab_size=6)
    out = tmp_path / 'o'
    p = train(data, out, '--max_steps=4')
    assert 'eval on 0 rows with a known answer' in p.stdout, p.stdout[-3000:]
    tags = board(out / 'tb').Tags()['scalars']
    assert 'eval/eval_flops' in tags and 'eval/count' in tags, tags
    shown = [t for t in tags if t.startswith('eval/') and ('accuracy' in t or 'loss' in t or '_ci_' in t
                                                           or 'exact_at_steps' in t)]
    assert not shown, shown


def test_a_run_started_over_an_earlier_one_shows_its_own_config_alone(toy, tmp_path):
    out = tmp_path / 'o'
    train(toy, out, '--max_steps=4', '--lr=2e-3')
    train(toy, out, '--max_steps=4', '--lr=1e-3', '--overwrite=True')  # the same folder, from scratch
    acc = assert_board_equals_records(out)
    configs = [e.tensor_proto.string_val[0].decode() for e in acc.Tensors('config/text_summary')]
    assert len(configs) == 1 and '| lr | 0.001 |' in configs[0], configs


def test_tensorboard_false_writes_no_events(toy, tmp_path):
    out = tmp_path / 'o'
    train(toy, out, '--max_steps=4', '--tensorboard=False')
    assert records(out, 'train') and not os.path.exists(out / 'tb')


# -----------------------------------------------------------------------------
# a stop and a resume: every step once, never backwards (metrics.jsonl's steps, its values)

# the run sends itself SIGTERM at the start of its step 8 (a sitecustomize.py): a signal from outside after a line
# could come after step 10 on a fast machine, when the ranks agree on a stop only every ~2 s of steps
SIGTERM_IN_STEP_8 = """import step
real, calls = step.train_step, [0]


def train_step(*args, **kwargs):
    calls[0] += 1
    if calls[0] == 8:  # a real signal; its handler runs in the main thread, then the step goes on
        os.kill(os.getpid(), signal.SIGTERM)
        while not sys.modules['runkeep.signals'].STOP['requested']:
            time.sleep(0.005)
    return real(*args, **kwargs)


step.train_step = train_step
"""


def stopped_and_resumed(toy, out):
    """A run stopped by SIGTERM in step 8 (checkpoints 5 and the stop's), whose stop checkpoint is then
    lost (a preemption before its save): the resume continues from step 5, past the steps already logged."""
    args = ['train.py', f'--data_path={toy}', f'--out_dir={out}'] + TOY_ARGS + \
        ['--epochs=2', '--eval_every_epochs=1', '--log_interval=1', '--checkpoint_interval=5']
    p = run(args, env=site_hook(f'{out}_hook', SIGTERM_IN_STEP_8))
    assert 'stopped cleanly' in p.stdout, p.stdout[-3000:]
    stop = max(r['step'] for r in records(out, 'train'))
    assert stop >= 7
    os.remove(out / f'ckpt_{stop:08d}.pt')
    p = run(args + ['--init_from=resume', '--max_steps=12'])
    assert 'ckpt_00000005.pt' in p.stdout
    return stop


def test_a_stopped_and_resumed_run_shows_every_step_once(toy, tmp_path):
    out = tmp_path / 'o'
    stop = stopped_and_resumed(toy, out)
    assert len(glob.glob(str(out / 'tb' / 'events.out.tfevents.*'))) == 2  # one per process
    acc = assert_board_equals_records(out)
    steps = [s for s, _ in series(acc, 'train/loss')]
    assert steps == list(range(1, 13)), (stop, steps)


def test_a_damaged_record_keeps_its_event_file_whole_at_a_resume_and_a_crash_s_zeros_go(toy, tmp_path):
    """A length damaged in the middle of an event file (a bad block) was read as a torn tail: the resume's cut
    dropped every record after it, steps before the checkpoint's too, without a word; an Event damaged inside was
    kept or not as its bytes happened to parse (its CRC unread). Zeros a crash left past the last record are a torn
    tail: cut (they were kept as empty records)."""
    for damage in ('length', 'event', 'zeros'):
        out = tmp_path / damage
        train(toy, out, '--max_steps=8')
        [path] = glob.glob(str(out / 'tb' / 'events.out.tfevents.*'))
        data = open(path, 'rb').read()
        at = 0  # the first record starting past the file's middle: its length, or 4 bytes into its Event
        while at < len(data) // 2:
            at += 16 + int.from_bytes(data[at:at + 8], 'little')
        at += {'length': 0, 'event': 16}.get(damage, 0)
        damaged = data + bytes(300) if damage == 'zeros' else data[:at] + b'\xff' * 4 + data[at + 4:]
        open(path, 'wb').write(damaged)
        p = train(toy, out, '--init_from=resume', '--max_steps=12')
        said = [l for l in p.stdout.splitlines() if l.startswith('warning: cannot cut')]
        if damage == 'zeros':
            assert not said and open(path, 'rb').read() == data, p.stdout[-3000:]
        else:
            record = at - (16 if damage == 'event' else 0)
            assert len(said) == 1 and path in said[0] and f'a damaged record at byte {record}' in said[0], \
                (damage, p.stdout[-3000:])
            assert open(path, 'rb').read() == damaged


# -----------------------------------------------------------------------------
# a real TensorBoard server on a study's out_root: every run's scalars through its HTTP API

@contextlib.contextmanager
def served(root, names, log, *flags):
    """A real TensorBoard server on root (flags: its own, e.g. --load_fast=true for its Rust data server), once
    it lists every run in names: the runs' tags, and a (run, tag) -> [(step, float32)] reader."""
    port = free_port()
    server = subprocess.Popen([sys.executable, '-m', 'tensorboard.main', '--logdir', str(root), '--port',
                               str(port), '--host', '127.0.0.1', *flags], stdout=log, stderr=log)
    try:
        url, runs = f'http://127.0.0.1:{port}/data/plugin/scalars', {}
        deadline = time.time() + 120
        while set(runs) != {f'{name}/tb' for name in names}:
            assert server.poll() is None and time.time() < deadline, open(log.name).read()[-3000:]
            try:
                runs = requests.get(f'{url}/tags', timeout=5).json()
            except requests.RequestException:
                pass
            time.sleep(0.5)

        def scalars(name, tag):
            got = requests.get(f'{url}/scalars', params=dict(run=f'{name}/tb', tag=tag), timeout=10).json()
            return [(s, np.float32(v)) for _, s, v in got]
        yield runs, scalars
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def test_a_tensorboard_server_serves_every_run_of_a_study_folder(toy, tmp_path):
    root = tmp_path / 'study'
    train(toy, root / 'lr_a', '--max_steps=8')
    stopped_and_resumed(toy, root / 'resumed')
    with served(root, ['lr_a', 'resumed'], open(tmp_path / 'tb.log', 'w')) as (runs, scalars):
        for name in ('lr_a', 'resumed'):
            assert {'train/loss', 'eval/exact_accuracy', 'perf/memory_gib'} <= set(runs[f'{name}/tb'])
            want = [(r['step'], np.float32(r['loss'])) for r in records(root / name, 'train')]
            assert scalars(name, 'train/loss') == want, name


def test_a_resume_past_a_lost_checkpoint_s_evaluation_shows_every_step_once_in_the_fast_loader(toy, tmp_path):
    """An evaluation logged at step 16, whose checkpoint was lost (a kill during its save): the resume from
    step 10 evaluates at 20 and 40, and TensorBoard's data server, which ignores the purge a resumed file
    begins with, shows the evaluations metrics.jsonl holds, and no step 16."""
    from tensorboard_data_server import server_binary
    if not server_binary():  # a platform whose wheel carries no data server: TensorBoard has the Python loader only
        pytest.skip("tensorboard_data_server has no server binary on this platform")
    root, out = tmp_path / 'study', tmp_path / 'study' / 'r'
    train(toy, out, '--max_steps=16', '--checkpoint_interval=10')
    assert [r['step'] for r in records(out, 'eval')] == [16]
    os.remove(out / 'ckpt_00000016.pt')
    p = train(toy, out, '--checkpoint_interval=10', '--init_from=resume')
    assert 'ckpt_00000010.pt (step 10)' in p.stdout, p.stdout[-3000:]
    evals = records(out, 'eval')
    assert [r['step'] for r in evals] == [20, 40]
    assert_board_equals_records(out)  # TensorBoard's Python loader
    with served(root, ['r'], open(tmp_path / 'tb.log', 'w'), '--load_fast=true') as (_, scalars):
        for tag, key in [('eval/loss', 'loss'), ('eval/exact_accuracy', 'exact_accuracy')]:
            assert scalars('r', tag) == [(r['step'], np.float32(r[key])) for r in evals], tag
        assert scalars('r', 'train/loss') == [(r['step'], np.float32(r['loss'])) for r in records(out, 'train')]


# -----------------------------------------------------------------------------
# a gs:// run: the events reach the bucket and read back equal

def test_a_bucket_run_s_events_reach_the_bucket_and_read_back_equal(emu, toy, tmp_path):
    out, local = f'gs://{BUCKET}/tb/run1', tmp_path / 'l'
    train(toy, out, f'--local_dir={local}', '--checkpoint_interval=10',
          env=dict(STORAGE_EMULATOR_HOST=emu[7:]))
    client = gcs.GCS(endpoint=emu)
    uris = [uri for uri, _ in client.list(out + '/tb/')]
    assert len(uris) == 1 and os.listdir(local / 'tb') == [uris[0].rsplit('/', 1)[1]]
    client.download(uris[0], str(tmp_path / 'copy' / uris[0].rsplit('/', 1)[1]))
    assert_board_equals_records(local, tb=tmp_path / 'copy')
    assert not [n for n in os.listdir(local) if n.startswith('.tb.')]  # the upload snapshots are gone


def test_a_bucket_run_started_over_an_earlier_one_leaves_only_its_own_events_there(emu, toy, tmp_path):
    """--overwrite=True into a gs:// out_dir: the earlier run's event file goes from the bucket as from the local
    folder, so TensorBoard on the bucket shows the new run's steps and config alone."""
    out, local, env = f'gs://{BUCKET}/tb/over', tmp_path / 'l', dict(STORAGE_EMULATOR_HOST=emu[7:])
    train(toy, out, f'--local_dir={local}', '--max_steps=12', '--checkpoint_interval=6', env=env)
    train(toy, out, f'--local_dir={local}', '--max_steps=8', '--checkpoint_interval=4', '--lr=1e-3',
          '--overwrite=True', env=env)
    client = gcs.GCS(endpoint=emu)
    uris = [uri for uri, _ in client.list(out + '/tb/')]
    assert [uri.rsplit('/', 1)[1] for uri in uris] == os.listdir(local / 'tb'), uris
    client.download(uris[0], str(tmp_path / 'copy' / uris[0].rsplit('/', 1)[1]))
    acc = assert_board_equals_records(local, tb=tmp_path / 'copy')
    configs = [e.tensor_proto.string_val[0].decode() for e in acc.Tensors('config/text_summary')]
    assert len(configs) == 1 and '| lr | 0.001 |' in configs[0], configs


def test_a_download_a_kill_left_in_tb_is_not_sent_to_the_bucket(emu, toy, tmp_path):
    """A process killed while it fetched an event file leaves tb/fetch.tmp (cut.tmp likewise, killed while it
    cut one): the resume removes it, and sends none of it to the bucket with the event files it catches up."""
    out, local, env = f'gs://{BUCKET}/tb/torn', tmp_path / 'l', dict(STORAGE_EMULATOR_HOST=emu[7:])
    train(toy, out, f'--local_dir={local}', '--max_steps=8', '--checkpoint_interval=4', env=env)
    for name in ('fetch.tmp', 'cut.tmp'):
        (local / 'tb' / name).write_bytes(b'torn')
    p = train(toy, out, f'--local_dir={local}', '--max_steps=12', '--checkpoint_interval=4', '--init_from=resume',
              env=env)
    names = [uri.rsplit('/', 1)[1] for uri, _ in gcs.GCS(endpoint=emu).list(out + '/tb/')]
    assert names and all('tfevents' in n for n in names) and '.tmp' not in p.stdout, (names, p.stdout[-3000:])
    assert all('tfevents' in n for n in os.listdir(local / 'tb'))


def event_steps(path, tag=None):
    """The steps of every scalar record in one event file (of `tag`, if given), in order, read with TensorBoard's
    own record reader: what its fast loader reads, which ignores the purge a resumed file begins with."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event
    events = (Event.FromString(r) for r in RawEventFileLoader(str(path)).Load())
    return [e.step for e in events if e.HasField('summary') and (tag is None or e.summary.value[0].tag == tag)]


def test_a_bucket_run_resumed_on_a_new_machine_cuts_the_bucket_s_earlier_events_too(emu, toy, tmp_path):
    """Its step-16 checkpoint lost from the bucket (an upload that failed), a gs:// run resumes on another
    machine from step 10: the event file the first machine uploaded (steps to 16) is cut to step 10 in the
    bucket too, as TensorBoard's fast loader ignores the purge the new file begins with."""
    out, env = f'gs://{BUCKET}/tb/moved', dict(STORAGE_EMULATOR_HOST=emu[7:])
    train(toy, out, f'--local_dir={tmp_path / "first"}', '--max_steps=16', '--checkpoint_interval=10', env=env)
    client = gcs.GCS(endpoint=emu)
    [(first, _)] = client.list(out + '/tb/')
    client.download(first, str(tmp_path / 'before' / 'events'))
    assert max(event_steps(tmp_path / 'before' / 'events')) == 16
    client.delete(f'{out}/ckpt_00000016.pt')
    p = train(toy, out, f'--local_dir={tmp_path / "second"}', '--checkpoint_interval=10', '--init_from=resume',
              env=env)
    assert '(step 10)' in p.stdout, p.stdout[-3000:]
    uris = sorted(uri for uri, _ in client.list(out + '/tb/'))
    assert len(uris) == 2 and first in uris
    for uri in uris:
        client.download(uri, str(tmp_path / 'after' / uri.rsplit('/', 1)[1]))
    assert max(event_steps(tmp_path / 'after' / first.rsplit('/', 1)[1])) == 10
    assert_board_equals_records(tmp_path / 'second', tb=tmp_path / 'after')


def test_a_machine_back_on_a_bucket_run_sends_none_of_its_undone_steps_there(emu, toy, tmp_path):
    """The first machine trained and evaluated to step 16, whose checkpoint never reached the bucket; a second
    machine resumed from step 10 to 24; the first, back with its folder as it was, resumes step 24 from the
    bucket: its own event file, which still holds steps 11-16 and their evaluation, goes to the bucket only
    without them (they were undone), so every file there read as the fast loader reads it shows each step
    once, metrics.jsonl's."""
    out, env = f'gs://{BUCKET}/tb/back', dict(STORAGE_EMULATOR_HOST=emu[7:])
    first, second = tmp_path / 'first', tmp_path / 'second'
    train(toy, out, f'--local_dir={first}', '--max_steps=16', '--checkpoint_interval=10', env=env)
    client = gcs.GCS(endpoint=emu)
    client.delete(f'{out}/ckpt_00000016.pt')
    train(toy, out, f'--local_dir={second}', '--max_steps=24', '--checkpoint_interval=10', '--init_from=resume',
          env=env)
    p = train(toy, out, f'--local_dir={first}', '--max_steps=28', '--checkpoint_interval=10', '--init_from=resume',
              env=env)
    assert '(step 24)' in p.stdout, p.stdout[-3000:]
    for uri, _ in client.list(out + '/tb/'):
        client.download(uri, str(tmp_path / 'bucket' / uri.rsplit('/', 1)[1]))
    files = sorted(glob.glob(str(tmp_path / 'bucket' / '*tfevents*')))
    assert len(files) == 3, files
    for tag, kind in (('eval/exact_accuracy', 'eval'), ('train/loss', 'train')):
        steps = sorted(s for f in files for s in event_steps(f, tag))
        assert steps == [r['step'] for r in records(first, kind)], (tag, steps)


# -----------------------------------------------------------------------------
# XLA (torch_xla on the CPU): compilations at each log line, memory, evaluation loss, torch_xla's profile

def test_xla_compilations_memory_eval_loss_and_its_profile(toy, tmp_path):
    pytest.importorskip('torch_xla')  # Linux wheels only
    out = tmp_path / 'o'
    p = train(toy, out, '--device=xla', '--max_steps=24', '--log_interval=2', '--profile_steps=14:16',
              env=XLA_ENV)
    assert 'warning' not in p.stdout and 'compilation(s)' not in p.stdout, p.stdout[-3000:]
    rows, evals = records(out, 'train'), records(out, 'eval')
    assert rows[0]['xla_compiles'] > 0 and rows[0]['xla_compile_s'] > 0  # the step's graphs: the first line
    assert all(r['xla_compiles'] == 0 for r in rows[1:]), [r['xla_compiles'] for r in rows]
    assert [r['xla_compiles_total'] for r in rows] == sorted(r['xla_compiles_total'] for r in rows)
    assert evals[0]['xla_compiles'] > 0 and all(np.isfinite(e['loss']) for e in evals)
    assert all(r['memory'] in ('device in use', 'process RSS') and r['memory_gib'] > 0 for r in rows)
    acc = assert_board_equals_records(out)
    assert series(acc, 'xla/compiles_total') == [(r['step'], r['xla_compiles_total']) for r in rows]
    # torch_xla's profile: the trace of steps 15-16 in TensorBoard's profile layout; its Chrome trace parses
    [xplane] = glob.glob(str(out / 'profile' / 'plugins' / 'profile' / '*' / '*.xplane.pb'))
    assert os.path.getsize(xplane) > 0
    [trace] = glob.glob(os.path.join(os.path.dirname(xplane), '*.trace.json.gz'))
    events = json.load(gzip.open(trace))['traceEvents']
    assert sum(e.get('name') == 'train_step' for e in events) == 2
