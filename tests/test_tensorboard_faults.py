"""
TensorBoard's folder failing under a run: a full tb/ is one warning, then the run goes on to its end (no thread
traceback, no warning per log line); a tb/ deleted mid-run, between two lines or while one is written, is made
again and the rest of the history lands in it. Real processes on the toy task (the deletion inside a write: the
writer alone, in this process); the full disk is a small tmpfs (root; skipped where it cannot be mounted).
    python -m pytest -q tests/test_tensorboard_faults.py
"""
import json
import os
import re
import shutil
import signal

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from runkeep.records import TensorBoardWriter
from conftest import TOY_ARGS, Lines, hold, popen_train, run
from disks import small_disk

FAST = TOY_ARGS + ['--epochs=2', '--eval_every_epochs=100', '--log_interval=2']
LONG = TOY_ARGS + ['--epochs=10000', '--eval_every_epochs=100000', '--log_interval=2']  # ended by SIGTERM


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
    # a run far longer than the test: it ends by SIGTERM once the new board has its lines, so its end never comes
    # before the deletion however slowly this side reads (a lagging reader leaves the process blocked on a full
    # pipe, not finished)
    out = tmp_path / 'o'
    proc = popen_train(toy, out, args=LONG)
    lines = Lines(proc)
    try:
        lines.until('step 10/')  # its board written to
        hold(proc)  # every thread still while its board goes (the writer's too)
        try:
            shutil.rmtree(out / 'tb')
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        while 'was deleted under the run' not in (warning := lines.until('warning: ')):  # its next log: tb/ gone
            pass
        since = int(re.search(r'from step (\d+)', warning).group(1))
        lines.until('step ')  # the log that made tb/ again is done: its scalars are in the new writer
        proc.send_signal(signal.SIGTERM)
        text = lines.rest(600)
    finally:  # a failure above would leave the run going on for hours, beside the next tests
        if proc.poll() is None:
            lines.kill()
    assert proc.returncode == 0 and 'stopped cleanly' in text, text[-3000:]
    assert len(warnings_about_tb(text)) == 1, warnings_about_tb(text)
    acc = EventAccumulator(str(out / 'tb'), size_guidance={'scalars': 0})
    acc.Reload()
    with open(out / 'metrics.jsonl') as f:
        steps = [r['step'] for r in map(json.loads, f) if r['kind'] == 'train' and r['step'] >= since]
    assert len(steps) >= 2 and [e.step for e in acc.Scalars('train/loss')] == steps  # the rest of the history


class DeletedWhenRead(dict):
    """A log line's values whose first reading deletes tb/: the deletion lands inside the write, after any look
    at the folder before it."""

    def __init__(self, folder, **vals):
        super().__init__(vals)
        self.folder = folder

    def items(self):
        if self.folder:
            shutil.rmtree(self.folder)
            self.folder = None
        return super().items()


def test_a_tb_folder_deleted_while_a_line_is_written_is_made_again_with_that_line(tmp_path, capsys):
    board = TensorBoardWriter.open(str(tmp_path), 0, {})
    board.log({'train': {'loss': 1.0}}, 1)
    board.log({'train': DeletedWhenRead(tmp_path / 'tb', loss=2.0)}, 2)
    board.log({'train': {'loss': 3.0}}, 3)
    board.close()
    text = capsys.readouterr().out
    assert len(warnings_about_tb(text)) == 1 and 'was deleted under the run' in text, text
    acc = EventAccumulator(str(tmp_path / 'tb'), size_guidance={'scalars': 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars('train/loss')] == [(2, 2.0), (3, 3.0)]
