"""
TensorBoard's folder failing under a run: a full tb/ is one warning, then the run goes on to its end (no thread
traceback, no warning per log line); a tb/ deleted mid-run is made again and the rest of the history lands
in it. Real processes on the toy task; the full disk is a small tmpfs (root; skipped where it cannot be
mounted).
    python -m pytest -q tests/test_tensorboard_faults.py
"""
import glob
import os
import shutil
import signal

from conftest import TOY_ARGS, Lines, popen_train, run
from disks import small_disk

FAST = TOY_ARGS + ['--epochs=2', '--eval_every_epochs=100', '--log_interval=2']


def warnings_about_tb(text):
    return [l for l in text.splitlines() if 'warning' in l.lower() and ('tb' in l or 'TensorBoard' in l)]


def test_a_full_tb_folder_is_one_warning_and_the_run_goes_on(toy, tmp_path):
    out = tmp_path / 'o'
    with small_disk(out / 'tb', '16k', fill=True):
        p = run(['train.py', f'--data_path={toy}', f'--out_dir={out}', '--max_steps=20'] + FAST, check=False)
    text = p.stdout + p.stderr
    assert p.returncode == 0 and os.path.exists(out / 'results.json'), text[-3000:]
    assert 'Traceback' not in text, text[-3000:]
    assert len(warnings_about_tb(text)) == 1, warnings_about_tb(text)


def test_a_tb_folder_deleted_mid_run_is_made_again(toy, tmp_path):
    out = tmp_path / 'o'
    proc = popen_train(toy, out, args=FAST)
    lines = Lines(proc)
    lines.until('step 10/')  # its board written to; 30 steps and the evaluation to come
    os.kill(proc.pid, signal.SIGSTOP)  # held still while its board goes: mid-run, whatever the machine's speed
    try:
        shutil.rmtree(out / 'tb')
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    text = lines.rest(600)
    assert proc.returncode == 0, text[-3000:]
    assert len(warnings_about_tb(text)) <= 1, warnings_about_tb(text)
    events = glob.glob(str(out / 'tb' / 'events*'))
    assert events and sum(os.path.getsize(f) for f in events) > 0  # the rest of the history is there
