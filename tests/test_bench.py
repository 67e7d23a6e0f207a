"""
bench.py smoke runs, as a user runs it (a subprocess), on the CPU and on CPU-XLA. Speed is printed, never
asserted: only that the summary line holds every field, the fields are numbers, and XLA stops compiling.
    python -m pytest -q tests/test_bench.py
"""
import shutil

import numpy as np
import pytest

from conftest import XLA_ENV, assert_user_error, run, site_hook

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
    assert f"model: {int(s['params']):,} parameters" in out  # scripts read the count off the last line


def test_bench_says_which_typed_keys_of_a_run_it_does_not_use(tmp_path):
    # --init_from=CKPT would look like a benchmark of that checkpoint's model; bench times the config's, fresh
    flags = ['--device=cpu', f'--init_from={tmp_path / "ckpt_00000010.pt"}', '--wandb_log=True',
             f'--xla_cache_dir={tmp_path / "xla"}', '--steps=1', '--warmup_steps=1', '--eval_batches=0',
             '--global_batch_size=8']
    p = run(['bench.py', 'config/quickstart.py'] + flags)
    notes = [l for l in p.stdout.splitlines() if l.startswith('note: --')]
    assert len(notes) == 1 and '--init_from, --wandb_log, --xla_cache_dir:' in notes[0], p.stdout
    assert 'does not use' in notes[0] and not (tmp_path / 'xla').exists()
    assert not (tmp_path / 'wandb').exists()
    p = run(['bench.py', 'config/quickstart.py'] + flags[:1] + flags[4:])
    assert 'does not use' not in p.stdout  # the config file's out_dir, epochs, ... are no news


def test_bench_refuses_a_compile_mode_with_cuda_graphs_in_one_line():
    # CUDA graphs replay into the same output buffers, and the carry one step returns is read by the next: refused
    # before anything is built, on any device, with what would run
    for mode in ('reduce-overhead', 'max-autotune', 'fast'):
        p = run(['bench.py', '--device=cpu', f'--compile_mode={mode}'] + BENCH_TINY, check=False)
        want = (f"config error: compile_mode={mode!r} (allowed: 'default' | 'max-autotune-no-cudagraphs'; the modes "
                "with CUDA graphs overwrite the carry one step returns before the next step reads it), "
                f"from --compile_mode={mode}")
        assert p.returncode == 1 and p.stderr.strip().splitlines() == [want], p.stderr


def test_bench_refuses_what_train_refuses_and_negative_values_of_its_own_keys_in_one_line():
    # train.py's keys pass train.py's rules (configurator.config_problems), naming the flag; bench's own counts
    # may not be negative; each refused before anything is built
    cases = [(['--mlp_t=False', '--hidden_size=60', '--num_heads=8'],
              ['hidden_size=60 is not divisible by num_heads=8', '--hidden_size=60 --num_heads=8']),
             (['--global_batch_size=-8'], ['global_batch_size=-8 (allowed: > 0), from --global_batch_size=-8']),
             (['--pos_encodings=alibi'], ["pos_encodings='alibi' (allowed: 'rope' | 'learned' | 'none')"]),
             (['--eval_batch_size=-2', '--halt_max_steps=0'], ['eval_batch_size=-2 (allowed: >= 0)',
                                                               'halt_max_steps=0 (allowed: > 0)']),
             (['--emb_update_batch=-3', '--num_puzzle_identifiers=-1'],
              ['num_puzzle_identifiers=-1', 'emb_update_batch=-3', '(allowed: >= 0)']),
             (['--vocab_size=1'], ['vocab_size=1 (allowed: 0 or >= 2', 'PAD'])]  # no token to draw a batch from
    for flags, words in cases:
        p = run(['bench.py', '--device=cpu'] + BENCH_TINY + flags, check=False)
        said = assert_user_error(p, *words, one_line=True)
        assert said.startswith('config error: ') and 'model:' not in p.stdout, (flags, said)


def test_bench_refuses_a_bad_profile_steps_before_anything_runs():
    # the span is read with the other flags: a typo costs no benchmark, and is not left for after the timing
    for value in ('3', '0-3', '3:1'):
        p = run(['bench.py', '--device=cpu', f'--profile_steps={value}'] + BENCH_TINY, check=False)
        said = assert_user_error(p, f"profile_steps='{value}'", "'START:END' with 0 <= START < END", one_line=True)
        assert said.startswith('config error: ') and 'train:' not in p.stdout, p.stdout


def test_bench_refuses_a_profile_dir_it_cannot_make_before_anything_runs(tmp_path):
    # the trace's folder was made after the timing: a file in its place ended the bench in a traceback, the
    # timing and its summary line lost
    (tmp_path / 'f').write_text('mine')
    for folder in (tmp_path / 'f', tmp_path / 'f' / 'profile'):
        p = run(['bench.py', '--device=cpu', '--profile_steps=0:1', f'--profile_dir={folder}'] + BENCH_TINY,
                check=False)
        said = assert_user_error(p, f"profile_dir='{folder}'", f'{tmp_path / "f"} is a file', one_line=True)
        assert said.startswith('config error: ') and 'train:' not in p.stdout, p.stdout
    assert (tmp_path / 'f').read_text() == 'mine'
    # an empty one names no folder: the trace's os.makedirs('') ended the bench in a traceback after its timing
    p = run(['bench.py', '--device=cpu', '--profile_steps=0:1', '--profile_dir='] + BENCH_TINY, check=False)
    said = assert_user_error(p, "profile_dir=''", 'allowed: a folder', '--profile_dir=', one_line=True)
    assert said.startswith('config error: ') and 'train:' not in p.stdout, p.stdout


def test_bench_refuses_a_data_path_that_is_there_but_holds_no_dataset(toy, tmp_path):
    # a name with no dataset behind it gives the shape (random batches); an existing folder or file that is no
    # dataset, such as a dataset's split folder, is a mistake: it was timed as 9x9 Sudoku
    maze = tmp_path / 'maze-30x30'
    maze.mkdir()
    (tmp_path / 'file').write_text('x')
    for path in (f'{toy}/train', maze, tmp_path / 'file'):
        p = run(['bench.py', '--device=cpu', f'--data_path={path}'] + BENCH_TINY, check=False)
        said = assert_user_error(p, f'config error: data_path={path}', 'no dataset', 'train/dataset.json',
                                 one_line=True)
        assert 'train:' not in p.stdout, p.stdout
    p = run(['bench.py', '--device=cpu', f'--data_path={toy}/train'] + BENCH_TINY, check=False)
    assert f'--data_path={toy}' in p.stderr, p.stderr  # a split folder: its dataset named


def test_bench_times_the_name_s_shape_while_its_dataset_is_being_built(tmp_path):
    # `python bench.py config/quickstart.py` while prepare_sudoku.py builds data/sudoku6 (or after a build was
    # killed): the folder holds only the build's own files, no dataset yet, and the name still says the shape
    from data import building
    root = tmp_path / 'sudoku6'
    with building(str(root)):
        s, out = run_bench(['--device=cpu', f'--data_path={root}'] + BENCH_TINY)
    assert 'shape: 36 tokens' in out and 'random batches' in out, out


def test_bench_on_xla_stops_compiling():
    pytest.importorskip('torch_xla')  # Linux wheels only
    s, out = run_bench(['--device=xla', '--mlp_t=False', '--pos_encodings=rope', '--host_flush_mb=1', '--vs_eager=True',
                        '--compile_mode=max-autotune-no-cudagraphs'] + BENCH_TINY, env=XLA_ENV)
    assert s['device'] == 'xla' and s['variant'] == 'one_graph'  # one process, one micro-batch: the step one graph
    assert '| compiled (xla_backend)' in out  # what compiled it, not an inductor mode XLA has no use for
    assert "compile_mode='max-autotune-no-cudagraphs' is inductor's, for a compiled CUDA step: not used here (xla)" \
        in out
    # vs_eager: the eager step timed in the same run, and the ratio of the device times
    assert float(s['eager_device_ms_per_step']) > 0 and float(s['eager_host_ms_per_step']) > 0
    ratio = float(s['device_ms_per_step']) / float(s['eager_device_ms_per_step'])
    assert abs(float(s['device_vs_eager']) - ratio) < 0.01, (s['device_vs_eager'], ratio)
    assert float(s['device_vs_eager_alternated']) > 0 and 'alternated step by step, median of' in out
    # the eager step warmed up as the compiled one is: no compilation among its timed steps
    n = out.split('xla: eager step')[1].split(' | compilations ')[1].split()
    assert n[0] == n[4], n
    assert int(s['compiles_warm']) > 0 and s['compiles_warm'] == s['compiles_end']  # timed steps reused the graphs
    assert float(s['host_ms_per_step']) > 0 and float(s['device_ms_per_step']) > 0 and s['host_flush_mb'] == '1'
    assert 'caches flushed (1 MiB)' in out
    n = out.split('; evaluation ')[1].split()  # the first evaluation batch compiles, the next ones reuse it
    assert n[0] == n[2] and int(n[0]) > int(s['compiles_end']), n
    assert s['fallbacks'] == '0' and 'CPU fallbacks in training: none; in evaluation: none' in out


def test_bench_writes_and_uploads_a_checkpoint_as_train_writes_one(emu, tmp_path):
    """--checkpoint_dir: the file holds what train.py's does (weights, an EMA copy with its own bytes, AdamATan2
    moments, the carry of the whole batch), written into a folder, or uploaded to the bucket (the emulator)."""
    import torch
    from conftest import BUCKET
    from runkeep.gcs import GCS
    tiny = [a for a in BENCH_TINY if not a.startswith(('--steps=', '--eval_batches='))]
    p = run(['bench.py', '--device=cpu', '--steps=0', '--eval_batches=0', f'--checkpoint_dir={tmp_path}/ck'] + tiny)
    line = [l for l in p.stdout.splitlines() if l.startswith('bench: checkpoint_mb=')][-1]
    s = dict(kv.split('=', 1) for kv in line.split()[1:])
    assert s['upload_s'] == 'n/a' and float(s['save_s']) >= 0 and 'train:' not in p.stdout  # steps=0: only the save
    ck = torch.load(f'{tmp_path}/ck/ckpt_bench.pt', weights_only=True)
    assert ck['carry']['y'].shape[0] == 8 and len(ck['optimizer']['state']) == len(ck['model']) - 3  # 3 buffers
    assert ck['ema'].keys() == ck['model'].keys()
    assert ck['ema']['lm_head.weight'].untyped_storage().data_ptr() != ck['model']['lm_head.weight'].untyped_storage().data_ptr()
    size_mb = (tmp_path / 'ck' / 'ckpt_bench.pt').stat().st_size / 1e6
    assert abs(float(s['checkpoint_mb']) - size_mb) < 0.05  # what is reported is the file's size
    params = sum(v.numel() * v.element_size() for k, v in ck['model'].items() if k not in ('puzzle_emb', 'H_init', 'L_init'))
    assert size_mb * 1e6 > 4 * params  # weights, EMA and two moments: each stored once, none shared
    p = run(['bench.py', '--device=cpu', '--steps=0', '--eval_batches=0', f'--checkpoint_dir=gs://{BUCKET}/bench'] + tiny)
    assert 'upload to gs://test-bucket/bench' in p.stdout
    assert [u for u, _ in GCS().list(f'gs://{BUCKET}/bench/')] == [f'gs://{BUCKET}/bench/ckpt_bench.pt']
    (tmp_path / 'a_file').write_text('')  # a checkpoint_dir that cannot be a folder: a message, no traceback
    p = run(['bench.py', '--device=cpu', '--steps=0', '--eval_batches=0', f'--checkpoint_dir={tmp_path}/a_file/ck'] + tiny,
            check=False)
    assert p.returncode == 1 and f"checkpoint_dir='{tmp_path}/a_file/ck'" in p.stderr and 'Traceback' not in p.stderr, p.stderr


def test_bench_s_last_line_holds_the_checkpoint_s_figures_when_it_also_times_steps(tmp_path):
    # checkpoint_dir with steps: the save is timed first, then the steps; the line scripts read held the steps'
    # figures alone, and the save's only on the console's `checkpoint:` line
    s, out = run_bench(['--device=cpu', f'--checkpoint_dir={tmp_path}/ck'] + BENCH_TINY)
    size_mb = (tmp_path / 'ck' / 'ckpt_bench.pt').stat().st_size / 1e6
    assert abs(float(s['checkpoint_mb']) - size_mb) < 0.05 and float(s['save_s']) >= 0, s
    assert float(s['carry_mb']) > 0 and s['upload_s'] == 'n/a', s
    s, _ = run_bench(['--device=cpu'] + BENCH_TINY)  # none: the same fields, n/a
    assert [s[k] for k in ('checkpoint_mb', 'carry_mb', 'save_s', 'upload_s')] == ['n/a'] * 4, s


def test_bench_says_a_profile_steps_its_checkpoint_only_run_does_not_trace(tmp_path):
    # steps=0 times the save alone: a profile_steps asked for then traced nothing, without a word
    tiny = [a for a in BENCH_TINY if not a.startswith('--steps=')]
    p = run(['bench.py', '--device=cpu', '--steps=0', f'--checkpoint_dir={tmp_path}/ck2', '--profile_steps=0:2',
             f'--profile_dir={tmp_path}/prof'] + tiny)
    said = [l for l in p.stdout.splitlines() if 'profile_steps' in l and not l.startswith('config:')]
    assert len(said) == 1 and 'steps=0' in said[0] and 'no step is traced' in said[0], p.stdout[-2000:]
    assert not (tmp_path / 'prof').exists()


def test_bench_refuses_views_its_evaluation_batch_cannot_hold():
    # the memory check counts every puzzle of the evaluation batch in K views, each with the model's latents (as
    # train.py's does), not one puzzle: 64 puzzles in 100 views need about 89 MB, more than the 50 MB given
    p = run(['bench.py', '--device=cpu', '--eval_batch_size=64', '--eval_views=100'] + BENCH_TINY, check=False,
            env=dict(TRM_MEMORY_AVAILABLE='5e7'))
    said = assert_user_error(p, 'eval_views=100', 'a batch of 64 puzzles', one_line=True)
    assert said.startswith('config error: ') and 'train:' not in p.stdout, p.stdout


def test_bench_measures_train_s_step_with_frozen_weights(tmp_path):
    # freeze_weights=True (config/adapt/adapt_emb_*.py): train.py's step trains the puzzle embedding only, so the
    # weights get no gradient, no AdamATan2 moments and no EMA; bench's step and checkpoint are that step's, and
    # what train.py refuses (nothing to train) is refused here too
    p = run(['bench.py', '--device=cpu'] + BENCH_TINY + ['--freeze_weights=True', '--puzzle_emb_ndim=0'], check=False)
    assert_user_error(p, 'freeze_weights=True', 'puzzle_emb_ndim=0', one_line=True)
    tiny = [a for a in BENCH_TINY if not a.startswith(('--steps=', '--eval_batches='))]
    run(['bench.py', '--device=cpu', '--freeze_weights=True', '--steps=0', '--eval_batches=0',
         f'--checkpoint_dir={tmp_path}/ck'] + tiny)
    import torch
    ck = torch.load(f'{tmp_path}/ck/ckpt_bench.pt', weights_only=True)
    assert ck['optimizer']['state'] == {}, sorted(ck['optimizer']['state'])
    s, out = run_bench(['--device=cpu', '--freeze_weights=True'] + BENCH_TINY)
    assert 'trains the puzzle embedding only (freeze_weights)' in out


def test_bench_names_where_a_refused_value_of_its_own_keys_was_set(tmp_path):
    # as train.py's keys are refused: the config file's line or the flag that set the value
    cfg = tmp_path / 'bench_cfg.py'
    cfg.write_text("seq_align = 8\nsteps = -3\n")
    p = run(['bench.py', str(cfg), '--device=cpu'] + [a for a in BENCH_TINY if not a.startswith('--steps=')],
            check=False)
    assert_user_error(p, f"steps=-3 (allowed: >= 0), from {cfg}, line 2", one_line=True)
    for flag, words in (('--seq_align=0', 'seq_align=0 (allowed: >= 1), from --seq_align=0'),
                        ('--kernels_ab=nope', "kernels_ab='nope' (allowed: "),
                        ('--compile_mode=fast', "compile_mode='fast' (allowed: ")):
        p = run(['bench.py', '--device=cpu'] + BENCH_TINY + [flag], check=False)
        assert_user_error(p, words, f"from {flag}", one_line=True)


@pytest.mark.parametrize('shape', [[], ['--mlp_t=False', '--seq_len=900', '--vocab_size=6',
                                                   '--global_batch_size=2', '--steps=1', '--warmup_steps=1']])
def test_bench_counts_the_flops_its_step_computes_with_frozen_weights(shape):
    # freeze_weights=True: the step's backward still carries the activations' gradients down to the puzzle rows,
    # but computes no weight's gradient; the count behind MFU is what torch's FLOP counter sees that step run (mlp_t,
    # no sequence padding: every matmul counted, none of them padding). Maze's attention too: its scores and values
    # over the 900 tokens and the puzzle positions, both factors activations, through SDPA's math backend (the
    # CPU's fused attention kernel is one the counter does not count)
    import numpy as np
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    from configurator import read_config_block
    from model import MODEL_KEYS, TRM, TRMConfig
    from step import AdamATan2, Eager, StepConfig, train_step
    keys = {k: v for k, (v, _) in read_config_block('train.py').items()}
    flags = dict(a[2:].split('=', 1) for a in BENCH_TINY + shape)
    model_keys = {k: (flags[k] == 'True' if type(keys[k]) is bool else type(keys[k])(flags[k])) if k in flags
                  else keys[k] for k in MODEL_KEYS}
    assert model_keys['mlp_t'] == (not shape)
    B, L, V, ids = 2, int(flags.get('seq_len', 81)), int(flags.get('vocab_size', 11)), 1
    for frozen in (False, True):
        s, _ = run_bench(['--device=cpu', '--seq_align=1', f'--freeze_weights={frozen}'] + BENCH_TINY + shape)
        torch.manual_seed(0)
        m = TRM(TRMConfig(vocab_size=V, seq_len=L, num_puzzle_identifiers=ids, **model_keys), seq_align=1)
        m.requires_grad_(not frozen).train()
        rng = np.random.default_rng(0)
        batch = dict(inputs=torch.tensor(rng.integers(1, V, (B, L)), dtype=torch.int32),
                     labels=torch.tensor(rng.integers(1, V, (B, L)), dtype=torch.int32),
                     puzzle_identifiers=torch.zeros(B, dtype=torch.int32))
        sc = StepConfig(lr=1e-4, puzzle_emb_lr=1e-2, puzzle_emb_weight_decay=0.1, warmup_steps=1, total_steps=10,
                        min_ratio=1.0, global_batch_size=B, freeze_weights=frozen)
        opt, step_t, carry = AdamATan2(m.parameters()), torch.zeros(()), m.initial_carry(batch)
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            train_step(m, opt, None, carry, batch, step_t, sc, Eager())
        seen = counter.get_total_flops() / B
        assert int(s['flops_per_example']) == seen, (frozen, s['flops_per_example'], seen)


def test_bench_help_says_what_its_profile_steps_does(tmp_path):
    # bench.py takes train.py's keys, but its profile_steps is its own: END-START more steps traced after the
    # timing, into profile_dir (train.py's traces its steps START+1..END into the run's folder)
    p = run(['bench.py', '--help'])
    line = next(l for l in p.stdout.splitlines() if l.strip().startswith('--profile_steps='))
    assert '<run>' not in line and 'END-START' in line and 'profile_dir' in line, line
    p = run(['bench.py', '--device=cpu', '--profile_steps=5:6', f'--profile_dir={tmp_path}/prof'] + BENCH_TINY)
    assert f'profile: Chrome trace {tmp_path}/prof' in p.stdout, p.stdout[-2000:]


def test_bench_s_trace_has_a_train_step_span_per_step_as_train_s_has(tmp_path):
    # monitoring.md: each step is a `train_step` span; bench wrapped all END-START steps (and the wait for the
    # device after them) in one span, which reads in Perfetto as one step three times as long
    import json
    run(['bench.py', '--device=cpu', '--profile_steps=0:3', f'--profile_dir={tmp_path}/prof'] + BENCH_TINY)
    events = json.load(open(tmp_path / 'prof' / 'trace_0_3.json'))['traceEvents']
    assert sum(e.get('name') == 'train_step' for e in events) == 3


COUNT_LOSS_STEPS = """
import atexit
import model
real, calls = model.TRM.predict_step, [0, 0]

def predict_step(self, latents, x, labels=None):
    calls[labels is not None] += 1
    return real(self, latents, x, labels)
model.TRM.predict_step = predict_step
atexit.register(lambda: print(f'test hook: predict steps {calls[0]} without the loss, {calls[1]} with it'))
"""


def test_bench_times_the_evaluation_train_runs_with_its_loss_step(tmp_path):
    # evaluate.evaluate (train.py's evaluation) runs each batch's step halt_max_steps with the rows' loss (a graph of
    # its own where compiled); bench's evaluation runs the same steps: per batch one with the loss, the rest without
    tiny = [a for a in BENCH_TINY if not a.startswith('--eval_batches=')]
    s, out = run_bench(['--device=cpu', '--eval_batches=2', '--eval_steps=5'] + tiny,
                       env=site_hook(tmp_path / 'hook', COUNT_LOSS_STEPS))
    assert 'test hook: predict steps 8 without the loss, 2 with it' in out, out[-1500:]


def test_bench_counts_the_puzzles_its_evaluation_batches_hold(toy):
    # the toy's 200 test puzzles in batches of 150: the second batch holds 50 puzzles and 100 padding rows, which
    # puzzles/s does not count (Maze's 1000 test puzzles in batches of 768 have the same shape)
    tiny = [a for a in BENCH_TINY if not a.startswith('--eval_batches=')]
    s, out = run_bench(['--device=cpu', f'--data_path={toy}', '--eval_batch_size=150', '--eval_batches=3'] + tiny)
    assert '350 puzzles in 3 batches' in out, [l for l in out.splitlines() if l.startswith('eval:')]


@pytest.mark.parametrize('split,name,change', [
    ('train', 'dataset.json', lambda path: open(path, 'w').write('{"pad_id": 0,')),
    ('test', 'all__labels.npy', lambda path: np.save(path, np.load(path)[:-3])),  # an IndexError mid-evaluation
    ('train', 'all__inputs.npy', lambda path: np.save(path, np.load(path) + 0.5)),  # was timed, truncated to ints
])
def test_bench_on_a_broken_dataset_is_one_line_naming_the_file(toy, tmp_path, split, name, change):
    d = shutil.copytree(toy, tmp_path / 'd')
    change(str(d / split / name))
    p = run(['bench.py', f'--data_path={d}', '--device=cpu'] + BENCH_TINY, check=False)
    assert_user_error(p, f'config error: data_path={d}', str(d / split), name, one_line=True)


def test_mfu_is_against_the_peak_of_the_gpu_variant_the_device_names():
    # the PCIe / NVL cards share their SXM sibling's name up to a suffix and have a lower peak (datasheets'
    # dense bf16): MFU against the sibling's would understate theirs
    from device import peak_tflops_of
    want = {'NVIDIA H100 80GB HBM3': 989, 'NVIDIA H100 PCIe': 756, 'NVIDIA H100 NVL': 835, 'NVIDIA H200': 989,
            'NVIDIA H200 NVL': 835, 'NVIDIA A100-SXM4-80GB': 312, 'NVIDIA L40S': 362, 'NVIDIA L40': None}
    assert {n: peak_tflops_of(n) for n in want} == want
