"""
Memory limits: what a run may allocate is the smallest of the machine's available memory, the address space
its RLIMIT_AS leaves (prlimit --as, a shared host's ulimit -v) and its cgroup's memory limit (a container's).
Test-time views beyond it (train.py's, solve.py's) are refused in one line before anything runs, and a
MemoryError while building them is the same kind of line; a run (train.py) or a study's run (study.py) whose
estimated memory is beyond it is refused before it starts, its dataset unbuilt (check_memory=False starts it
anyway); the estimate follows the tensors a real step and evaluation hold. Real train.py, solve.py and study.py
processes on the toy task and a 4-step 4x4 Sudoku run; TRM_MEMORY_AVAILABLE and a fake cgroup tree stand in for
smaller machines.
    python -m pytest -q tests/test_limits.py
"""
import copy
import dataclasses
import os
import re
import shutil
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from conftest import FAST, ROOT, SUDOKU, TINY, assert_user_error, run, site_hook
from runkeep.memory import run_memory

LIMITED = ['-c', 'import os, resource, sys; n = int(sys.argv[1]); resource.setrlimit(resource.RLIMIT_AS, (n, n)); '
           'os.execv(sys.executable, [sys.executable] + sys.argv[2:])']  # prlimit --as=N python ...


def evaluate(trained, sudoku4, tmp_path, *extra, env=None, limit=None):
    """train.py --eval_only on a copy of the trained run (made once a test), under `limit` bytes of address space."""
    out = tmp_path / 'o'
    if not out.exists():
        shutil.copytree(trained, out)
    cmd = ['train.py', f'--data_path={sudoku4}', f'--out_dir={out}', '--init_from=resume', '--eval_only=True']
    cmd += SUDOKU + list(extra)
    return run((LIMITED + [str(limit)] if limit else []) + cmd, env=env, check=False, timeout=900)


def test_views_beyond_memory_are_refused_in_one_line_before_anything_runs(trained, sudoku4, tmp_path):
    # the machine's memory (8 GB, whatever this machine has): a run that would evaluate in 100,000 views (about
    # 24 GB), refused before its first step
    small = dict(TRM_MEMORY_AVAILABLE='8e9')
    p = run(['train.py', f'--data_path={sudoku4}', f'--out_dir={tmp_path / "new"}', '--max_steps=2',
             '--eval_views=100000'] + SUDOKU, check=False, timeout=300, env=small)
    assert_user_error(p, 'eval_views=100000', 'at most', 'memory', 'GB', one_line=True)
    assert all(l.startswith('config: ') for l in p.stdout.splitlines()), p.stdout  # the flags echoed, nothing more
    assert not os.path.exists(tmp_path / 'new' / 'ckpt_00000002.pt')
    # and solve.py's views, refused before it solves anything
    p = run(['solve.py', f'--init_from={trained}/ckpt_00000004.pt', '--index=0', '--eval_views=10000000',
             '--device=cpu'], check=False, timeout=300, env=small)
    assert_user_error(p, 'views=10000000', 'at most')
    last = (p.stdout + p.stderr).strip().splitlines()[-1]  # after the line describing the checkpoint
    assert 'memory' in last and 'views=10000000' in last, p.stdout + p.stderr
    assert 'device cpu' not in p.stdout and 'puzzle 1' not in p.stdout
    # the address space (RLIMIT_AS): 40,000 views of 50 puzzles, about 9.5 GB by the estimate, within the
    # machine's memory (as large as need be) but not within 6 GB of address space (torch and its libraries map 4-5
    # GB of it at start-up)
    p = evaluate(trained, sudoku4, tmp_path, '--eval_views=40000', limit=6_000_000_000,
                 env=dict(TRM_MEMORY_AVAILABLE='1e13'))
    assert_user_error(p, 'config error: eval_views=40000', 'RLIMIT_AS 6.0 GB', 'views at this batch size')
    assert not os.path.exists(tmp_path / 'o' / 'evals')
    # a container's cgroup (v2) of 1 GB, 0.3 GB of it in use
    cgroup = tmp_path / 'cgroup'
    cgroup.mkdir()
    (cgroup / 'memory.max').write_text('1000000000\n')
    (cgroup / 'memory.current').write_text('300000000\n')
    (cgroup / 'memory.stat').write_text('anon 200000000\ninactive_file 100000000\n')
    p = evaluate(trained, sudoku4, tmp_path, '--eval_views=8000', env=dict(TRM_CGROUP_ROOT=str(cgroup)))
    assert_user_error(p, 'config error: eval_views=8000', "the cgroup's memory.max 1.0 GB less the 0.2 GB")
    assert not os.path.exists(tmp_path / 'o' / 'evals')


def test_a_memory_error_while_building_the_views_is_one_line(trained, sudoku4, tmp_path):
    # the estimate said yes, then the memory went elsewhere (another process took it meanwhile): the allocation
    # of the views fails, as numpy's does, in every process of the run (a sitecustomize.py on PYTHONPATH)
    hook = site_hook(tmp_path / 'hook', f'''import puzzles


def views(self, K, B, seed, batch):
    raise MemoryError(f"Unable to allocate 1.00 GiB for an array with shape ({{K * B}}, {{self.L}}) and data type int64")


puzzles.Grid.views = views
''')
    p = evaluate(trained, sudoku4, tmp_path, '--eval_views=4', env=hook)
    assert_user_error(p, 'eval_views=4', 'ran out of memory', 'Unable to allocate 1.00 GiB', 'lower eval_views')
    assert len([l for l in p.stderr.splitlines() if l.strip()]) == 1, p.stderr


# -----------------------------------------------------------------------------
# a run its memory cannot hold is refused before it starts (train.py and study.py)

def test_a_run_this_machine_cannot_hold_is_refused_before_it_starts(toy, tmp_path):
    # a machine of 50 MB (TRM_MEMORY_AVAILABLE stands in for MemAvailable): the toy run needs about 0.3 GB at
    # batch 500
    cmd = ['train.py', f'--data_path={toy}', f'--out_dir={tmp_path}/o'] + FAST + ['--max_steps=2',
                                                                                  '--global_batch_size=500']
    p = run(cmd, env=dict(TRM_MEMORY_AVAILABLE='5e7'), check=False)
    assert_user_error(p, 'start-up checks failed: this run needs about', "a step's activations",
                      'more than the 50 MB available on this machine (MemAvailable)', 'lower global_batch_size',
                      '--check_memory=False')
    assert not os.path.exists(tmp_path / 'o')  # nothing started
    p = run(cmd + ['--check_memory=False'], env=dict(TRM_MEMORY_AVAILABLE='5e7'))  # the override
    assert os.path.exists(tmp_path / 'o' / 'results.json') and 'needs about' not in p.stdout + p.stderr


def test_a_bench_this_machine_cannot_hold_is_refused_before_it_starts(toy):
    # bench.py takes train.py's keys, check_memory among them, and its batch is as large as any run's: a machine
    # of 5 MB refuses the toy model's batch of 50 (about 80 MB) before a step, unless check_memory=False
    cmd = ['bench.py', f'--data_path={toy}', '--device=cpu', '--global_batch_size=50', '--hidden_size=32',
           '--num_heads=2', '--H_cycles=2', '--L_cycles=2', '--halt_max_steps=3', '--steps=1', '--warmup_steps=1',
           '--eval_batches=1', '--forward_dtype=float32', '--loss_dtype=float32', '--puzzle_emb_ndim=0']
    p = run(cmd, env=dict(TRM_MEMORY_AVAILABLE='5e6'), check=False)
    assert_user_error(p, 'this bench needs about', "a step's activations", 'an evaluation batch',
                      'more than the 5 MB available on this machine (MemAvailable)', 'lower global_batch_size',
                      '--check_memory=False', one_line=True)
    assert 'train:' not in p.stdout  # no step ran
    p = run(cmd + ['--check_memory=False'], env=dict(TRM_MEMORY_AVAILABLE='5e6'))  # the override
    assert 'bench: device=cpu' in p.stdout and 'needs about' not in p.stdout + p.stderr


def test_a_bench_whose_puzzle_embedding_update_this_machine_cannot_hold_is_refused_before_it_starts():
    # the timed sign-SGD update compares its ids pairwise: 10^6 ids ask 9 TB, said in one line, not a traceback
    p = run(['bench.py', '--device=cpu', '--global_batch_size=4', '--hidden_size=16', '--num_heads=1',
             '--puzzle_emb_ndim=16', '--H_cycles=1', '--L_cycles=1', '--halt_max_steps=2', '--steps=1',
             '--warmup_steps=1', '--eval_batches=0', '--forward_dtype=float32', '--emb_update_batch=1000000'],
            check=False)
    assert_user_error(p, 'this bench needs about', "bench.py's timed puzzle-embedding update", one_line=True)


def test_a_bench_of_the_checkpoint_alone_is_not_refused_for_a_step_it_never_runs(tmp_path):
    # --steps=0 --checkpoint_dir saves the model, its moments and the carry, and runs no step: a step's
    # activations at batch 500 (about 2 GB) do not count against a machine of 1 GB, the checkpoint's state does
    cmd = ['bench.py', '--device=cpu', '--global_batch_size=500', '--hidden_size=32', '--num_heads=2',
           '--H_cycles=2', '--L_cycles=2', '--halt_max_steps=3', '--steps=0', '--eval_batches=0',
           '--forward_dtype=float32', '--loss_dtype=float32', '--puzzle_emb_ndim=0',
           f'--checkpoint_dir={tmp_path}/ck']
    p = run(cmd, env=dict(TRM_MEMORY_AVAILABLE='1e9'), check=False)
    assert p.returncode == 0 and 'needs about' not in p.stdout + p.stderr, p.stdout + p.stderr
    assert 'bench: checkpoint_mb=' in p.stdout and os.path.exists(tmp_path / 'ck' / 'ckpt_bench.pt')
    p = run(cmd, env=dict(TRM_MEMORY_AVAILABLE='5e6'), check=False)  # the checkpoint's own state is still checked
    assert_user_error(p, 'this bench needs about', 'ACT carry', 'more than the 5 MB available', one_line=True)
    assert "a step's activations" not in p.stderr


def test_a_run_beyond_its_address_space_limit_is_refused_before_it_allocates(toy, tmp_path):
    # a real limit: 5.5 GB of address space, 4-5 GB of which torch and its libraries map at start-up; the toy
    # model at batch 20,000 would need several GB for a step
    cmd = ['train.py', f'--data_path={toy}', f'--out_dir={tmp_path}/o'] + FAST + ['--max_steps=2', '--epochs=100',
                                                                                  '--global_batch_size=20000']
    p = run(LIMITED + ['5500000000'] + cmd, check=False)
    assert_user_error(p, 'start-up checks failed: this run needs about', 'RLIMIT_AS 5.5 GB',
                      '--check_memory=False')
    assert len([l for l in p.stderr.splitlines() if l.strip()]) == 1, p.stderr


def toy_need(toy, batch, processes=1, **keys):
    """The estimate the start-up check makes of the toy run (FAST, `keys` overridden) at `batch`: memory.need of
    config_memory (one of `processes` ranks')."""
    from configurator import parse_flags, read_config_block
    from data import load_metadata
    from runkeep.memory import config_memory, need
    defaults = {k: v for k, (v, _) in read_config_block(os.path.join(ROOT, 'train.py')).items()}
    cfg = dict(defaults, **dict(parse_flags(' '.join(FAST), defaults, 'FAST'), global_batch_size=batch, **keys))
    return need(config_memory(cfg, load_metadata(toy, 'train'), 'cpu', processes))


def held_back(probe_cmd, env):
    """What the start-up check holds back under an address-space limit (the process itself, torch): it refuses
    the far larger run `probe_cmd` under an 8 GB limit, naming what the limit leaves it."""
    probe = 8_000_000_000
    p = run(LIMITED + [str(probe)] + probe_cmd, env=env, check=False)
    m = re.search(r"more than the ([\d.]+) (GB|MB) left by this process's address-space limit", p.stderr)
    assert m, p.stderr[-3000:]
    return probe - float(m[1]) * (1e9 if m[2] == 'GB' else 1e6)


def test_a_run_the_check_passes_under_an_address_space_limit_runs_and_one_beyond_it_fails_in_one_line(toy,
                                                                                                      tmp_path):
    # MemAvailable and the cgroup set aside: the address-space limit is what bounds these runs
    env = dict(TRM_MEMORY_AVAILABLE='1e13', TRM_CGROUP_ROOT=str(tmp_path / 'no-cgroup'))
    cmd = lambda out, batch: ['train.py', f'--data_path={toy}', f'--out_dir={tmp_path / out}'] + FAST + [
        '--max_steps=2', '--epochs=100', f'--global_batch_size={batch}']
    held = held_back(cmd('probe', 100_000), env)
    # a limit that leaves the check 0.5 GB, and a run it estimates at 90% of that: it must run to its end
    limit, batch = int(held + 0.5e9), 50
    while toy_need(toy, batch + 50) <= 0.9 * 0.5e9:
        batch += 50
    p = run(LIMITED + [str(limit)] + cmd('o', batch), env=env, check=False)
    assert p.returncode == 0 and 'Traceback' not in p.stderr, (batch, p.stderr[-3000:])
    assert os.path.exists(tmp_path / 'o' / 'results.json')
    # four times that batch, the check overridden: the allocation that fails is one line, not a traceback
    p = run(LIMITED + [str(limit)] + cmd('x', 4 * batch) + ['--check_memory=False'], env=env, check=False)
    assert_user_error(p, 'out of memory in the first step', 'lower global_batch_size', '--init_from=resume')
    assert len([l for l in p.stderr.splitlines() if l.strip()]) == 1, p.stderr


def test_a_run_the_check_passes_with_a_large_evaluation_batch_completes_its_first_evaluation(toy, tmp_path):
    # the first evaluation comes after training, whose freed memory the allocator keeps mapped (glibc's heap):
    # under RLIMIT_AS an evaluation batch (here 8 training batches) must fit beside the step's, not in its place.
    # The grid is fine (steps of 10, up to 95% of what the check leaves): a coarser one lands below the gap.
    env = dict(TRM_MEMORY_AVAILABLE='1e13', TRM_CGROUP_ROOT=str(tmp_path / 'no-cgroup'))
    cmd = lambda out, batch: ['train.py', f'--data_path={toy}', f'--out_dir={tmp_path / out}'] + FAST + [
        '--max_steps=2', '--epochs=100', f'--global_batch_size={batch}', f'--eval_batch_size={8 * batch}']
    limit, batch = int(held_back(cmd('probe', 100_000), env) + 0.8e9), 50
    while toy_need(toy, batch + 10, eval_batch_size=8 * (batch + 10)) <= 0.95 * 0.8e9:
        batch += 10
    p = run(LIMITED + [str(limit)] + cmd('o', batch), env=env, check=False)
    assert p.returncode == 0 and 'out of memory' not in p.stderr, (batch, p.stderr[-3000:])
    assert os.path.exists(tmp_path / 'o' / 'results.json')


def test_ranks_under_an_address_space_limit_are_each_checked_against_their_own(toy, tmp_path):
    # RLIMIT_AS bounds each process's address space: two ranks that each fit it run (MemAvailable, the cgroup
    # set aside; they alone are shared by a host's ranks)
    env = dict(TRM_MEMORY_AVAILABLE='1e13', TRM_CGROUP_ROOT=str(tmp_path / 'no-cgroup'))
    torchrun = lambda limit, out, batch: run(
        LIMITED + [str(limit), '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', 'train.py',
                   f'--data_path={toy}', f'--out_dir={tmp_path / out}'] + FAST
        + ['--max_steps=2', '--epochs=100', f'--global_batch_size={batch}'], env=env, check=False, timeout=300)
    probe = 8_000_000_000  # what a rank's check leaves under a limit: refused far beyond it, it names it
    m = re.search(r"more than the ([\d.]+) (GB|MB) left by this process's address-space limit",
                  torchrun(probe, 'probe', 100_000).stderr)
    assert m
    held = probe - float(m[1]) * (1e9 if m[2] == 'GB' else 1e6)
    # a limit that leaves each rank 0.6 GB, and ranks it estimates at 0.5-0.7 of that each: they run
    limit, batch = int(held + 0.6e9), 50
    while toy_need(toy, batch + 50, processes=2) <= 0.7 * 0.6e9:
        batch += 50
    p = torchrun(limit, 'o', batch)
    assert p.returncode == 0 and os.path.exists(tmp_path / 'o' / 'results.json'), (batch, p.stderr[-3000:])
    # twice that batch: each rank beyond it, refused in its limit's words
    p = torchrun(limit, 'x', 2 * batch)
    assert 'this run needs about' in p.stderr and 'of memory in each of its 2 processes' in p.stderr, p.stderr[-3000:]
    assert "left by this process's address-space limit (RLIMIT_AS" in p.stderr and not os.path.exists(tmp_path / 'x')


SCRIPTS = [['train.py', '--data_path=data/none', '--out_dir=out/none'], ['bench.py'], ['study.py'],
           ['solve.py', '--init_from=out/none.pt'], ['publish.py', '--init_from=README.md']]


@pytest.mark.parametrize('script', SCRIPTS, ids=[s[0] for s in SCRIPTS])
def test_torch_that_cannot_load_within_the_address_space_limit_is_one_line(script):
    # a limit below what `import torch` maps on this machine (its libraries fail to load part-way)
    mapped = int(run(['-c', 'import re, torch; print(re.search(r"VmSize:\\s+(\\d+)", '
                            'open("/proc/self/status").read())[1])']).stdout) * 1024
    for limit in (int(0.3 * mapped), int(0.7 * mapped)):
        p = run(LIMITED + [str(limit)] + script, check=False)
        assert_user_error(p, 'cannot load torch within', f'RLIMIT_AS {limit / 1e9:.1f} GB', 'ulimit -v')
        assert len([l for l in p.stderr.splitlines() if l.strip()]) == 1, (limit, p.stderr[-3000:])


def test_a_study_does_not_build_or_start_a_run_this_machine_cannot_hold(tmp_path):
    tmp = str(tmp_path)
    (tmp_path / 'cfg').mkdir()
    shutil.copy(os.path.join(ROOT, 'config', 'study', 'rec_L2.py'), tmp_path / 'cfg')
    study = ['study.py', '--pattern=rec_L2', '--scale=cpu', f'--config_dir={tmp}/cfg', f'--out_root={tmp}/out',
             f'--data_root={tmp}/data', '--extra=--max_steps=4 --log_interval=2']
    p = run(study, env=dict(TRM_MEMORY_AVAILABLE='1e8'), check=False)  # a machine of 100 MB
    text = p.stdout + p.stderr
    assert p.returncode == 1 and 'Traceback' not in text, text[-3000:]
    refused = [l for l in p.stdout.splitlines() if l.startswith('study: rec_L2: not run')]
    assert len(refused) == 1 and 'its train.py (4 steps at batch 32) needs about' in refused[0], p.stdout[-3000:]
    assert 'the process itself (Python, torch)' in refused[0] and '--check_memory=False (study.py)' in refused[0]
    assert re.search(r'rec_L2 +NOT RUN', p.stdout) and not os.path.exists(f'{tmp}/data'), p.stdout[-3000:]
    p = run(study + ['--check_memory=False'], env=dict(TRM_MEMORY_AVAILABLE='1e8'))  # and train.py's own check
    assert '--check_memory=False --init_from=resume' in p.stdout and re.search(r'rec_L2 +done', p.stdout)


# -----------------------------------------------------------------------------
# the estimate against the tensors a real step keeps

class LiveBytes(TorchDispatchMode):
    """The peak of the bytes held by tensors made inside it (each storage counted once, until freed)."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak = weakref.WeakKeyDictionary(), 0, 0

    def free(self, n):
        self.now -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage() not in self.live:
                storage = t.untyped_storage()
                self.live[storage] = n = storage.nbytes()
                self.now += n
                self.peak = max(self.peak, self.now)
                weakref.finalize(storage, self.free, n)
        return out


@pytest.mark.parametrize('over', [dict(mlp_t=False), dict(mlp_t=True),
                                  dict(mlp_t=False, pos_encodings='rope', puzzle_emb_ndim=32),
                                  dict(mlp_t=False, forward_dtype='bfloat16', loss_dtype='float64',
                                       pos_encodings='learned')])
def test_the_estimate_follows_what_a_real_step_and_evaluation_hold(over):
    from model import TRM, TRMConfig
    from step import AdamATan2, StepConfig, train_step
    cfg = TRMConfig(**dict(TINY, vocab_size=6, seq_len=24, hidden_size=64, num_heads=2, **over))
    B, S = 64, 6
    torch.manual_seed(0)
    model = TRM(cfg)
    opt = AdamATan2(model.parameters(), lr=1e-3)
    ema = copy.deepcopy(model, {id(model.puzzle_emb): model.puzzle_emb})
    batch = dict(inputs=torch.randint(2, 6, (B, cfg.seq_len), dtype=torch.int32),
                 labels=torch.randint(2, 6, (B, cfg.seq_len), dtype=torch.int32),
                 puzzle_identifiers=torch.zeros(B, dtype=torch.int32))
    carry = model.initial_carry(batch)
    sc = StepConfig(lr=1e-3, puzzle_emb_lr=1e-2, puzzle_emb_weight_decay=0.1, warmup_steps=1, total_steps=9,
                    min_ratio=1.0, global_batch_size=B, ema_rate=0.9)
    carry = train_step(model, opt, list(ema.parameters()), carry, batch, torch.zeros(()), sc)[0]  # moments made
    with LiveBytes() as step:
        train_step(model, opt, list(ema.parameters()), carry, batch, torch.zeros(()), sc)
    with LiveBytes() as evaluation:
        model.eval()
        model.predict(batch, S, loss_at=cfg.halt_max_steps - 1)
    parts = run_memory(dict(dataclasses.asdict(cfg), total_len=cfg.total_len), B, B, S)
    assert parts['weights'] == 4 * model.num_params()
    assert 0.95 < (parts['gradients'] + parts['activations']) / step.peak < 1.15, (parts, step.peak)
    assert 0.85 < parts['evaluation'] / evaluation.peak < 1.15, (parts, evaluation.peak)
