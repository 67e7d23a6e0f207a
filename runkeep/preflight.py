"""
`python train.py ... --preflight=True`: a new machine's first check, before a long run, in bounded time. Two short
runs of the same command: the first trains PREFLIGHT_STEPS steps, evaluates a small seeded subset of the test
split and saves; the second resumes from that checkpoint in a new process and does it again. Both use this
host's chips alone (a pod worker started by itself waits for no other) and write into <out_dir>/preflight, so
out_dir itself is left as it was. Then one screen: the device and its chips, the step time (host and device
on XLA), the graph compilations, the bucket written and read, W&B and TensorBoard.
train.py calls preflight(config); nothing here touches a device (the runs do, in their own processes).
"""
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time

from . import gcs
from device import tpu_chips, tpu_host_alone_env, tpu_hosts
from .checkpoint import list_checkpoints
from .records import wandb_key_set
from .signals import STOP
from .startup import local_folder

PREFLIGHT_STEPS = 10        # training steps of each of the two runs
PREFLIGHT_EVAL = 1000       # seeded test examples evaluated at the end of each (eval_subset, when smaller)
PHASE_MINUTES = 15      # a run that takes longer is stopped (SIGTERM, then SIGKILL): the check fails
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository's root


def host_alone_env():
    """TPU: this host's chips as a TPU VM of their own, when the VM is one worker of a pod ({} otherwise)."""
    if os.environ.get('PJRT_DEVICE') != 'TPU':
        return {}
    try:
        return tpu_host_alone_env() if tpu_hosts() > 1 else {}
    except Exception as e:
        print(f"preflight: cannot read the TPU metadata ({e}); the runs use the VM's topology as it is")
        return {}


def run_phase(n, args, env, log):
    """One run of train.py; its output goes to `log`. (exit code or None after a timeout, seconds)."""
    t = time.time()
    with open(log, 'w') as f:
        p = subprocess.Popen([sys.executable, os.path.join(HERE, 'train.py')] + args, stdout=f,
                             stderr=subprocess.STDOUT, env=env, start_new_session=True)  # its own group
        deadline, told = t + 60 * PHASE_MINUTES, False
        while p.poll() is None:
            if (time.time() > deadline or STOP['requested']) and not told:
                os.killpg(p.pid, signal.SIGTERM)  # it saves and exits
                told, deadline = True, time.time() + 60
            elif told and time.time() > deadline:
                os.killpg(p.pid, signal.SIGKILL)
            time.sleep(0.5)
    rc = p.returncode
    return (None if told and not STOP['requested'] else rc), time.time() - t


def read_records(local):
    """The records in <local>/metrics.jsonl ([] when there is none)."""
    path = os.path.join(local, 'metrics.jsonl')
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip()]


def tail(path, n=15):
    with open(path) as f:
        return ''.join(f.readlines()[-n:])


def bucket_check(prefix):
    """gs:// out_dir: a small object written, read back and deleted; '' or the problem."""
    uri, local = f"{prefix.rstrip('/')}/preflight/_probe", os.path.join(HERE, f'.preflight_probe.{os.getpid()}')
    try:
        with open(local, 'w') as f:
            f.write('preflight')
        gcs.upload_file(local, uri)
        os.remove(local)
        gcs.download_file(uri, local)
        with open(local) as f:
            if f.read() != 'preflight':
                return f"{uri} read back different bytes"
        gcs.delete_object(uri)
        return ''
    except Exception as e:
        return f"{uri}: {e}"
    finally:
        if os.path.exists(local):
            os.remove(local)


def wandb_check():
    mode = os.environ.get('WANDB_MODE', 'online')
    if mode in ('offline', 'disabled'):
        return f"WANDB_MODE={mode}: runs log {'offline' if mode == 'offline' else 'nothing'}"
    if importlib.util.find_spec('wandb') is None:
        return "not installed (pip install wandb)"
    url = os.environ.get('WANDB_BASE_URL', 'https://api.wandb.ai')
    if not wandb_key_set():  # where a run looks for the key (NETRC's file too, as W&B's login writes it)
        return "not logged in (wandb login, or WANDB_API_KEY): runs would log offline"
    try:
        import requests
        requests.head(url, timeout=5)
        return f"logged in, {url} reachable"
    except Exception as e:
        return f"{url} unreachable ({str(e).splitlines()[0][:100]}): runs would log offline"


def torchtpu_rows(device_line, train):
    """--device=tpu (TorchTPU): the verdicts a first TPU run needs beyond the common ones, from the runs'
    first line and train records: the graphs torch.compile compiled in each run (a count that grows after
    the first steps is a recompilation), and whether the collectives ran across the chips."""
    runs = []
    for in_run in (lambda step: step <= PREFLIGHT_STEPS, lambda step: step > PREFLIGHT_STEPS):
        seen = [(r['step'], r['xla_compiles_total']) for r in train
                if in_run(r['step']) and 'xla_compiles_total' in r]
        if seen:
            (step, early), late = seen[0], seen[-1][1]
            runs.append(f"{late}" + (f" (still growing: {early} at step {step})" if early != late else ''))
    world = re.search(r'device tpu x(\d+)', device_line)
    n = int(world.group(1)) if world else 0
    return [('TorchTPU graphs compiled', ' then '.join(runs) + ' (the first run, the resumed run)' if runs
             else 'unknown (no training record)'),
            ('collectives across chips', 'NOT checked (no run started)' if not n else
             'one device: none to check' if n == 1 else
             f"{n} processes: each step's gradient all-reduce and gather, and every log line's reduction, "
             f"completed" if train else f"{n} processes started, but no step was logged")]


def preflight(cfg):
    """The check for train.py's config cfg (its command line: sys.argv). Returns the exit code."""
    t0 = time.time()
    out = cfg['out_dir'].rstrip('/') + '/preflight'
    local = os.path.join(cfg['local_dir'], 'preflight') if cfg['local_dir'] else \
        (local_folder(out) if gcs.is_gcs(out) else out)
    os.makedirs(local, exist_ok=True)
    for name in ('metrics.jsonl', 'results.json'):  # an earlier pre-flight's: the verdict reads this one's alone
        if os.path.exists(os.path.join(local, name)):
            os.remove(os.path.join(local, name))
    env = dict(os.environ, PYTHONUNBUFFERED='1')
    alone = host_alone_env()
    env.update({k: v for k, v in alone.items() if v is not None})
    for k in [k for k, v in alone.items() if v is None]:
        env.pop(k, None)
    subset = min(cfg['eval_subset'], PREFLIGHT_EVAL) if cfg['eval_subset'] else PREFLIGHT_EVAL
    watch = min(cfg['watchdog_minutes'], 5) if cfg['watchdog_minutes'] else 0
    common = [a for a in sys.argv[1:]] + [
        '--preflight=False', f'--out_dir={out}', f'--eval_subset={subset}', '--checkpoint_interval=0',
        f'--log_interval={PREFLIGHT_STEPS // 2}', '--wandb_log=False', f'--watchdog_minutes={watch}']
    if cfg['local_dir']:
        common.append(f'--local_dir={local}')
    print(f"preflight: 2 runs of {PREFLIGHT_STEPS} steps into {out} (their output: {local}/phase1.out, phase2.out)"
          + (f", this host's chips alone ({alone.get('TPU_ACCELERATOR_TYPE', '?')} host)" if alone else ''),
          flush=True)
    phases = [['--preflight_phase=1', f'--max_steps={PREFLIGHT_STEPS}', '--init_from=scratch', '--overwrite=True'],
              ['--preflight_phase=2', f'--max_steps={2 * PREFLIGHT_STEPS}', '--init_from=resume']]
    texts, failed = [], ''
    for n, extra in enumerate(phases, 1):
        log = os.path.join(local, f'phase{n}.out')
        rc, secs = run_phase(n, common + extra, env, log)
        texts.append(open(log).read())
        # its part done: its evaluation at its last step recorded (a run stopped early exits 0 too)
        done = rc == 0 and any(r.get('kind') == 'eval' and r.get('step') == n * PREFLIGHT_STEPS
                               for r in read_records(local))
        why = '' if done else f" (over {PHASE_MINUTES} min)" if rc is None else f" (exit {rc})" if rc else \
            f" (exit 0, but no evaluation at step {n * PREFLIGHT_STEPS}: stopped before its end)"
        print(f"preflight: run {n} {'ended' if done else 'FAILED'} in {secs:.0f} s{why}", flush=True)
        if not done or STOP['requested']:
            failed = f"run {n} ({'stopped' if STOP['requested'] else 'see above'})"  # its tail precedes the verdict
            print(tail(log))
            break

    # --- the verdict, from the runs' output and records -------------------------------------------------
    first = next((l for l in texts[0].splitlines() if l.startswith('device ')), '')
    records = read_records(local)
    train = [r for r in records if r.get('kind') == 'train']
    evals = [r for r in records if r.get('kind') == 'eval']
    compiles = [m.group(1) for t in texts for m in [re.search(r'xla: (\d+) graph compilations', t)] if m]
    resumed = len(texts) > 1 and f'(step {PREFLIGHT_STEPS})' in texts[1] and 'resuming from' in texts[1]
    rows = [('device', first.split(' | ')[0][len('device '):] or 'unknown (no run started)'),
            ('TPU chips on the PCI bus', str(tpu_chips()))]
    if train:
        r = train[-1]
        ms = 1e3 * cfg['global_batch_size'] / r['examples_per_s'] if r.get('examples_per_s') else None
        rows.append(('step time', (f"{ms:.1f} ms" if ms else '?') + (
            f" (host {r['host_ms']:.1f} ms, device {r['device_ms']:.1f} ms)" if 'host_ms' in r else '')
            + f", step {r['step']}, loss {r['loss']:.4f}"))
    if compiles:
        rows.append(('XLA graph compilations', ' then '.join(compiles) + ' (the first run, the resumed run)'))
    if cfg['device'] == 'tpu':
        rows += torchtpu_rows(first, train)
    if evals:
        e = evals[-1]
        rows.append(('evaluation', f"{int(e.get('count', subset))} seeded test examples at step {e['step']}: "
                                   f"exact {e['exact_accuracy']:.4f}"))
    rows.append(('save and resume', (f"saved at step {PREFLIGHT_STEPS}, resumed in a new process" if resumed
                                     else 'NOT checked (a run failed first)' if failed else 'NOT resumed')))
    if gcs.is_gcs(out):
        problem = bucket_check(cfg['out_dir'])
        try:
            held = sorted(list_checkpoints(out))
        except Exception as e:
            held, problem = [], problem or f"cannot list {out}: {e}"
        rows.append(('bucket', f"FAILED: {problem}" if problem else
                     f"written and read; checkpoints there: {held}"))
        failed = failed or ('the bucket' if problem else '')
    else:
        rows.append(('bucket', 'none (out_dir is local)'))
    rows.append(('W&B', wandb_check()))
    rows.append(('TensorBoard', 'importable' if importlib.util.find_spec('tensorboard') else 'not installed'))
    failed = failed or ('' if resumed else 'the resume')
    print(f"\n=== pre-flight check ({time.time() - t0:.0f} s): {'FAILED: ' + failed if failed else 'OK'} ===")
    for k, v in rows:
        print(f"  {k:<26} {v}")
    print(f"  {'out_dir':<26} {cfg['out_dir']} untouched; the pre-flight runs are in {out} (safe to delete)")
    return 1 if failed else 0
