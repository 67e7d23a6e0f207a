"""
Local storage on a bad day: a full disk, a failed results write, torn or unwritable metrics, an out_dir that is
a file, a build over a file size limit: one line naming the path, and nothing already saved is lost.
"""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from conftest import (FAST, ROOT, SUDOKU, assert_user_error, ckpts, held_step, read_until, run, script_env, site_hook,
                      train, write_like)
from disks import fill_up, small_disk


def test_a_failed_results_write_is_a_warning_and_the_resume_writes_it(toy, tmp_path):
    out = tmp_path / 'o'
    os.makedirs(out / 'results.json.tmp')  # results.json cannot be written, as on a full disk
    p = train(toy, out, '--max_steps=4')
    assert 'warning' in p.stdout and 'results.json' in p.stdout and 'Traceback' not in p.stdout + p.stderr
    assert ckpts(out) == ['ckpt_00000004.pt'] and not os.path.exists(out / 'results.json')
    os.rmdir(out / 'results.json.tmp')  # space freed
    p = train(toy, out, '--init_from=resume', '--max_steps=4')
    assert 'nothing to do' not in p.stdout, p.stdout[-3000:]
    assert json.load(open(out / 'results.json'))['step'] == 4
    evals = [json.loads(l) for l in open(out / 'metrics.jsonl') if '"eval"' in l]
    assert [e['step'] for e in evals] == [4]  # logged once


def test_a_full_disk_while_appending_metrics_is_a_warning_and_training_goes_on(toy, tmp_path):
    out = tmp_path / 'o'
    os.makedirs(out)
    limit = 1 << 21  # a checkpoint (about 1.1 MB) fits; metrics.jsonl, already near the limit, cannot grow
    pad = json.dumps(dict(kind='note', step=0, text='x' * (limit - 300))) + '\n'
    (out / 'metrics.jsonl').write_text(pad)
    wrapper = ("import resource, runpy, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
               f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit})); "
               "sys.argv = ['train.py'] + sys.argv[1:]; runpy.run_path('train.py', run_name='__main__')")
    p = run(['-c', wrapper, f'--data_path={toy}', f'--out_dir={out}', '--max_steps=8'] + FAST, check=False)
    out_text = p.stdout + p.stderr
    assert p.returncode == 0 and 'Traceback' not in out_text, out_text[-3000:]
    assert 'step 8/8' in p.stdout
    said = [l for l in p.stdout.splitlines() if 'metrics.jsonl' in l]  # a train line, another, the eval line
    assert len(said) == 1 and said[0].startswith('warning') and 'File too large' in said[0], said
    assert ckpts(out) == ['ckpt_00000008.pt'] and os.path.exists(out / 'results.json')
    # the line that did not fit whole is not left in part: a line appended once there is room would be glued to it
    assert (out / 'metrics.jsonl').read_text() == pad


@pytest.mark.parametrize('bad', [
    b'{"kind": "train", "step": 2, "lo\n',  # a line cut by a crash, then appended after
    b'\xff\xfe{"kind": "train", "step": 2}\n',  # a damaged block's bytes, no UTF-8: a UnicodeDecodeError's traceback
    b'{"kind": "train", "step": "2"}\n',  # hand-edited: the resume's step comparison was a TypeError's traceback
])
def test_a_torn_or_damaged_line_in_metrics_is_dropped_with_a_warning(sudoku4, trained, tmp_path, bad):
    out = shutil.copytree(trained, tmp_path / 'o')
    lines = open(os.path.join(out, 'metrics.jsonl'), 'rb').readlines()
    lines.insert(1, bad)
    open(os.path.join(out, 'metrics.jsonl'), 'wb').writelines(lines)
    p = train(sudoku4, out, '--init_from=resume', '--max_steps=6', args=SUDOKU)
    assert 'warning' in p.stdout and 'metrics.jsonl line 2' in p.stdout
    rows = [json.loads(l) for l in open(os.path.join(out, 'metrics.jsonl'))]
    assert rows[:len(lines) - 1] == [json.loads(l) for l in lines if l != bad]  # the others kept
    assert rows[-1]['step'] == 6


def test_solve_png_into_a_folder_and_a_model_of_another_puzzle(trained, tmp_path):
    ckpt = os.path.join(trained, 'ckpt_00000004.pt')
    folder = tmp_path / 'pics'
    os.makedirs(folder)
    p = run(['solve.py', f'--init_from={ckpt}', '--index=0', f'--png={folder}'], check=False)
    assert_user_error(p, f'png={folder}', 'folder')
    assert not os.path.exists(f'{folder}.png')
    p = run(['solve.py', f'--init_from={ckpt}', '--index=0', f'--png={folder}/steps'])
    assert f'wrote {folder}/steps.png' in p.stdout and os.path.exists(folder / 'steps.png')
    mazes = write_like(tmp_path / 'maze4', 'maze', 4)
    p = run(['solve.py', f'--init_from={ckpt}', '--index=0', f'--data_path={mazes}'])
    warning = [l for l in p.stdout.splitlines() if l.startswith('warning')]
    assert warning and '4x4 Sudoku' in warning[0] and '4x4 maze' in warning[0], p.stdout


def limited(limit, script='train.py'):
    """python -c arguments that run `script` under a file-size limit of `limit` bytes (a full disk's writes)."""
    return ['-c', "import resource, runpy, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit})); "
            f"sys.argv = [{script!r}] + sys.argv[1:]; runpy.run_path({script!r}, run_name='__main__')"]


def test_a_resume_onto_a_full_disk_is_one_line_that_keeps_the_run_s_files(toy, tmp_path):
    out = tmp_path / 'o'
    train(toy, out, '--max_steps=4')
    files = lambda: {n: open(out / n, 'rb').read() for n in os.listdir(out) if n != 'train.log' and (out / n).is_file()}
    before = files()
    size = os.path.getsize(out / 'metrics.jsonl')
    for limit in (40, size - 1):  # the lock's record does not fit; then metrics.jsonl's rewrite does not
        p = run(limited(limit) + [f'--data_path={toy}', f'--out_dir={out}', '--init_from=resume',
                                  '--max_steps=8'] + FAST, check=False)
        assert_user_error(p, str(out))
        assert 'File too large' in p.stdout + p.stderr
        assert files() == before
        assert not os.path.exists(out / 'run.lock')


def test_train_log_on_a_full_disk_is_one_warning_whole_lines_and_training_goes_on(toy, tmp_path):
    out, limit = tmp_path / 'o', 1 << 21  # a checkpoint fits; train.log, already near the limit, cannot grow much
    os.makedirs(out)
    pad = 'x' * (limit - 200) + '\n'  # the run's header line fits in part only
    (out / 'train.log').write_text(pad)
    p = run(limited(limit) + [f'--data_path={toy}', f'--out_dir={out}', '--max_steps=8'] + FAST, check=False)
    assert p.returncode == 0 and 'Traceback' not in p.stdout + p.stderr, (p.stdout + p.stderr)[-3000:]
    assert 'step 8/8' in p.stdout and ckpts(out) == ['ckpt_00000008.pt']
    said = [l for l in p.stdout.splitlines() if 'train.log' in l]
    assert len(said) == 1 and said[0].startswith('warning') and 'File too large' in said[0], said
    log = (out / 'train.log').read_text()
    assert log.startswith(pad) and log.endswith('\n')  # no line left in part: the next would be glued to it
    shown = set(p.stdout.splitlines())
    assert all(l in shown or l.startswith('note: ') for l in log[len(pad):].splitlines()), log[len(pad):]


# room again in train.log at the third training step: the older run's lines after the first MiB deleted
TRAIN_LOG_CUT_IN_STEP_3 = """import step
real, calls = step.train_step, [0]


def train_step(*args, **kwargs):
    calls[0] += 1
    if calls[0] == 3:
        os.truncate(os.path.join(os.environ['OUT_DIR'], 'train.log'), 1 << 20)
    return real(*args, **kwargs)


step.train_step = train_step
"""


def test_a_header_line_that_does_not_fit_goes_before_the_next_line_that_does_and_is_not_counted(toy, tmp_path):
    out, limit = tmp_path / 'o', 1 << 21
    os.makedirs(out)
    pad = ('x' * 1023 + '\n') * (limit // 1024 - 1) + 'x' * 1013 + '\n'  # an older run's lines: 10 bytes of room
    (out / 'train.log').write_text(pad)
    env = dict(site_hook(tmp_path / 'hook', TRAIN_LOG_CUT_IN_STEP_3), OUT_DIR=str(out))
    p = run(limited(limit) + [f'--data_path={toy}', f'--out_dir={out}', '--max_steps=4'] + FAST + ['--log_interval=1'],
            env=env)
    log = (out / 'train.log').read_text()[1 << 20:].splitlines()
    assert log[0].startswith('--- ') and 'pid ' in log[0] and log[1].startswith('note: '), log[:3]
    # the lines of the output not in the file, as the terminal shows them after the file's lines were opened
    shown = p.stdout.splitlines()
    after = shown[next(i for i, l in enumerate(shown) if l.startswith('device ')):]
    absent = [l for l in after if l not in log and 'train.log' not in l]
    said = [l for l in shown if 'train.log' in l]
    assert len(said) == 2 and f'; {len(absent)} line(s) of the output' in said[1], (said, absent)
    assert log[1].startswith(f'note: {len(absent)} line(s) of the output'), (log[1], absent)


# the second training step waits for a stop request (held_step's, for a script run by limited())
STEP_2_WAITS_FOR_A_STOP = """import step
from runkeep.signals import STOP
real, calls = step.train_step, [0]


def train_step(*args, **kwargs):
    calls[0] += 1
    if calls[0] == 2:
        print('test hook: step 2 waits', flush=True)
        while not STOP['requested']:
            time.sleep(0.05)
    return real(*args, **kwargs)


step.train_step = train_step
"""


def test_a_stop_said_on_a_full_disk_leaves_no_line_of_train_log_in_part(toy, tmp_path):
    # the stop's line, longer than the room left, was written in part: the next run's lines were glued to it
    out, limit = tmp_path / 'o', 1 << 21
    os.makedirs(out)
    pad = 'x' * (limit - 61) + '\n'
    (out / 'train.log').write_text(pad)
    env = site_hook(tmp_path / 'hook', STEP_2_WAITS_FOR_A_STOP)
    p = subprocess.Popen([sys.executable] + limited(limit) + [f'--data_path={toy}', f'--out_dir={out}',
                                                              '--max_steps=8'] + FAST, cwd=ROOT, env=script_env(env),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    shown = []
    for line in p.stdout:
        shown.append(line)
        if line.startswith('test hook: step 2 waits'):
            p.send_signal(signal.SIGTERM)
    assert p.wait(60) == 0 and any('got SIGTERM: saving a checkpoint' in l for l in shown), ''.join(shown)[-3000:]
    log = (out / 'train.log').read_text()
    assert log.startswith(pad) and log.endswith('\n'), log[len(pad):]


def test_a_checkpoint_that_does_not_fit_is_one_line_naming_the_one_kept_and_what_to_do(toy, tmp_path):
    out = tmp_path / 'o'
    train(toy, out, '--max_steps=4')
    kept = str(out / 'ckpt_00000004.pt')
    p = run(limited(1 << 18) + [f'--data_path={toy}', f'--out_dir={out}', '--init_from=resume', '--max_steps=8']
            + FAST, check=False)  # a checkpoint (about 0.5 MB) does not fit
    said = assert_user_error(p, 'checkpoint at step 8 failed', one_line=True)
    assert said.count('ckpt_00000008.pt') == 1 and 'File too large' in said, said
    assert f'{kept}, is kept' in said and '--init_from=resume' in said, said
    assert ckpts(out) == ['ckpt_00000004.pt']
    p = train(toy, out, '--init_from=resume', '--max_steps=8')  # room again: it goes on from the one kept
    assert f'resuming from {kept} (step 4)' in p.stdout and ckpts(out)[-1] == 'ckpt_00000008.pt'


def test_a_checkpoint_refused_for_another_reason_than_room_does_not_say_make_room(toy, tmp_path):
    out, moved, go = tmp_path / 'o', tmp_path / 'moved', tmp_path / 'go'
    env = script_env(held_step(tmp_path / 'hook', 3, go))
    p = subprocess.Popen([sys.executable, 'train.py', f'--data_path={toy}', f'--out_dir={out}', '--max_steps=4',
                          '--checkpoint_interval=2'] + FAST, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    read_until(p, 'test hook: step 3 waits')
    os.rename(out, moved)  # its folder moved away mid-run, a file in its place
    out.write_text('x')
    go.touch()
    said = p.communicate(timeout=120)[0]
    assert p.returncode != 0 and 'checkpoint at step 4 failed' in said and 'Not a directory' in said, said[-3000:]
    assert 'make room' not in said and '--init_from=resume' in said, said[-3000:]
    assert ckpts(moved) == ['ckpt_00000002.pt']


def test_an_out_dir_that_is_a_file_or_under_a_file_is_one_line(toy, tmp_path):
    f = tmp_path / 'file'
    f.write_text('x')
    for out in (f, f / 'sub'):
        p = train(toy, out, '--max_steps=2', check=False)
        assert_user_error(p, f'out_dir={out}')
    assert f.read_text() == 'x'


def test_a_build_over_a_file_size_limit_names_the_file(tmp_path):
    d = tmp_path / 'd'
    run(['prepare_sudoku.py', '--generate', '60', '--size', '4', '--num_test', '10', '--output_dir', str(d)])
    before = {s: sorted(os.listdir(d / s)) for s in ('train', 'test')}
    p = run(limited(2000, 'prepare_sudoku.py') + ['--csv_dir', str(d / 'csv'), '--output_dir', str(d)], check=False)
    assert_user_error(p, 'all__inputs.npy', 'File too large')
    assert len((p.stdout + p.stderr).strip().splitlines()) == 1, p.stdout + p.stderr
    assert {s: sorted(os.listdir(d / s)) for s in ('train', 'test')} == before


# the disk of the run filled at the start of step 1 (by another process's file, .filler) and freed at step 6;
# train.log then ends 50 bytes short of a page, as metrics.jsonl does
FILL_IN_STEP_1_FREE_IN_STEP_6 = """import step
real, calls = step.train_step, [0]


def train_step(*args, **kwargs):
    calls[0] += 1
    disk = os.path.dirname(os.environ['OUT_DIR'])
    if calls[0] == 1:
        with open(os.path.join(os.environ['OUT_DIR'], 'train.log'), 'a') as f:
            f.write('x' * (4096 - f.tell() % 4096 - 51) + '\\n')
        from disks import fill_up
        fill_up(disk)
    if calls[0] == 6:
        os.remove(os.path.join(disk, '.filler'))
    return real(*args, **kwargs)


step.train_step = train_step
"""


def test_metrics_on_a_disk_that_fills_and_has_room_again_keep_whole_lines_and_say_what_is_missing(toy, tmp_path):
    disk = tmp_path / 'disk'
    with small_disk(disk, '3m'):
        out = disk / 'o'
        os.makedirs(out)
        # the file ends 50 bytes short of a page: the first line after the fill fits in part
        pad = json.dumps(dict(kind='note', step=0, text='x' * (4096 - 50 - 40))) + '\n'
        (out / 'metrics.jsonl').write_text(pad)
        assert os.path.getsize(out / 'metrics.jsonl') == 4096 - 50
        env = dict(site_hook(tmp_path / 'hook', FILL_IN_STEP_1_FREE_IN_STEP_6), OUT_DIR=str(out))
        env['PYTHONPATH'] += os.pathsep + os.path.dirname(os.path.abspath(__file__))  # disks.py
        p = train(toy, out, '--max_steps=8', '--log_interval=1', env=env)
        lines = open(out / 'metrics.jsonl').read().splitlines(keepends=True)
        log = (out / 'train.log').read_text()
    said = [l for l in p.stdout.splitlines() if 'metrics.jsonl' in l]
    assert len(said) == 2 and 'No space left' in said[0] and '5 line(s)' in said[1], p.stdout[-3000:]
    assert lines[0] == pad and all(l.endswith('\n') and json.loads(l) for l in lines)  # none cut, none glued
    assert [json.loads(l)['step'] for l in lines if json.loads(l)['kind'] == 'train'] == [6, 7, 8]
    said = [l for l in p.stdout.splitlines() if 'train.log' in l]
    assert len(said) == 2 and 'No space left' in said[0] and 'line(s)' in said[1], p.stdout[-3000:]
    missing = said[1].split('; ')[1].split()[0]  # the file says it where the lines are missing, whole lines around
    assert f'x\nnote: {missing} line(s)' in log and log.endswith('\n'), log[-3000:]


def test_an_atomic_write_that_fails_midway_leaves_the_earlier_file_whole_and_no_tmp(tmp_path):
    # json.dump writes the record's first fields before it meets one it cannot write (a Ctrl-C, a matplotlib
    # error, the same): the half-written .tmp was left beside the file, only an OSError removed it
    from runkeep.records import write_json_atomic
    path = tmp_path / 'results.json'
    path.write_text('{"step": 4}\n')
    with pytest.raises(TypeError):
        write_json_atomic(str(path), {'step': 8, 'loss': object()})
    assert path.read_text() == '{"step": 4}\n' and os.listdir(tmp_path) == ['results.json']


def test_a_picture_that_does_not_fit_is_one_line_and_leaves_the_earlier_one_whole(trained, tmp_path):
    ckpt, pic = os.path.join(trained, 'ckpt_00000004.pt'), tmp_path / 'steps.png'
    run(['solve.py', f'--init_from={ckpt}', '--index=0', f'--png={pic}'])
    before = pic.read_bytes()
    p = run(limited(len(before) // 2, 'solve.py') + [f'--init_from={ckpt}', '--index=0', f'--png={pic}'],
            check=False)
    assert_user_error(p, f'png={pic}: cannot write it', 'File too large')
    assert pic.read_bytes() == before and os.listdir(tmp_path) == ['steps.png']
