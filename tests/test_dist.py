"""
Several ranks fail together and never hang: torchrun with gloo on the CPU runs the same loop as a TPU pod
(the XLA path's graph symmetry is tests/test_pod.py). A wrapper stands in for what differs between the hosts
of a pod (a file present on one host only, a rank whose disk is full, another config on one host).
    python -m pytest -q tests/test_dist.py
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import torch

from conftest import ROOT, TOY_ARGS, free_port, make_reverse_dataset, our_frames, run, script_env, site_hook
from data import write_split

FAST = TOY_ARGS + ['--epochs=2', '--eval_every_epochs=100', '--log_interval=4', '--global_batch_size=48']


def torchrun(n, script_args, env=None, wrapper=None, timeout=300):
    """`torchrun --nproc_per_node=n train.py ...`; with `wrapper` (Python run first in each rank, it sees RANK)
    the ranks run train.py through runpy after it."""
    args = ['-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={n}']
    if wrapper:
        path = os.path.join(tempfile.gettempdir(), f'wrap_{os.getpid()}_{abs(hash(wrapper))}.py')
        with open(path, 'w') as f:
            f.write(f"import os, runpy, sys\nsys.path.insert(0, {ROOT!r})\n" + wrapper +
                    f"\nsys.argv = ['train.py'] + sys.argv[1:]\nrunpy.run_path({os.path.join(ROOT, 'train.py')!r}, "
                    f"run_name='__main__')\n")
        args.append(path)
    else:
        args.append('train.py')
    return run(args + script_args, env=env, check=False, timeout=timeout)


def assert_all_ranks_stopped_with(p, *words, ranks=2):
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-3000:]
    # torchrun prints a traceback of its own when a rank exits non-zero; ours must print none
    assert not our_frames(out), out[-3000:]
    assert 'terminate called' not in out and 'SIGABRT' not in out, out[-3000:]  # the ranks left together
    for w in words:
        assert w in out, (w, out[-3000:])


def test_a_file_only_one_host_has_stops_every_rank_at_start(toy, tmp_path):
    ck = tmp_path / 'w.pt'
    run(['train.py', f'--data_path={toy}', f'--out_dir={tmp_path}/a', '--max_steps=4', '--checkpoint_interval=4']
        + FAST)
    os.replace(tmp_path / 'a' / 'ckpt_00000004.pt', ck)
    other = tmp_path / 'elsewhere'
    other.mkdir()
    # init_from is relative: rank 1 runs from a folder that lacks it, as a host without the file would
    wrapper = f"os.chdir({str(other)!r} if os.environ['RANK'] == '1' else {str(tmp_path)!r})"
    p = torchrun(2, [f'--data_path={toy}', f'--out_dir={tmp_path}/b', '--init_from=w.pt', '--max_steps=8'] + FAST,
                 wrapper=wrapper)
    assert_all_ranks_stopped_with(p, 'start-up checks failed on rank(s) [1]', 'init_from=w.pt: no such file on this host')
    assert p.stdout.count('start-up checks failed on rank(s) [1]') + p.stderr.count('start-up checks failed on rank(s) [1]') == 2


def test_a_host_whose_rank_ends_before_joining_ends_the_other_hosts_ranks_with_its_line(toy, tmp_path):
    # two torchruns as two hosts of one rank each (node 0's holds the store); host 1's command has a bad value, so
    # its rank ends before joining: host 0's, which waited for it until the process group's timeout, ends now
    port, args = free_port(), [f'--data_path={toy}', f'--out_dir={tmp_path}/o', '--max_steps=4'] + FAST
    hosts = [subprocess.Popen([sys.executable, '-m', 'torch.distributed.run', '--nnodes=2', f'--node_rank={i}',
                               '--nproc_per_node=1', '--master_addr=127.0.0.1', f'--master_port={port}', 'train.py']
                              + args + ['--lr=abc'] * i, cwd=ROOT, env=script_env(), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i in (0, 1)]
    try:
        outs = [h.communicate(timeout=150)[0] for h in hosts]  # a bound against hanging, far above the wait
    finally:
        for h in hosts:  # torchrun ends its rank at a SIGTERM
            if h.poll() is None:
                h.terminate()
                h.communicate(timeout=60)
    said = "config error: lr='abc' in --lr=abc is a str"
    assert hosts[1].returncode != 0 and said in outs[1], outs[1][-3000:]
    lines = [l for l in outs[0].splitlines() if 'ended before joining' in l]
    assert len(lines) == 1 and lines[0].startswith('rank 1 (host ') and said in lines[0], outs[0][-3000:]
    assert hosts[0].returncode != 0 and not our_frames(outs[0]), outs[0][-3000:]


def test_a_failed_save_on_rank_0_stops_every_rank_with_its_message(toy, tmp_path):
    wrapper = ("import resource, signal\nif os.environ['RANK'] == '0':\n"
               "    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
               "    resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))\n")
    p = torchrun(2, [f'--data_path={toy}', f'--out_dir={tmp_path}/o', '--max_steps=8', '--checkpoint_interval=4']
                 + FAST, wrapper=wrapper)
    assert_all_ranks_stopped_with(p, 'checkpoint at step 4 failed on rank(s) [0]', 'File too large')


def test_a_rank_killed_mid_run_ends_the_other_in_one_line_naming_the_checkpoint_to_resume(toy, tmp_path):
    # rank 1 dies as the kernel's OOM killer or a lost host ends it: rank 0's all-reduce in step 12 breaks
    wrapper = ("import signal, step\nreal, calls = step.train_step, [0]\n"
               "def train_step(*a, **k):\n    calls[0] += 1\n"
               "    if calls[0] == 12 and os.environ['RANK'] == '1':\n        os.kill(os.getpid(), signal.SIGKILL)\n"
               "    return real(*a, **k)\nstep.train_step = train_step\n")
    args = [f'--data_path={toy}', f'--out_dir={tmp_path}/o', '--checkpoint_interval=10'] + FAST
    p = torchrun(2, args + ['--max_steps=40'], wrapper=wrapper)
    kept = f'the last checkpoint kept: {tmp_path}/o/ckpt_00000010.pt'
    assert_all_ranks_stopped_with(p, 'another rank or host ended', kept)
    said = [l for l in (p.stdout + p.stderr).splitlines() if kept in l]
    assert len(said) == 1 and '--init_from=resume' in said[0], said
    p = run(['train.py', '--init_from=resume', '--max_steps=12'] + args)
    assert f'resuming from {tmp_path}/o/ckpt_00000010.pt' in p.stdout and 'step 12/12' in p.stdout, p.stdout[-3000:]


def test_a_rank_killed_during_start_up_ends_the_other_in_one_line_naming_the_checkpoint_to_resume(toy, tmp_path):
    # rank 1 dies while it loads the checkpoint to resume, before any step: rank 0's next start-up agreement breaks
    args = [f'--data_path={toy}', f'--out_dir={tmp_path}/o', '--checkpoint_interval=4'] + FAST
    run(['train.py', '--max_steps=4'] + args)
    wrapper = ("import signal\nimport runkeep.run\nreal = runkeep.run.load_state\n"
               "def load_state(*a, **k):\n    if os.environ['RANK'] == '1':\n"
               "        os.kill(os.getpid(), signal.SIGKILL)\n    return real(*a, **k)\n"
               "runkeep.run.load_state = load_state\n")
    p = torchrun(2, args + ['--init_from=resume', '--max_steps=8'], wrapper=wrapper)
    kept = f'the last checkpoint kept: {tmp_path}/o/ckpt_00000004.pt'
    assert_all_ranks_stopped_with(p, 'another rank or host ended', kept)
    said = [l for l in (p.stdout + p.stderr).splitlines() if kept in l]
    assert len(said) == 1 and 'start-up' in said[0] and '--init_from=resume' in said[0], said
    p = torchrun(2, args + ['--init_from=resume', '--max_steps=8'])
    assert p.returncode == 0 and f'resuming from {tmp_path}/o/ckpt_00000004.pt' in p.stdout, p.stderr[-3000:]
    assert 'step 8/8' in p.stdout, p.stdout[-3000:]


def test_hosts_with_different_configs_are_refused_at_start(toy, tmp_path):
    wrapper = "if os.environ['RANK'] == '1':\n    sys.argv.append('--lr=0.001')\n"
    p = torchrun(2, [f'--data_path={toy}', f'--out_dir={tmp_path}/o', '--max_steps=4'] + FAST, wrapper=wrapper)
    assert_all_ranks_stopped_with(p, 'the hosts differ in their config')


def test_hosts_with_different_data_of_the_same_shape_are_refused_at_start(tmp_path):
    # two builds of one task with another seed: the same dataset.json, other examples (a host rebuilt its copy)
    for host, seed in (('a', 0), ('b', 1)):
        make_reverse_dataset(str(tmp_path / host / 'd'), seed=seed)
    wrapper = f"os.chdir({str(tmp_path)!r} + ('/b' if os.environ['RANK'] == '1' else '/a'))"
    p = torchrun(2, ['--data_path=d', f'--out_dir={tmp_path}/o', '--max_steps=4'] + FAST, wrapper=wrapper)
    assert_all_ranks_stopped_with(p, 'the hosts differ in their dataset contents')
    assert 'step 1/' not in p.stdout


def test_batch_sizes_not_divisible_by_the_world_are_refused_before_the_first_step(toy, tmp_path):
    # each rank's writes to stderr recorded: the ranks share it, so a line written in two parts can take in
    # another rank's line between them
    wrapper = ("import io, json\nclass Writes(io.RawIOBase):\n    def writable(self):\n        return True\n"
               "    def write(self, b):\n"
               f"        with open({str(tmp_path)!r} + '/writes_' + os.environ['RANK'], 'a') as f:\n"
               "            f.write(json.dumps(bytes(b).decode()) + '\\n')\n"
               "        return os.write(2, b)\n"
               "sys.stderr = io.TextIOWrapper(Writes(), write_through=True)\n")
    p = torchrun(3, [f'--data_path={toy}', f'--out_dir={tmp_path}/o', '--max_steps=4'] + FAST
                 + ['--global_batch_size=50', '--eval_batch_size=32'], wrapper=wrapper)
    for rank in range(3):
        with open(tmp_path / f'writes_{rank}') as f:
            writes = [json.loads(line) for line in f]
        said = [w for w in writes if 'start-up checks failed' in w]
        assert len(said) == 1 and said[0].startswith('start-up checks') and said[0].endswith('size 3\n'), writes
    assert_all_ranks_stopped_with(p, 'eval_batch_size=32 is not divisible by the world size 3',
                                  'global_batch_size=50 is not divisible by the world size 3')
    assert 'step 1/' not in p.stdout
    said = [l for l in (p.stdout + p.stderr).splitlines() if 'start-up checks failed' in l]
    assert said and all(l.count('global_batch_size=50') == 1 and 'gradient_accumulation' not in l for l in said), said


def test_evaluation_is_the_same_at_world_sizes_1_2_and_3(tmp_path):
    rng = np.random.default_rng(0)
    root = str(tmp_path / 'd')
    for split, n in (('train', 600), ('test', 37)):  # 37: no world size of 2 or 3 divides it, nor the batch of 6
        x = rng.integers(2, 6, (n, 8))
        write_split(root, split, x, x[:, ::-1], np.zeros(n), np.arange(n + 1), np.arange(n + 1), vocab_size=6)
    run(['train.py', f'--data_path={root}', f'--out_dir={tmp_path}/a'] + FAST)  # 25 steps
    ck = f'{tmp_path}/a/ckpt_00000025.pt'
    lines = []
    for n in (1, 2, 3):
        p = torchrun(n, [f'--data_path={root}', f'--out_dir={tmp_path}/e{n}', f'--init_from={ck}', '--eval_only=True',
                         '--eval_batch_size=6'] + FAST)
        assert p.returncode == 0, p.stderr[-3000:]  # rank 0 once exited first here, and rank 1 aborted
        lines.append(next(l for l in p.stdout.splitlines() if l.startswith('eval on')))
    assert lines[0].startswith('eval on 37:') and lines[0] == lines[1] == lines[2], lines


def test_two_ranks_log_the_loss_and_the_gradient_norm_of_one(toy, tmp_path):
    """The same global batch split over 2 ranks is one step: the log's loss and grad_norm are one process's (every
    rank holds the all-reduced gradient, so its norm is not summed over ranks as the loss sums are)."""
    args = [f'--data_path={toy}', '--max_steps=8', '--halt_exploration_prob=0.0'] + FAST
    run(['train.py', f'--out_dir={tmp_path}/one'] + args)
    p = torchrun(2, [f'--out_dir={tmp_path}/two'] + args)
    assert p.returncode == 0, p.stderr[-3000:]
    logs = [[json.loads(l) for l in open(tmp_path / d / 'metrics.jsonl') if '"kind": "train"' in l]
            for d in ('one', 'two')]
    assert [l['step'] for l in logs[0]] == [l['step'] for l in logs[1]] == [4, 8]
    for a, b in zip(*logs):
        assert a['loss'] == pytest.approx(b['loss'], rel=1e-4)
        assert a['grad_norm'] == pytest.approx(b['grad_norm'], rel=1e-3), (a['grad_norm'], b['grad_norm'])
    # resumed in one process: the run's device-hours count each process's time by its own world size
    first = sum(torch.load(tmp_path / 'two' / 'ckpt_00000008.pt', weights_only=False)['timing'].values())
    run(['train.py', f'--out_dir={tmp_path}/two', '--init_from=resume'] + args + ['--max_steps=12'])
    res = json.load(open(tmp_path / 'two' / 'results.json'))
    later = res['wall_s']['total'] - first
    assert res['world_size'] == 1 and later > 0
    assert res['device_hours'] * 3600 == pytest.approx(2 * first + later, rel=1e-9), (res['device_hours'], first)


def test_a_resumed_torchrun_run_trains_on_as_the_uninterrupted_one_did(toy, tmp_path):
    """Bit for bit on the CPU, ACT exploration included: every rank's random stream is saved and restored (rows
    halt from the first steps with no_ACT_continue=False, so each rank's exploration draws decide which: in the
    reference's widths, --mlp_multiple=256; the toy's narrower SwiGLUs halt none in 16 steps)."""
    args = [f'--data_path={toy}', '--max_steps=16', '--checkpoint_interval=8', '--no_ACT_continue=False'] + FAST \
        + ['--log_interval=1', '--mlp_multiple=256']
    p = torchrun(2, [f'--out_dir={tmp_path}/straight'] + args)
    assert p.returncode == 0, p.stderr[-3000:]
    os.makedirs(tmp_path / 'resumed')
    os.replace(tmp_path / 'straight' / 'ckpt_00000008.pt', tmp_path / 'resumed' / 'ckpt_00000008.pt')
    p = torchrun(2, [f'--out_dir={tmp_path}/resumed', '--init_from=resume'] + args)
    assert p.returncode == 0, p.stderr[-3000:]
    keys = ('step', 'loss', 'steps', 'accuracy', 'grad_norm')
    logs = [[tuple(l.get(k) for k in keys) for l in map(json.loads, open(tmp_path / d / 'metrics.jsonl'))
             if l['kind'] == 'train' and l['step'] > 8] for d in ('straight', 'resumed')]
    assert len(logs[0]) == 8 and any((l[2] or 4) < 4 for l in logs[0]), logs[0]  # rows halted early
    assert logs[0] == logs[1]


# (the W&B code runs on rank 0 alone, the same at any world size: three of the four pairs keep the suite short,
# since wandb's own service takes a core for tens of seconds on this 2-core machine)
@pytest.mark.parametrize('how,ranks', [('not logged in', 1), ('not logged in', 2), ('server unreachable', 1)])
def test_wandb_trouble_never_stops_a_run(toy, tmp_path, ranks, how):
    home = tmp_path / 'home'
    home.mkdir()
    env = dict(HOME=str(home), WANDB_MODE=None, WANDB_CONFIG_DIR=str(home / '.config'), WANDB_SILENT='true')
    if how == 'server unreachable':  # logged in as `wandb login` leaves it: the server's key in ~/.netrc
        server = f'127.0.0.1:{free_port()}'  # a closed port
        (home / '.netrc').write_text(f"machine {server}\n  login user\n  password {'0' * 40}\n")
        (home / '.netrc').chmod(0o600)
        env.update(WANDB_BASE_URL=f'http://{server}', WANDB_SILENT=None)
    args = [f'--data_path={toy}', f'--out_dir={tmp_path}/o', '--max_steps=8', '--wandb_log=True'] + FAST
    p = torchrun(ranks, args, env=env) if ranks > 1 else run(['train.py'] + args, env=env, check=False)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert 'W&B unavailable' in out and 'wandb sync' in out
    assert how != 'not logged in' or 'W&B unavailable (not logged in' in out, out[-3000:]
    assert how == 'not logged in' or 'not logged in' not in out and 'deprecated' not in out, out[-3000:]
    assert 'step 8/8' in out and os.path.exists(tmp_path / 'o' / 'ckpt_00000008.pt')
    assert [d for d in os.listdir(tmp_path / 'o' / 'wandb') if d.startswith('offline-run-')]


@pytest.mark.parametrize('mode', ['offline', None])  # asked offline; online, not logged in (offline is the fallback)
def test_a_wandb_folder_that_cannot_be_written_is_one_warning_that_says_no_w_b(toy, tmp_path, mode):
    home = tmp_path / 'home'
    home.mkdir()
    (tmp_path / 'o').mkdir()
    (tmp_path / 'o' / 'wandb').write_text('')  # a file where W&B's folder goes
    env = dict(HOME=str(home), WANDB_MODE=mode, WANDB_CONFIG_DIR=str(home / '.config'), WANDB_SILENT='true')
    p = run(['train.py', f'--data_path={toy}', f'--out_dir={tmp_path}/o', '--max_steps=4', '--wandb_log=True']
            + FAST, env=env, check=False)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and 'step 4/4' in out, out[-3000:]
    said = [l for l in out.splitlines() if 'W&B' in l]
    assert len(said) == 1 and 'without W&B' in said[0] and 'wandb sync' not in said[0], said


# W&B's service process killed at the start of step 6 (the OOM killer, a crash of its own): a real SIGKILL
KILL_WANDB_IN_STEP_6 = """import step
real, calls = step.train_step, [0]


def train_step(*args, **kwargs):
    calls[0] += 1
    if calls[0] == 6:
        for pid in filter(str.isdigit, os.listdir('/proc')):
            with open(f'/proc/{pid}/stat') as f:
                name, rest = f.read().rsplit(')', 1)
            if name.endswith('(wandb-core') and int(rest.split()[1]) == os.getpid():
                os.kill(int(pid), signal.SIGKILL)
    return real(*args, **kwargs)


step.train_step = train_step
"""


def test_w_and_b_failing_mid_run_is_one_warning_and_the_run_goes_on(toy, tmp_path):
    env = dict(site_hook(tmp_path / 'hook', KILL_WANDB_IN_STEP_6), WANDB_MODE='offline', WANDB_SILENT='true',
               HOME=str(tmp_path))
    p = run(['train.py', f'--data_path={toy}', f'--out_dir={tmp_path}/o', '--max_steps=16', '--wandb_log=True']
            + FAST + ['--log_interval=2'], env=env, check=False)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and 'step 16/16' in out and 'Traceback' not in out, out[-3000:]
    said = [l for l in out.splitlines() if 'W&B' in l]
    assert len(said) == 1 and 'without W&B' in said[0], said
    with open(tmp_path / 'o' / 'metrics.jsonl') as f:  # the records keep every line
        assert [r['step'] for r in map(json.loads, f) if r['kind'] == 'train'] == list(range(2, 17, 2))


def test_wandb_log_without_wandb_importable_is_one_warning_and_the_run_goes_on(toy, tmp_path):
    hide = "import sys, runpy; sys.modules['wandb'] = None; sys.argv[0] = 'train.py'; runpy.run_path('train.py', " \
           "run_name='__main__')"  # as where wandb is not installed
    p = run(['-c', hide, f'--data_path={toy}', f'--out_dir={tmp_path}/o', '--max_steps=4', '--wandb_log=True']
            + FAST, env=dict(WANDB_MODE=None), check=False)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and 'step 4/4' in out and 'Traceback' not in out, out[-3000:]
    said = [l for l in out.splitlines() if 'W&B' in l]
    assert len(said) == 1 and 'pip install wandb' in said[0] and 'without W&B' in said[0], said


# -----------------------------------------------------------------------------
# a dataset in a bucket: built once, fetched by one process per host, never half used

def test_dataset_in_a_bucket_is_built_uploaded_fetched_and_trained_on(emu, tmp_path):
    from runkeep import gcs
    from conftest import BUCKET
    uri = f'gs://{BUCKET}/datasets/s4'
    run(['prepare_sudoku.py', '--generate', '200', '--size', '4', '--num_test', '20', '--num_aug', '1',
         '--output_dir', uri], env=dict(STORAGE_EMULATOR_HOST=os.environ['STORAGE_EMULATOR_HOST']), cwd=tmp_path)
    names = sorted(os.path.basename(u) for u, _ in gcs.list_objects(uri + '/'))
    assert 'all__inputs.npy' in names and 'dataset.json' in names
    cache = tmp_path / 'cache'
    p = torchrun(2, [f'--data_path={uri}', f'--data_cache_dir={cache}', f'--out_dir={tmp_path}/o', '--max_steps=4']
                 + FAST, env=dict(STORAGE_EMULATOR_HOST=os.environ['STORAGE_EMULATOR_HOST']))
    assert p.returncode == 0, p.stderr[-3000:]
    assert 'step 4/4' in p.stdout
    local = cache / BUCKET / 'datasets' / 's4'
    assert (local / '.complete').exists() and (local / 'train' / 'all__inputs.npy').exists()


def test_an_interrupted_fetch_is_redone_and_never_leaves_a_dataset_that_loads(emu, tmp_path, toy, monkeypatch):
    from runkeep import gcs
    from conftest import BUCKET
    from data import load_metadata
    uri = f'gs://{BUCKET}/datasets/toy'
    gcs.upload_tree(toy, uri)
    cache = str(tmp_path / 'cache')
    dest = os.path.join(cache, BUCKET, 'datasets', 'toy')
    real, calls = gcs.download_file, []

    def dies_on_the_third(*a):  # the process dies half way (a preemption, a lost host)
        calls.append(a)
        if len(calls) == 3:
            raise KeyboardInterrupt('killed mid-fetch')
        return real(*a)
    monkeypatch.setattr(gcs, 'download_file', dies_on_the_third)
    with pytest.raises(KeyboardInterrupt):
        gcs.fetch_tree(uri, cache)
    assert not os.path.exists(dest)  # nothing under the final name
    with pytest.raises(FileNotFoundError):
        load_metadata(dest, 'train')
    monkeypatch.setattr(gcs, 'download_file', real)
    assert gcs.fetch_tree(uri, cache) == dest
    assert load_metadata(dest, 'train')['vocab_size'] == 6


def test_a_dataset_rebuilt_in_its_bucket_is_fetched_again_and_a_cached_one_serves_when_the_bucket_is_down(
        emu, tmp_path, toy, monkeypatch):
    """A copy in the cache was used as long as it was whole: a dataset rebuilt at its gs:// path with another seed
    (the same names and sizes) was never fetched again, and every run on that host trained on the old examples."""
    from runkeep import gcs
    from runkeep.startup import sampled_rows
    from conftest import BUCKET
    uri, cache = f'gs://{BUCKET}/datasets/rebuilt', str(tmp_path / 'cache')
    gcs.upload_tree(toy, uri)
    assert sampled_rows(gcs.fetch_tree(uri, cache)) == sampled_rows(toy)
    other = make_reverse_dataset(str(tmp_path / 'other'), seed=1)
    gcs.upload_tree(other, uri)
    assert sampled_rows(gcs.fetch_tree(uri, cache)) == sampled_rows(other)
    monkeypatch.setenv('STORAGE_EMULATOR_HOST', f'127.0.0.1:{free_port()}')  # nothing answers there
    monkeypatch.setattr(gcs.default_client(), 'retries', 0)
    assert sampled_rows(gcs.fetch_tree(uri, cache)) == sampled_rows(other)  # the copy it has, said


def test_a_cached_dataset_whose_bucket_copy_is_gone_serves_said(emu, tmp_path, toy, capsys):
    """A copy in the cache served whatever the bucket held; a dataset removed from its bucket since (a clean-up)
    must not stop a run on a host that has it whole: it is used, said, as when the bucket cannot be listed."""
    from runkeep import gcs
    from runkeep.startup import sampled_rows
    from conftest import BUCKET
    uri, cache = f'gs://{BUCKET}/datasets/removed', str(tmp_path / 'cache')
    gcs.upload_tree(toy, uri)
    gcs.fetch_tree(uri, cache)
    for obj, _ in gcs.list_objects(uri + '/'):
        gcs.delete_object(obj)
    assert sampled_rows(gcs.fetch_tree(uri, cache)) == sampled_rows(toy)
    assert f'nothing under {uri}' in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match='nothing under'):  # no copy: nothing to train on
        gcs.fetch_tree(uri, str(tmp_path / 'empty'))


def test_a_rebuilt_dataset_is_fetched_over_what_a_killed_fetch_of_the_same_pid_left_aside(emu, tmp_path, toy):
    """A fetch killed while it removed the copy it had moved aside left <copy>.old.<pid>; a container restarted
    reuses its pids, and the next fetch of a rebuild failed moving the copy aside onto it (Directory not empty)."""
    from runkeep import gcs
    from runkeep.startup import sampled_rows
    from conftest import BUCKET
    uri, cache = f'gs://{BUCKET}/datasets/aside', str(tmp_path / 'cache')
    gcs.upload_tree(toy, uri)
    dest = gcs.fetch_tree(uri, cache)
    shutil.copytree(dest, f'{dest}.old.{os.getpid()}')  # half removed when the process died
    other = make_reverse_dataset(str(tmp_path / 'other'), seed=1)
    gcs.upload_tree(other, uri)
    assert sampled_rows(gcs.fetch_tree(uri, cache)) == sampled_rows(other)
    assert not os.path.exists(f'{dest}.old.{os.getpid()}')


def test_a_run_waiting_for_another_s_fetch_of_its_dataset_stops_when_asked(emu, tmp_path, toy, monkeypatch):
    """A run of this host waiting for another run's fetch of the same dataset (its flock) waited out the whole
    fetch, however long, whatever stop it was asked: a spot VM's preemption notice passed unheeded. The wait ends
    with the stop, as every bucket wait of the start does."""
    import fcntl
    import threading
    from runkeep import gcs
    from conftest import BUCKET
    uri, cache = f'gs://{BUCKET}/datasets/waits', str(tmp_path / 'cache')
    gcs.upload_tree(toy, uri)
    dest = gcs.cached_copy(uri, cache)
    os.makedirs(os.path.dirname(dest))
    stop = threading.Event()
    monkeypatch.setattr(gcs.default_client(), 'stop', stop.is_set)
    with open(f'{dest}.lock', 'a') as other:  # another run of this host, fetching
        fcntl.flock(other, fcntl.LOCK_EX)
        ended = []
        waiting = threading.Thread(target=lambda: ended.append(pytest.raises(gcs.Stopped, gcs.fetch_tree, uri, cache)))
        waiting.start()
        waiting.join(1)
        assert waiting.is_alive()  # it waits for the other's fetch
        stop.set()
        waiting.join(60)  # a guard against a hang only
        assert not waiting.is_alive() and ended and 'stop was requested' in str(ended[0].value)
    assert not os.path.exists(dest)


# two runs on one host that both found the copy in the cache older than the bucket's, each on to fetch it
BOTH_LISTED = """
if sys.argv[0].endswith('train.py'):
    from runkeep import gcs
    list_objects, here = gcs.list_objects, os.environ['LISTED']

    def listed(uri, generations=False):
        objects = list_objects(uri, generations)
        if generations:
            open(os.path.join(here, str(os.getpid())), 'w').close()
            while len(os.listdir(here)) < 2:
                time.sleep(0.01)
        return objects

    gcs.list_objects = listed
"""


def test_two_runs_on_one_host_after_a_rebuild_in_the_bucket_fetch_it_once_and_both_train(emu, tmp_path, toy):
    """The second fetch removed the copy the first had just put in place (the first then failed in the middle of
    its start, a FileNotFoundError) or found the first's copy where its own was to go (Directory not empty)."""
    from runkeep import gcs
    from runkeep.startup import sampled_rows
    from conftest import BUCKET
    uri, cache, listed = f'gs://{BUCKET}/datasets/two', str(tmp_path / 'cache'), tmp_path / 'listed'
    gcs.upload_tree(toy, uri)
    gcs.fetch_tree(uri, cache)
    other = make_reverse_dataset(str(tmp_path / 'other'), seed=1)
    gcs.upload_tree(other, uri)  # rebuilt with another seed
    listed.mkdir()
    env = dict(site_hook(tmp_path / 'hook', BOTH_LISTED), LISTED=str(listed),
               STORAGE_EMULATOR_HOST=emu.replace('http://', ''))
    runs = [subprocess.Popen([sys.executable, 'train.py', f'--data_path={uri}', f'--data_cache_dir={cache}',
                              f'--out_dir={tmp_path}/o{i}', '--max_steps=4'] + FAST, cwd=ROOT, env=script_env(env),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    said = [r.communicate(timeout=300)[0] for r in runs]
    assert [r.returncode for r in runs] == [0, 0], [s[-2000:] for s in said]
    assert sampled_rows(gcs.cached_copy(uri, cache)) == sampled_rows(other)
    left = os.listdir(os.path.dirname(gcs.cached_copy(uri, cache)))
    assert not [n for n in left if '.partial.' in n or '.old.' in n], left


# -----------------------------------------------------------------------------
# resume that is the same on every rank or refuses

def test_a_local_out_dir_is_refused_when_the_world_spans_hosts(toy, tmp_path):
    wrapper = "os.environ['LOCAL_WORLD_SIZE'] = '1'  # as on 2 hosts of 1 process each\n"
    p = torchrun(2, [f'--data_path={toy}', f'--out_dir={tmp_path}/o', '--max_steps=4'] + FAST, wrapper=wrapper)
    assert_all_ranks_stopped_with(p, 'spans 2 hosts', 'gs://')


def test_resume_refuses_an_unlistable_bucket_and_a_bucket_of_corrupt_checkpoints(emu, toy, tmp_path):
    from runkeep import gcs
    from conftest import BUCKET, free_port
    args = [f'--data_path={toy}', f'--out_dir=gs://{BUCKET}/runs/bad', f'--local_dir={tmp_path}/local',
            '--init_from=resume', '--max_steps=4', '--gcs_retries=1'] + FAST
    p = run(['train.py'] + args, env=dict(STORAGE_EMULATOR_HOST=f'127.0.0.1:{free_port()}'), check=False)
    assert p.returncode != 0 and 'cannot list the checkpoints' in p.stdout + p.stderr
    junk = tmp_path / 'junk.pt'
    junk.write_bytes(os.urandom(1000))
    gcs.upload_file(str(junk), f'gs://{BUCKET}/runs/bad/ckpt_00000004.pt')
    p = run(['train.py'] + args, env=dict(STORAGE_EMULATOR_HOST=os.environ['STORAGE_EMULATOR_HOST']), check=False)
    out = p.stdout + p.stderr
    assert p.returncode != 0 and 'none could be loaded' in out and 'ckpt_00000004.pt' in out
    assert gcs.object_exists(f'gs://{BUCKET}/runs/bad/ckpt_00000004.pt')  # kept, not overwritten
