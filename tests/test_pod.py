"""
A TPU pod's ranks execute the same XLA graphs with the same collectives in the same order: the symmetry test.

XLA on the CPU cannot run a collective across two devices (CPU_NUM_DEVICES=2 deadlocks on the first all_reduce:
pytorch/xla issues 5005, 9089), so the multi-process path is proved by playing each rank of a world of 2 in its
own process on its own single CPU-XLA device, running the real train.py through `torch_xla.launch` as a pod
would, and comparing what the two roles execute. What one device cannot provide is stood in by a
sitecustomize.py that Python loads in every process of a role (the launcher and the process torch_xla.launch
spawns for the device):
  - torch_xla.runtime.global_ordinal / world_size / local_device_count say rank r of 2, both on this host;
    XLA_ALWAYS_ALLREDUCE=1 keeps every collective in the graphs on one replica, so xm.all_reduce, the real
    xm.all_gather (a zero-padded all-reduce, the padding placed by the ordinal) and xm.rendezvous run unchanged;
  - Device.agree still runs its graph (the all-reduce and the read) on each replica; the value a pod's reduction
    would return (a single replica reduces only itself) is then combined from both roles' inputs through files,
    so control flow that follows agreed values (resume's checkpoint choice, stop flags, timings) is a pod's;
  - SIGTERM: each role sends itself a real SIGTERM at the start of its N-th training step and waits until
    train.py's handler has raised the flag, so both stop through the agreed-stop path at the same step.
Recorded per role: every executed graph (XLA_SAVE_TENSORS_FILE dumps the HLO of each execution, including those
a .cpu() or .item() triggers) and its collectives. The ranks' graphs may differ only in the all-gather padding
(rank r's rows placed at r * n), which is checked and then normalised; everything else must be identical.
Both roles share one local out_dir, as the processes of a one-host pod do; only rank 0 writes there.
    python -m pytest -q tests/test_pod.py
TRM_POD_TREE=/path/to/another/checkout runs the same harness against another tree of this trainer.
TRM_MEASURE_SIGTERM=1 also runs the (slow) SIGTERM-to-exit measurement at the full model size.
"""
import glob
import hashlib
import os
import re
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip('torch_xla')  # Linux wheels only: on macOS these tests skip

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TREE = os.path.abspath(os.environ.get('TRM_POD_TREE', ROOT))  # the trainer under test
WORLD = 2

# -----------------------------------------------------------------------------
# the stand-in for what a single CPU-XLA device cannot provide; loaded by every Python process of a role

SITECUSTOMIZE = r'''
import os, sys
# every process of a role but multiprocessing's resource tracker (it would only import torch_xla for nothing)
if os.environ.get('TRM_POD_ROLE') and 'resource_tracker' not in ' '.join(sys.orig_argv):
    import signal, time
    import numpy as np
    RANK, WORLD = (int(x) for x in os.environ['TRM_POD_ROLE'].split('/'))
    TIMEOUT = float(os.environ.get('TRM_POD_TIMEOUT', '300'))

    import torch_xla.runtime as xr
    xr.world_size = lambda: WORLD
    xr.global_ordinal = lambda: RANK
    xr.local_device_count = lambda: WORLD  # every rank on this one host: a local out_dir is allowed

    sigterm_at = int(os.environ.get('TRM_POD_SIGTERM_AT', '0'))
    if sigterm_at:
        import step
        real_train_step, calls = step.train_step, [0]

        def train_step(*args, **kwargs):
            calls[0] += 1
            if calls[0] == sigterm_at:  # a real signal to this process; its handler runs in the main thread
                stop = sys.modules['guard'].STOP
                print(f"pod harness: rank {RANK} sends itself SIGTERM in training step {calls[0]}", flush=True)
                os.kill(os.getpid(), signal.SIGTERM)
                deadline = time.time() + 60
                while not stop['requested']:
                    if time.time() > deadline:
                        raise RuntimeError("pod harness: the SIGTERM handler did not raise STOP")
                    time.sleep(0.005)
            return real_train_step(*args, **kwargs)
        step.train_step = train_step  # train.py imports it after this

    exchange = os.environ.get('TRM_POD_EXCHANGE')
    try:
        import device
    except ImportError:  # a tree without device.py: its values stay each replica's own
        device = None
    if exchange and device is not None and hasattr(device.Device, 'agree'):
        real_agree, count = device.Device.agree, [0]

        def agree(self, values, op='sum'):
            mine = real_agree(self, values, op)  # the graph runs: the collective on this replica, then the read
            count[0] += 1
            v = np.asarray(values, dtype=np.float64).reshape(-1)
            assert np.array_equal(mine, v.astype(np.float32).astype(np.float64)), (mine, v)  # it reduced itself
            tag = f'agree{count[0]:05d}.{op}.{v.size}'
            path = os.path.join(exchange, f'{tag}.rank{RANK}.npy')
            np.save(path + '.tmp.npy', v)
            os.replace(path + '.tmp.npy', path)
            parts, deadline = [], time.time() + TIMEOUT
            for r in range(WORLD):
                while True:
                    found = [p for p in os.listdir(exchange)
                             if p.startswith(f'agree{count[0]:05d}.') and p.endswith(f'.rank{r}.npy')]
                    if found:
                        break
                    if time.time() > deadline:
                        raise RuntimeError(f"pod harness: rank {r} never made agree call {count[0]} ({tag})")
                    time.sleep(0.002)
                if found[0] != f'{tag}.rank{r}.npy':
                    raise RuntimeError(f"pod harness: agree call {count[0]} differs: {tag} here, {found[0]} on rank {r}")
                parts.append(np.load(os.path.join(exchange, found[0])))
            x = np.stack(parts).astype(np.float32)  # what the device reduces: float32
            return dict(sum=x.sum(0), max=x.max(0), min=x.min(0))[op].astype(np.float64)
        device.Device.agree = agree
'''

# -----------------------------------------------------------------------------
# the executed graphs, from the XLA_SAVE_TENSORS_FILE dump

COLLECTIVES = ('all-reduce', 'all-gather', 'reduce-scatter', 'collective-permute', 'all-to-all')
INSTR = re.compile(r'^\s*(?:ROOT )?%(\S+) = (.*?) ([a-z][a-z0-9-]*)\((.*?)\)(, .*)?$')


def _normalise(hlo, rank, world):
    """HLO text with the all-gather padding (the operand of an all-reduce padded by rank * rows before and
    (world - 1 - rank) * rows after, on one axis) checked against `rank` and replaced by a placeholder.
    Returns (text, how many gathers)."""
    lines, defs = hlo.splitlines(), {}
    for i, line in enumerate(lines):
        m = INSTR.match(line)
        if m:
            defs[m.group(1)] = dict(line=i, op=m.group(3), args=m.group(4), attrs=m.group(5) or '')

    def source(name):  # through tuple / get-tuple-element to what produced a value
        d = defs.get(name)
        if d and d['op'] == 'get-tuple-element':
            tup = defs.get(re.findall(r'%(\S+)', d['args'])[0])
            if tup and tup['op'] == 'tuple':
                k = int(re.search(r'index=(\d+)', d['attrs']).group(1))
                return source(re.findall(r'%([^\s,)]+)', tup['args'])[k])
        return name

    gathers = 0
    for d in list(defs.values()):
        if d['op'] != 'all-reduce':
            continue
        for operand in re.findall(r'%([^\s,)]+)', d['args']):
            pad = defs.get(source(operand))
            if not pad or pad['op'] != 'pad':
                continue
            dims = [int(x) for x in re.match(r'\w+\[([\d,]*)\]', pad['args']).group(1).split(',') if x]
            amounts = [tuple(map(int, p.split('_'))) for p in re.search(r'padding=(\S+)', pad['attrs']).group(1).split('x')]
            axes = [a for a, lo_hi in enumerate(amounts) if lo_hi != (0, 0)]
            assert len(axes) == 1, f"an all-reduce operand padded on several axes: {lines[pad['line']]}"
            a = axes[0]
            assert amounts[a] == (rank * dims[a], (world - 1 - rank) * dims[a]), \
                f"an all-gather's padding is not rank {rank}'s of a world of {world}: {lines[pad['line']]}"
            lines[pad['line']] = re.sub(r'padding=\S+', f'padding=<all-gather axis {a}>', lines[pad['line']])
            gathers += 1
    return '\n'.join(lines), gathers


def executed_graphs(path, rank, world=WORLD):
    """[dict(fp, collectives, gathers, where)] for each graph execution in the dump, in order. fp: a hash of the
    normalised HLO; where: the innermost frame in the trainer's files that triggered it."""
    files = glob.glob(path + '*')
    assert len(files) == 1, (path, files)
    text = open(files[0]).read()
    graphs = []
    for block in text.split('[ScheduleSyncTensorsGraph]')[1:]:
        info, _, rest = block.partition('## BEGIN_GRAPH')
        hlo = rest.partition('## END_GRAPH')[0]
        hlo = re.sub(r'\n\s*Graph Hash: \S+\s*', '\n', hlo).strip()
        norm, gathers = _normalise(hlo, rank, world)
        frames = re.findall(r'^\s+(\S+) \((\S+?):(\d+)\)$', info, re.M)
        mine = [f"{fn} ({os.path.basename(f)}:{ln})" for fn, f, ln in frames
                if os.path.basename(f) in ('train.py', 'step.py', 'evaluate.py', 'arc.py', 'run.py', 'checkpoint.py',
                                            'guard.py', 'records.py', 'model.py', 'device.py', 'data.py')]
        graphs.append(dict(fp=hashlib.sha1(norm.encode()).hexdigest()[:12], gathers=gathers,
                           collectives={c: len(re.findall(rf' {c}(?:-start)?\(', norm)) for c in COLLECTIVES},
                           where=mine[0] if mine else (frames[0][0] if frames else '?')))
    return graphs


def describe(graphs):
    return [f"{g['fp']} {g['where']} " + ' '.join(f"{k}={v}" for k, v in g['collectives'].items() if v)
            for g in graphs]


def first_divergence(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if (x['fp'], x['collectives']) != (y['fp'], y['collectives']):
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def assert_same_graphs(lists, what):
    a, b = lists
    i = first_divergence(a, b)
    if i is not None:
        lo = max(0, i - 3)
        raise AssertionError(
            f"{what}: rank 0 executed {len(a)} graphs, rank 1 {len(b)}; first difference at #{i}:\n"
            f"rank 0 #{lo}..: " + '\n    '.join(describe(a[lo:i + 4])) + "\n"
            f"rank 1 #{lo}..: " + '\n    '.join(describe(b[lo:i + 4])))


# -----------------------------------------------------------------------------
# running the roles

def role_env(tmp, rank, run, sigterm_at=0):
    env = dict(os.environ, PJRT_DEVICE='CPU', CPU_NUM_DEVICES='1', XLA_ALWAYS_ALLREDUCE='1', WANDB_MODE='disabled',
               PYTHONUNBUFFERED='1', TRM_POD_ROLE=f'{rank}/{WORLD}', TRM_POD_EXCHANGE=str(tmp / f'exchange_{run}'),
               XLA_SAVE_TENSORS_FILE=str(tmp / f'graphs_{run}_rank{rank}'), XLA_SAVE_TENSORS_FMT='hlo',
               PYTHONPATH=os.pathsep.join([str(tmp / 'harness'), TREE] + [p for p in os.environ.get(
                   'PYTHONPATH', '').split(os.pathsep) if p]))
    for k in ('WORLD_SIZE', 'RANK', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'TORCHELASTIC_RUN_ID', 'XLA_IR_DEBUG',
              'XLA_HLO_DEBUG'):
        env.pop(k, None)
    if sigterm_at:
        env['TRM_POD_SIGTERM_AT'] = str(sigterm_at)
    return env


def run_roles(tmp, run, args, sigterm_at=0, timeout=900):
    """Both roles of `python train.py args` at once; returns [(returncode, output)] per rank. When one role
    fails, the other is stopped (it would wait for its peer's agree forever)."""
    os.makedirs(tmp / f'exchange_{run}')
    procs, logs = [], []
    for rank in range(WORLD):
        log = open(tmp / f'{run}_rank{rank}.log', 'w+')
        procs.append(subprocess.Popen([sys.executable, 'train.py'] + args, cwd=TREE, stdout=log,
                                      stderr=subprocess.STDOUT, env=role_env(tmp, rank, run, sigterm_at),
                                      start_new_session=True))
        logs.append(log)
    deadline = time.time() + timeout
    try:
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs) or time.time() > deadline:
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # the role's launcher and the process it spawned
                p.wait()
    out = []
    for p, log in zip(procs, logs):
        log.seek(0)
        out.append((p.returncode, log.read()))
        log.close()
    return out


@pytest.fixture(scope='module')
def sudoku4(tmp_path_factory):
    """Generated 4x4 Sudoku: 100 train groups (a puzzle and one shuffled copy), 50 test puzzles."""
    d = tmp_path_factory.mktemp('sudoku4')
    subprocess.run([sys.executable, 'prepare_sudoku.py', '--generate', '100', '--size', '4', '--num_test', '50',
                    '--num_aug', '1', '--output_dir', str(d)], cwd=ROOT, check=True, capture_output=True, timeout=120)
    return str(d)


def harness(tmp):
    os.makedirs(tmp / 'harness', exist_ok=True)
    (tmp / 'harness' / 'sitecustomize.py').write_text(SITECUSTOMIZE)


TINY_POD = ['--device=xla', '--hidden_size=32', '--num_heads=2', '--puzzle_emb_ndim=8', '--puzzle_emb_len=1',
            '--H_cycles=2', '--L_cycles=2', '--halt_max_steps=3', '--global_batch_size=32', '--eval_batch_size=32',
            '--forward_dtype=float32', '--loss_dtype=float32', '--lr_warmup_steps=2', '--xla_cache_dir=']


def test_the_ranks_of_a_pod_execute_the_same_graphs(sudoku4, tmp_path):
    """Training with logs, checkpoints, an intermediate and a final evaluation, a SIGTERM stop and a resume,
    as rank 0 and as rank 1 of a world of 2. 100 groups / batch 32: eval_interval=2 epochs is 6 steps.
    Run 1: checkpoint at 4, evaluation + checkpoint at 6, SIGTERM in step 7 -> agreed stop, checkpoint at 7.
    Run 2 (resume from 7): checkpoints at 8 and 16, evaluation + checkpoint at 12, final evaluation at 17, the
    step-time agreement at 17 (10 steps after the start), the closing barrier."""
    harness(tmp_path)
    out = tmp_path / 'out'
    args = TINY_POD + [f'--data_path={sudoku4}', f'--out_dir={out}', '--epochs=6', '--max_steps=17',
                       '--eval_interval=2', '--log_interval=4', '--checkpoint_interval=4']
    runs = {}
    for run, extra, sigterm_at in (('run1', [], 7), ('run2', ['--init_from=resume'], 0)):
        res = run_roles(tmp_path, run, args + extra, sigterm_at=sigterm_at)
        for rank, (rc, text) in enumerate(res):
            assert rc == 0, f"{run} rank {rank} exited {rc}:\n{text[-6000:]}"
        runs[run] = [executed_graphs(str(tmp_path / f'graphs_{run}_rank{r}'), r) for r in range(WORLD)]
        for rank in range(WORLD):
            print(f"{run} rank {rank}: {len(runs[run][rank])} graphs executed")
        assert_same_graphs(runs[run], run)
        # and every graph was cut by Device (a step's sync, a read, an agree, the barrier): no device value is
        # read behind its back, where one rank could do it alone
        # (or by torch_xla's dynamo bridge inside the compiled step and evaluation, which runs a compiled graph's
        # pending inputs, such as the all-reduced gradients, at a fixed point of step.py / model.py on every rank
        # alike, and traces a graph once when it compiles it: extract_graph_helper)
        allowed = ('(device.py:', '(step.py:', '(model.py:', 'extract_graph_helper')
        outside = [d for d in describe(runs[run][0]) if not any(a in d for a in allowed)]
        assert not outside, f"{run}: graphs executed outside Device's sync/read/agree/barrier: {outside}"
        runs[run + '_out'] = [text for _, text in res]

    # each role ran the whole story (rank 0 prints; both got the signal)
    r1, r2 = runs['run1_out'], runs['run2_out']
    for rank in range(WORLD):
        assert 'got SIGTERM' in r1[rank], r1[rank][-3000:]
    assert f'saved {out}/ckpt_00000004.pt' in r1[0] and f'saved {out}/ckpt_00000006.pt' in r1[0], r1[0][-3000:]
    assert f'saved {out}/ckpt_00000007.pt (stop requested)' in r1[0] and 'stopped cleanly' in r1[0], r1[0][-3000:]
    assert 'step 4/17' in r1[0] and len(re.findall(r'^eval on', r1[0], re.M)) == 1, r1[0][-3000:]
    assert f'resuming from {out}/ckpt_00000007.pt (step 7)' in r2[0], r2[0][-3000:]
    assert len(re.findall(r'^eval on', r2[0], re.M)) == 2 and 'step 17/17' in r2[0], r2[0][-3000:]
    assert os.path.exists(out / 'results.json') and os.path.exists(out / 'ckpt_00000017.pt')
    assert 'saved ' not in r1[1] + r2[1] and 'eval on' not in r1[1] + r2[1]  # rank 0's host work is rank 0's

    # what was compared is the pod's real work: collectives in the training step, the saves' gathers
    for run in ('run1', 'run2'):
        g = runs[run][0]
        assert sum(x['collectives']['all-reduce'] for x in g) > 20, describe(g)
        assert sum(x['gathers'] for x in g) > 5, describe(g)
        print(f"{run}: " + '\n  '.join(describe(g)))


# -----------------------------------------------------------------------------
# evaluation: a host count that differs between ranks must not become a graph constant on some of them

EVAL_ROLE = r'''
import os, sys
import numpy as np
from data import EvalLoader
from device import Device
from model import TRM, TRMConfig
from evaluate import evaluate
dev = Device('xla')
model = TRM(TRMConfig(vocab_size=6, seq_len=8, hidden_size=32, num_heads=2, H_cycles=1, L_cycles=1, halt_max_steps=2,
                      puzzle_emb_ndim=0, forward_dtype='float32', loss_dtype='float32')).to(dev.device)
loader = EvalLoader(sys.argv[1], 8, dev.rank, dev.world_size)
# rank 0 verifies none of its rows, rank 1 all of them: host counts 0 and 4 per batch
verifier = lambda inputs, preds: np.full(len(inputs), dev.rank == 1)
res, _ = evaluate(model, loader, dev, 2, 2, verifier)
print('verified', res['verified_accuracy'])
'''


def test_evaluation_graphs_do_not_depend_on_a_ranks_verified_count(tmp_path):
    """evaluate() sums the verifier's host count over ranks: were that count put on the device as a scalar that
    XLA treats as a constant when it is 0 or 1, rank 0 (0 verified) and rank 1 (4) would run different graphs."""
    import numpy as np
    sys.path.insert(0, TREE)
    from data import write_split
    rng = np.random.default_rng(0)
    for split, n in (('train', 8), ('test', 8)):
        x = rng.integers(2, 6, (n, 8))
        write_split(str(tmp_path / 'd'), split, x, x, np.zeros(n), np.arange(n + 1), np.arange(n + 1), vocab_size=6)
    harness(tmp_path)
    res, procs = [], []
    for rank in range(WORLD):
        env = role_env(tmp_path, rank, 'eval')
        env.pop('TRM_POD_EXCHANGE')  # evaluate() agrees on nothing
        procs.append(subprocess.Popen([sys.executable, '-c', EVAL_ROLE, str(tmp_path / 'd')], cwd=TREE, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for p in procs:
        text = p.communicate(timeout=180)[0]
        assert p.returncode == 0, text[-4000:]
        res.append(text)
    assert 'verified 0.0' in res[0] and 'verified 1.0' in res[1], res  # each replica sums only itself
    graphs = [executed_graphs(str(tmp_path / f'graphs_eval_rank{r}'), r) for r in range(WORLD)]
    assert_same_graphs(graphs, 'evaluation')


# -----------------------------------------------------------------------------
# a measurement, not a test of behaviour: SIGTERM to exit at the full model size on CPU-XLA (opt-in, slow)

@pytest.mark.skipif(not os.environ.get('TRM_MEASURE_SIGTERM'), reason='set TRM_MEASURE_SIGTERM=1 to measure')
def test_measure_sigterm_to_exit_at_full_model_size(tmp_path):
    """config/baseline.py's model (hidden 512, H3 L6, 16 halting steps, puzzle embedding 16 x 512) on generated
    9x9 Sudoku, but global_batch_size 32 instead of 768 (CPU), one CPU-XLA process. SIGTERM after a few steps
    (after the checkpoint graph's warm-up at step start+1); prints the time from the signal to the exit."""
    data = tmp_path / 'sudoku9'
    subprocess.run([sys.executable, 'prepare_sudoku.py', '--generate', '200', '--size', '9', '--num_test', '32',
                    '--num_aug', '1', '--output_dir', str(data)], cwd=TREE, check=True, capture_output=True, timeout=600)
    steps = int(os.environ.get('TRM_MEASURE_STEPS', '3'))
    env = dict(os.environ, PJRT_DEVICE='CPU', CPU_NUM_DEVICES='1', WANDB_MODE='disabled', PYTHONUNBUFFERED='1')
    args = [sys.executable, 'train.py', 'config/baseline.py', '--device=xla', f'--data_path={data}',
            f'--out_dir={tmp_path}/out', '--global_batch_size=32', '--eval_batch_size=32', '--log_interval=1',
            '--forward_dtype=float32', '--xla_cache_dir=']
    log = open(tmp_path / 'measure.log', 'w+')
    p = subprocess.Popen(args, cwd=TREE, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    seen, t_sig, t_exit = {}, None, None  # line -> when it first appeared
    try:
        while t_exit is None:
            done = p.poll() is not None
            log.seek(0)
            for line in log.read().splitlines():
                seen.setdefault(line, time.time())
            if t_sig is None and any(l.startswith(f'step {steps}/') for l in seen):
                t_sig = time.time()
                os.killpg(p.pid, signal.SIGTERM)  # the launcher and the device process, as a VM's shutdown does
            if done:
                t_exit = time.time()
            time.sleep(0.05)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    text = '\n'.join(seen)
    steps_at = sorted(t for l, t in seen.items() if l.startswith('step '))
    saved = [t for l, t in seen.items() if l.startswith('saved ')]
    print('\n'.join(f"{t - seen[next(iter(seen))]:8.1f} s  {l}" for l, t in seen.items() if 'config:' not in l))
    print(f"full model, batch 32, one CPU-XLA process: last step {steps_at[-1] - steps_at[-2]:.1f} s; SIGTERM to "
          f"checkpoint saved {saved[0] - t_sig if saved else float('nan'):.1f} s, to exit {t_exit - t_sig:.1f} s "
          f"(exit code {p.returncode})")
    assert 'stop requested' in text, text[-3000:]
