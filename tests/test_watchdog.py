"""
The watchdog: a hung rank is ended with its stacks and a non-zero exit, under torch_xla's launcher too, and the
same command resumes; a slow evaluation that progresses is not ended.
"""
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import (ROOT, TOY_ARGS, XLA_ENV, make_reverse_dataset, run, script_env, site_hook,
                      stopped_owing_an_evaluation)
from test_dist import torchrun


def hang_at(tmp_path, what, root=ROOT):
    """The environment of a run that blocks for good at the watchdog's report `what` ('step 25', 'an evaluation
    batch') once the watchdog is armed, as a rank stuck in a collective would: a sitecustomize.py on PYTHONPATH,
    which Python runs first in every process the run starts (torch_xla's workers too), wraps Watchdog.progress
    (the trainer's in `root`)."""
    return site_hook(tmp_path / 'hang', f'''from runkeep import watchdog
progress = watchdog.Watchdog.progress

def hang(self, what, step=None):
    progress(self, what, step)
    if what == {what!r} and not self.warmup:
        threading.Event().wait()

watchdog.Watchdog.progress = hang
''', root=root)


def records(folder):
    with open(os.path.join(folder, 'metrics.jsonl')) as f:
        return [json.loads(l) for l in f]


def test_a_hung_rank_is_ended_with_its_stacks_and_the_same_command_resumes(toy, tmp_path):
    out = f'{tmp_path}/o'
    args = ['train.py', f'--data_path={toy}', f'--out_dir={out}', *TOY_ARGS, '--max_steps=40',
            '--checkpoint_interval=10', '--log_interval=10', '--init_from=resume', '--watchdog_minutes=0.05']
    p = run(args, env=hang_at(tmp_path, 'step 25'), timeout=300, check=False)  # blocks for good at step 25
    assert p.returncode == 75, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    assert 'watchdog: nothing finished for 0.' in p.stderr and '(watchdog_minutes=0.05; the last: step 25)' in p.stderr
    assert 'Current thread' in p.stderr and 'in main' in p.stderr  # every thread's stack: the loop's, where it hangs
    log = open(f'{out}/train.log').read()
    assert 'watchdog: nothing finished' in log and 'Current thread' in log and 'in main' in log
    hung = [r for r in records(out) if r['kind'] == 'watchdog']
    assert len(hung) == 1 and hung[0]['step'] == 25 and hung[0]['last'] == 'step 25', hung
    assert not os.path.exists(f'{out}/run.lock')
    # the same command, run again, resumes from the last checkpoint and finishes
    p = run(args, timeout=300)
    assert f'resuming from {out}/ckpt_00000020.pt (step 20)' in p.stdout
    assert json.load(open(f'{out}/results.json'))['step'] == 40


def test_a_hung_run_whose_output_goes_to_a_file_leaves_its_last_lines_there(toy, tmp_path):
    """`nohup python train.py ... > run.out`: stdout into a file is block-buffered, and the watchdog's hard exit
    (no atexit, no flush) dropped what was still in the buffer: the steps before the hang, the lines a user reads
    first to see where it hung. Every line of stdout that train.log holds is in the file too."""
    out = f'{tmp_path}/o'
    with open(tmp_path / 'run.out', 'w') as f:
        p = subprocess.run([sys.executable, 'train.py', f'--data_path={toy}', f'--out_dir={out}', *TOY_ARGS,
                            '--max_steps=40', '--log_interval=5', '--watchdog_minutes=0.05'], cwd=ROOT, stdout=f,
                           stderr=subprocess.PIPE, text=True, timeout=300,
                           env=script_env(dict(hang_at(tmp_path, 'step 25'), PYTHONUNBUFFERED=None)))
    assert p.returncode == 75, p.stderr[-3000:]
    said = open(tmp_path / 'run.out').read().splitlines()
    steps = [l for l in open(f'{out}/train.log').read().splitlines() if l.startswith('step ')]
    assert len(steps) == 4 and steps[-1].startswith('step 20/40'), steps  # steps 5 ... 20, then the hang
    assert [l for l in said if l.startswith('step ')] == steps, said[-10:]


def test_ranks_that_hang_together_exit_75_and_the_rerun_that_hangs_there_again_70(toy, tmp_path):
    # every rank writes the folder's watchdog.json: a sibling's record of this same launch is no earlier hang
    args = [f'--data_path={toy}', f'--out_dir={tmp_path}/o', *TOY_ARGS, '--max_steps=40', '--checkpoint_interval=10',
            '--log_interval=2', '--init_from=resume', '--watchdog_minutes=0.05']
    hung = hang_at(tmp_path, 'step 25')  # both ranks, in every launch (the rerun resumes at step 20)
    first, second = (torchrun(2, args, env=hung) for _ in range(2))
    codes = lambda p: sorted(re.findall(r'exiting with code (\d+):', p.stderr))
    assert codes(first) == ['75', '75'], first.stderr[-3000:]
    assert codes(second) == ['70', '70'], second.stderr[-3000:]  # the same work hung again: a loop on 75 ends


def test_a_hung_rank_under_torch_xla_launch_ends_the_command_with_the_same_code(toy, tmp_path):
    pytest.importorskip('torch_xla')  # Linux wheels only
    out = f'{tmp_path}/o'
    p = run(['train.py', f'--data_path={toy}', f'--out_dir={out}', *TOY_ARGS, '--device=auto', '--compile=False', '--max_steps=8',
             '--log_interval=2', '--watchdog_minutes=0.05'], env=dict(XLA_ENV, **hang_at(tmp_path, 'step 4')),
            timeout=600, check=False)  # the launcher's process, whose worker the watchdog ends
    assert p.returncode == 75, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    assert 'the last: step 4)' in p.stderr and 'a training process ended abruptly; exiting with code 75' in p.stderr
    assert 'Traceback' not in p.stderr and 'Current thread' in open(f'{out}/train.log').read()


# every evaluation supervision step takes 2 ms more: 1000 batches of 4 steps outlast 3 s on the fastest machine
AT_LEAST_2_MS = """import model
real = model.TRM.predict_step


def predict_step(self, *args, **kwargs):
    time.sleep(0.002)
    return real(self, *args, **kwargs)


model.TRM.predict_step = predict_step
"""


def test_a_long_evaluation_is_not_ended_while_it_progresses_and_is_when_it_hangs(tmp_path):
    data = make_reverse_dataset(str(tmp_path / 'data'), n_test=2000)
    args = ['train.py', f'--data_path={data}', *TOY_ARGS, '--max_steps=6', '--log_interval=2', '--eval_batch_size=2',
            '--watchdog_minutes=0.05']  # 1000 evaluation batches against 3 s, which a busy CPU's step keeps within
    out = f'{tmp_path}/o'
    p = run(args + [f'--out_dir={out}'], timeout=600, env=site_hook(tmp_path / 'slow', AT_LEAST_2_MS))
    evals = [r for r in records(out) if r['kind'] == 'eval']
    assert 'watchdog: nothing finished' not in p.stderr and len(evals) == 1 and evals[0]['step'] == 6
    spent = json.load(open(f'{out}/results.json'))['wall_s']['eval']
    assert spent > 3, spent  # the premise: the evaluation outlasted the watchdog's limit, progressing
    # the same evaluation stuck at a batch: ended
    p = run(args + [f'--out_dir={tmp_path}/hung'], env=hang_at(tmp_path, 'an evaluation batch'), timeout=300,
            check=False)
    assert p.returncode == 75 and '(watchdog_minutes=0.05; the last: an evaluation batch)' in p.stderr, p.stderr[-2000:]
    assert 'in evaluate' in p.stderr and 'watchdog: nothing finished' in open(f'{tmp_path}/hung/train.log').read()


def test_a_hang_in_a_resume_s_first_evaluation_is_recorded_at_its_step_and_the_rerun_resumes(toy, tmp_path):
    # a resume whose results.json is missing evaluates before any training step: the watchdog's record names
    # the checkpoint's step (a null one stopped every later resume reading metrics.jsonl)
    out = f'{tmp_path}/o'
    args = ['train.py', f'--data_path={toy}', f'--out_dir={out}', *TOY_ARGS, '--max_steps=10', '--init_from=resume']
    run(args)
    os.remove(f'{out}/results.json')
    p = run(args + ['--watchdog_minutes=0.05', '--log_interval=1', '--eval_batch_size=2'],
            env=hang_at(tmp_path, 'an evaluation batch'), timeout=300, check=False)
    assert p.returncode == 75 and 'waiting for the evaluation after step 10' in p.stderr, p.stderr[-2000:]
    hung = [r for r in records(out) if r['kind'] == 'watchdog']
    assert len(hung) == 1 and hung[0]['step'] == 10, hung
    with open(f'{out}/metrics.jsonl', 'a') as f:  # and one an older trainer wrote
        f.write(json.dumps(dict(kind='watchdog', step=None, waiting='the evaluation of the checkpoint')) + '\n')
    p = run(args, timeout=300)
    assert json.load(open(f'{out}/results.json'))['step'] == 10 and 'Traceback' not in p.stderr


def test_a_hung_run_s_offline_w_and_b_history_is_written_before_it_exits(toy, tmp_path):
    # an offline W&B run's file is written whole only by its finish(): the watchdog's hard exit finishes it
    out = f'{tmp_path}/o'
    args = ['train.py', f'--data_path={toy}', f'--out_dir={out}', *TOY_ARGS, '--max_steps=40', '--log_interval=5',
            '--watchdog_minutes=0.05', '--wandb_log=True']
    env = dict(hang_at(tmp_path, 'step 25'), WANDB_MODE='offline', WANDB_SILENT='true', HOME=str(tmp_path))
    p = run(args, env=env, timeout=300, check=False)
    assert p.returncode == 75, p.stderr[-2000:]
    logged = [r for r in records(out) if r['kind'] == 'train']
    history, = [open(os.path.join(d, f), 'rb').read() for d, _, fs in os.walk(f'{out}/wandb') for f in fs
                if f.endswith('.wandb')]
    # each history record names its keys: every logged line's train/loss is in the file (the summary adds one)
    assert len(logged) == 4 and history.count(b'train/loss') >= len(logged), (len(history), len(logged))


@pytest.mark.parametrize('text', ['{"exit_code": [70]}', '{"exit_code": 0}', '{"exit_code": "x"}', '[70]', '{"ex'])
def test_a_damaged_watchdog_json_is_read_as_a_first_hang(tmp_path, text, capsys):
    """A torch_xla launcher takes its exit code from the watchdog.json its worker wrote: one damaged (a value of
    another type, a code the watchdog never writes) ended the launcher in a traceback or with that code (0: a
    hang that SkyPilot reads as success); it is read as a first hang (75: resume), as one missing is."""
    from runkeep.signals import HUNG_AGAIN_EXIT, HUNG_EXIT, ended_abruptly
    (tmp_path / 'watchdog.json').write_text(text)
    assert ended_abruptly(str(tmp_path), 0) == HUNG_EXIT
    (tmp_path / 'watchdog.json').write_text(json.dumps(dict(exit_code=HUNG_AGAIN_EXIT)))
    assert ended_abruptly(str(tmp_path), 0) == HUNG_AGAIN_EXIT
    assert f"exiting with code {HUNG_AGAIN_EXIT}" in capsys.readouterr().err


def test_a_resume_s_owed_evaluation_leaves_the_first_training_steps_unwatched(toy, tmp_path):
    # a stop in step 20, an evaluation's, saves it owed; the resume evaluates it before training on, and then its
    # first training step takes 8 s (a real accelerator compiles its graphs there) against a watchdog of 3 s:
    # the evaluation's reports are not the training's, which is armed once the first log line is past, as always
    out, args = tmp_path / 'o', ['--epochs=2', '--eval_every_epochs=1', '--log_interval=10']
    stopped_owing_an_evaluation(toy, out, args, tmp_path / 'hook')
    compiles = site_hook(tmp_path / 'compiles', """import step
real, calls = step.train_step, [0]


def train_step(*args, **kwargs):
    calls[0] += 1
    if calls[0] == 1:
        time.sleep(8)
    return real(*args, **kwargs)


step.train_step = train_step
""")
    p = run(['train.py', f'--data_path={toy}', f'--out_dir={out}', *TOY_ARGS, *args, '--init_from=resume',
             '--watchdog_minutes=0.05'], env=compiles, timeout=300, check=False)
    text = p.stdout + p.stderr
    assert 'evaluating it before training on' in p.stdout, text[-3000:]
    assert p.returncode == 0 and 'watchdog:' not in text, (p.returncode, text[-3000:])
    assert json.load(open(out / 'results.json'))['step'] == 40
