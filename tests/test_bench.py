"""
bench.py smoke runs, as a user runs it (a subprocess), on the CPU and on CPU-XLA. Speed is printed, never
asserted: only that the summary line holds every field, the fields are numbers, and XLA stops compiling.
    python -m pytest -q tests/test_bench.py
"""
from conftest import XLA_ENV, run

BENCH_TINY = ['--global_batch_size=8', '--hidden_size=32', '--num_heads=2', '--H_cycles=2', '--L_cycles=2',
              '--halt_max_steps=3', '--steps=3', '--warmup_steps=2', '--eval_batches=1', '--forward_dtype=float32',
              '--loss_dtype=float32', '--puzzle_emb_len=1', '--puzzle_emb_ndim=32']
BENCH_FIELDS = ['batch', 'ms_per_step', 'examples_per_s', 'tokens_per_s', 'flops_per_example', 'tflops', 'warmup_s',
                'peak_mem_gib', 'eval_puzzles_per_s', 'compiles_warm', 'compiles_end', 'fallbacks']


def run_bench(args, env=None):
    """bench.py in a new process; returns its summary line as a dict (checked: every field a number) and stdout."""
    p = run(['bench.py'] + args, env=env)
    line = [l for l in p.stdout.splitlines() if l.startswith('bench: device=')][-1]
    s = dict(kv.split('=', 1) for kv in line.split()[1:])
    for k in BENCH_FIELDS:
        assert k in s and float(s[k]) >= 0, (k, line)  # present and a number
    assert float(s['ms_per_step']) > 0 and float(s['examples_per_s']) > 0 and float(s['eval_puzzles_per_s']) > 0
    assert int(s['flops_per_example']) > 0
    return s, p.stdout


def test_bench_runs_on_cpu_with_a_train_config_and_a_dataset(toy):
    # a train.py config file (keys bench.py only accepts because it takes all of train.py's) and real batches
    s, out = run_bench(['config/baseline.py', f'--data_path={toy}', '--device=cpu'] + BENCH_TINY)
    assert s['device'] == 'cpu' and s['batch'] == '8'
    assert s['mfu'] == 'n/a' and s['eval_mfu'] == 'n/a'  # no peak figure for a CPU
    assert 'batch 8 x 8 tokens' in out  # the dataset's seq_len, not the synthetic default


def test_bench_on_xla_stops_compiling():
    s, out = run_bench(['--device=xla', '--mlp_t=False', '--pos_encodings=rope'] + BENCH_TINY, env=XLA_ENV)
    assert s['device'] == 'xla'
    assert int(s['compiles_warm']) > 0 and s['compiles_warm'] == s['compiles_end']  # timed steps reused the graphs
    assert s['fallbacks'] == '0' and 'CPU fallbacks in training: none; in evaluation: none' in out
