"""
study.py --eval_only on a full disk: the child's output that cannot be copied is one line naming the path, and
the summary still prints (no traceback, no output stopped mid-line). A real tiny study at the cpu scale whose
out_root is a small tmpfs, filled once the run is trained (root; skipped where it cannot be mounted). A report
that does not fit (a file-size limit) names its file and leaves the earlier report's files as they were. A
child's line that study.py cannot copy whole into train.log is cut back out, and the copying resumes with a note of
how many lines are missing once there is room, in the same file or in one that replaced it meanwhile; lines still
missing when the child ends are counted in one line on the terminal, as the child's own train.log (Tee) counts its
own on stderr, where a line print() writes in parts counts as in only once all of it is. A child's stdout and
stderr go into train.log, and onto study.py's terminal, in whole lines, never one glued into the other's; a line
rewritten in place (a download's progress) is on the terminal as it goes.
    python -m pytest -q tests/test_study_disk.py
"""
import os
import shutil


from conftest import ROOT, run
from disks import fill_up, small_disk


def test_a_study_re_evaluation_on_a_full_disk_names_the_path_and_prints_its_summary(tmp_path):
    tmp, out = str(tmp_path), tmp_path / 'out'
    (tmp_path / 'cfg').mkdir()
    shutil.copy(os.path.join(ROOT, 'config', 'study', 'rec_L2.py'), tmp_path / 'cfg')
    study = ['study.py', '--pattern=rec_L2', f'--config_dir={tmp}/cfg', f'--out_root={out}',
             f'--data_root={tmp}/data', '--scale=cpu', '--extra=--max_steps=20 --log_interval=10']
    with small_disk(out, '64m'):
        run(study)
        fill_up(out)
        p = run(study + ['--eval_only=True', '--eval_views=1,2', '--eval_steps=4'], check=False)
    text = p.stdout + p.stderr
    assert 'Traceback' not in text, text[-3000:]
    assert 'summary of the test-time evaluations' in p.stdout, text[-3000:]
    assert 'the lock holds' in p.stdout, text[-3000:]  # taken without its holder's record, said
    full = [l for l in text.splitlines() if 'No space left' in l]
    assert full and str(out) in full[0], text[-3000:]


def test_a_report_that_does_not_fit_names_its_file_and_leaves_the_earlier_report_whole(tmp_path):
    tmp, out = str(tmp_path), tmp_path / 'out'
    (tmp_path / 'cfg').mkdir()
    shutil.copy(os.path.join(ROOT, 'config', 'study', 'rec_L2.py'), tmp_path / 'cfg')
    study = ['--pattern=rec_L2', f'--config_dir={tmp}/cfg', f'--out_root={out}', f'--data_root={tmp}/data',
             '--scale=cpu', '--extra=--max_steps=20 --log_interval=10', '--report=True']
    run(['study.py'] + study[:-1])
    before = {n: (out / n).read_bytes() for n in os.listdir(out) if n.startswith('report') or n.endswith('.png')}
    limit = len(before['report.md']) // 2  # a full disk, as a file-size limit: the new report.md does not fit
    p = run(['-c', "import resource, runpy, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
             f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit})); "
             "sys.argv = ['study.py'] + sys.argv[1:]; runpy.run_path('study.py', run_name='__main__')"] + study,
            check=False)
    text = p.stdout + p.stderr
    assert p.returncode == 1 and 'Traceback' not in text, text[-3000:]
    said = [l for l in text.splitlines() if 'File too large' in l]
    assert len(said) == 1 and str(out / 'report.md') in said[0], text[-3000:]
    assert {n: (out / n).read_bytes() for n in before} == before
    assert not [n for n in os.listdir(out) if n.endswith('.tmp')]


# The parent's side of a run's train.log: a real child's output copied by study.py's Running, as a study copies
# it, into a log whose last page has room for the header but not for a whole line of the child's, on a full tmpfs;
# then room again before the child's last lines.
COPY_DRIVER = r'''
import os, sys, time
log, filler, go = sys.argv[1:4]
replace = sys.argv[4:] == ['replace']  # the log replaced by another file as room comes back
sys.argv = ['study.py']
import study
child = ("import os, sys, time\n"
         "for i in range(5): print('early line', i, 'x' * 300)\n"
         "while not os.path.exists(sys.argv[1]): time.sleep(0.01)\n"
         "for i in range(3): print('late line', i, 'x' * 300)\n")
r = study.Running(['-c', child, go], log, 'the child')
while (got := r.pump(echo=True)) != 'eof':
    if any(l.startswith('early line 4 ') for l in r.tail) and not os.path.exists(go):
        os.remove(filler)  # every early line has been copied or refused: the disk has room from now on
        if replace:  # as a resumed gs:// run on a new machine fetches the bucket's train.log
            with open(log + '.new', 'wb') as f:
                f.write(b'the replacing log\n')
            os.replace(log + '.new', log)
        open(go, 'w').close()
    elif not got:
        time.sleep(0.05)
print('exit code', r.close()[0])
'''


def test_a_line_the_full_disk_refuses_is_cut_back_out_of_train_log_and_copying_resumes(tmp_path):
    disk = tmp_path / 'disk'
    log = disk / 'train.log'
    with small_disk(disk, '1m'):
        page = os.statvfs(disk).f_bsize  # what tmpfs allocates a file in
        earlier = b'#' * (2 * page - 151) + b'\n'  # an earlier process's part; its last page has 150 bytes free
        log.write_bytes(earlier)
        fill_up(disk)
        p = run(['-c', COPY_DRIVER, str(log), str(disk / '.filler'), str(tmp_path / 'go')])
        data = log.read_bytes()
    assert 'exit code 0' in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
    assert data.startswith(earlier) and data.endswith(b'\n'), data[-400:]
    lines = data[len(earlier):].decode().split('\n')[:-1]
    late = [f"late line {i} {'x' * 300}" for i in range(3)]
    note = "note: 5 line(s) of the output before this one are not in this file (it could not be appended to)"
    assert lines[0] == '' and lines[1].startswith('=== ') and lines[1].endswith(': the child'), lines[:2]
    assert lines[2:] == [note] + late, lines[2:]
    said = [l for l in p.stdout.splitlines() if str(log) in l]
    assert len(said) == 2 and 'No space left on device' in said[0] and '5 line(s)' in said[1], p.stdout[-3000:]


def test_lines_missing_when_the_log_is_replaced_are_counted_in_the_note_of_the_new_one(tmp_path):
    disk = tmp_path / 'disk'
    log = disk / 'train.log'
    with small_disk(disk, '1m'):
        page = os.statvfs(disk).f_bsize
        log.write_bytes(b'#' * (2 * page - 151) + b'\n')  # room for the header, not for a line of the child's
        fill_up(disk)
        p = run(['-c', COPY_DRIVER, str(log), str(disk / '.filler'), str(tmp_path / 'go'), 'replace'])
        data = log.read_bytes()
    assert 'exit code 0' in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
    note = "note: 5 line(s) of the output before this one are not in this file (it could not be appended to)"
    late = [f"late line {i} {'x' * 300}" for i in range(3)]
    assert data.decode().split('\n') == ['the replacing log', note] + late + [''], data[-600:]
    said = [l for l in p.stdout.splitlines() if str(log) in l]
    assert len(said) == 2 and 'No space left on device' in said[0] and '5 line(s)' in said[1], p.stdout[-3000:]


# A child whose lines never fit: the disk stays full to its end
END_DRIVER = r'''
import sys
log = sys.argv[1]
sys.argv = ['study.py']
import study
child = "for i in range(3): print('line', i, 'x' * 300)"
print('exit code', study.run_process(['-c', child], log, display='the child')[0])
'''


def test_lines_still_missing_when_the_child_ends_are_counted_on_the_terminal(tmp_path):
    disk = tmp_path / 'disk'
    log = disk / 'train.log'
    with small_disk(disk, '1m'):
        page = os.statvfs(disk).f_bsize
        earlier = b'#' * (2 * page - 151) + b'\n'
        log.write_bytes(earlier)
        fill_up(disk)
        p = run(['-c', END_DRIVER, str(log)])
        data = log.read_bytes()
    assert 'exit code 0' in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
    assert data.startswith(earlier) and data[len(earlier):].decode().split('\n')[2:] == [''], data[-400:]  # header
    said = [l for l in p.stdout.splitlines() if str(log) in l]
    assert len(said) == 2 and 'No space left on device' in said[0], p.stdout[-3000:]
    assert '3 line(s)' in said[1], p.stdout[-3000:]


# The child's own train.log (configurator's Tee, as train.py's rank 0 writes it), on a disk full to its end
TEE_DRIVER = r'''
import sys
log = sys.argv[1]
sys.argv = ['the script']
from configurator import Tee
Tee.install()
Tee.log_to(log)
for i in range(3):
    print('line', i, 'x' * 300)
'''


def test_lines_of_a_tee_s_log_still_missing_at_the_process_s_end_are_counted_on_stderr(tmp_path):
    disk = tmp_path / 'disk'
    log = disk / 'train.log'
    with small_disk(disk, '1m'):
        page = os.statvfs(disk).f_bsize
        log.write_bytes(b'#' * (2 * page - 151) + b'\n')  # room for the header line, not for a line
        fill_up(disk)
        p = run(['-c', TEE_DRIVER, str(log)])
    assert 'Traceback' not in p.stderr, p.stderr[-3000:]
    # print() writes a line in parts: a first part that fits is not the line fitting
    shown = [l for l in p.stdout.splitlines() if str(log) in l]
    assert len(shown) == 1 and shown[0].startswith('warning: could not append'), p.stdout
    said = [l for l in p.stderr.splitlines() if str(log) in l]
    assert len(said) == 1 and '3 line(s)' in said[0], p.stderr[-3000:]


# A line of stdout still unfinished when a line of stderr comes, and one unfinished at the end of the output
GLUE_DRIVER = r'''
import sys
log = sys.argv[1]
sys.argv = ['study.py']
import study
child = ("import sys, time\n"
         "sys.stdout.write('step 5 lo'); sys.stdout.flush(); time.sleep(0.5)\n"
         "sys.stderr.write('warning: a line of stderr\\n'); sys.stderr.flush(); time.sleep(0.5)\n"
         "print('ss 0.5')\n"
         "sys.stdout.write('the last line, unfinished')\n")
print('exit code', study.run_process(['-c', child], log, display='the child')[0])
'''


def test_a_child_s_stdout_and_stderr_go_into_train_log_in_whole_lines_of_each(tmp_path):
    log = tmp_path / 'train.log'
    p = run(['-c', GLUE_DRIVER, str(log)])
    assert 'exit code 0' in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
    lines = log.read_text().split('\n')
    assert lines[0] == '' and lines[1].endswith(': the child'), lines
    assert lines[-1] == '' and sorted(lines[2:-1]) == ['step 5 loss 0.5', 'the last line, unfinished',
                                                      'warning: a line of stderr'], lines


def test_a_child_s_stdout_and_stderr_reach_the_terminal_in_whole_lines_of_each(tmp_path):
    p = run(['-c', GLUE_DRIVER, str(tmp_path / 'train.log')])
    # both of the child's streams are echoed on study.py's stdout; its unfinished last line is ended there
    assert sorted(p.stdout.split('\n')) == ['', 'exit code 0', 'step 5 loss 0.5', 'the last line, unfinished',
                                            'warning: a line of stderr'], p.stdout + p.stderr[-3000:]


# A download's progress, rewritten in place on stderr ('\r'), unfinished while the child waits; then a line of stdout
PROGRESS_DRIVER = r"""
import os, sys, time
log, term, go = sys.argv[1:4]
os.dup2(os.open(term, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)  # study.py's terminal, read back as it goes
sys.argv = ['study.py']
import study
child = ("import os, sys, time\n"
         "sys.stderr.write('\\rfetched 1 of 2'); sys.stderr.flush()\n"
         "while not os.path.exists(sys.argv[1]): time.sleep(0.01)\n"
         "print('a line of stdout', flush=True)\n"
         "sys.stderr.write('\\rfetched 2 of 2\\n')\n")
r, t0 = study.Running(['-c', child, go], log, 'the child'), time.time()
while (got := r.pump(echo=True)) != 'eof':
    if not os.path.exists(go) and ((shown := b'fetched 1 of 2' in open(term, 'rb').read()) or time.time() - t0 > 60):
        print('progress on the terminal while the child waited:', shown, file=sys.stderr)
        open(go, 'w').close()
    elif not got:
        time.sleep(0.05)
print('exit code', r.close()[0])
"""


def test_a_progress_line_rewritten_in_place_is_on_the_terminal_as_it_goes_and_glued_to_no_line(tmp_path):
    term = tmp_path / 'terminal'
    p = run(['-c', PROGRESS_DRIVER, str(tmp_path / 'train.log'), str(term), str(tmp_path / 'go')])
    text = term.read_text()
    assert 'progress on the terminal while the child waited: True' in p.stderr, p.stderr[-3000:] + text
    shown = [row.split('\r')[-1] for row in text.split('\n')]  # what each row of the terminal ends up showing
    assert shown.count('a line of stdout') == 1 and 'fetched 2 of 2' in shown and shown[-2:] == ['exit code 0', ''] \
        and set(shown) <= {'fetched 1 of 2', 'fetched 2 of 2', 'a line of stdout', 'exit code 0', ''}, repr(text)
