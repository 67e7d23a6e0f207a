"""
The SkyPilot task files in sky/: each one passes SkyPilot's schema and asks for what the docs say, and what they
run here runs as SkyPilot runs it (bash -i on a script that enters the workdir and exports the task's envs and
SkyPilot's variables), on this CPU with tiny datasets and the GCS emulator as the bucket. A preemption is a
SIGTERM to every process of a node (the notice) or every process killed at once (the VM is gone); the next launch
is a new node (a fresh home and workdir), as after SkyPilot's recovery; a run that is stopped or lost trains at a
real model's pace and holds after a checkpoint until the test has acted (Node.hold_after): the stop comes mid-run.
    python -m pytest -q tests/test_sky.py
SkyPilot itself cannot share the test environment (skypilot 0.14.1 pins click < 8.2, wandb 0.31 needs click >=
8.2): its task and resources schemas are vendored in sky/skypilot_schema.json by sky/check_with_skypilot.py, which
also loads every file with SkyPilot's own parser where SkyPilot is installed.
"""
import copy
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import jsonschema
import pytest
import yaml

from runkeep import gcs
from conftest import BUCKET, ROOT, TOY_ARGS, Lines, below, free_port, site_hook
from runkeep.signals import HUNG_AGAIN_EXIT, HUNG_EXIT
from test_watchdog import hang_at

SKY = os.path.join(ROOT, 'sky')
TASKS = sorted(f for f in os.listdir(SKY) if f.endswith('.yaml'))
SKYPILOT = json.load(open(os.path.join(SKY, 'skypilot_schema.json')))


def task(name, text=None):
    return yaml.safe_load(text if text is not None else open(os.path.join(SKY, name)).read())


def validator(schema):
    """SkyPilot's schema validator: JSON Schema draft 7 and two enum keywords of its own."""
    def enum(case):
        def check(validator, enums, instance, schema):
            if case(instance) not in [case(e) for e in enums]:
                yield jsonschema.ValidationError(f'{instance!r} is not one of {enums!r}')
        return check
    return jsonschema.validators.extend(jsonschema.Draft7Validator, {
        'case_insensitive_enum': enum(str.lower), 'case_sensitive_enum': enum(lambda s: s)})(schema)


def refusals(config, env_overrides=None):
    """What SkyPilot's API server refuses in a task config, as sky.Task.from_yaml_config and
    sky.Resources.from_yaml_config validate it (fields of value None left out, env values as strings, a null env
    not given by --env), plus names it would refuse only at launch: the recovery strategy, the accelerators."""
    config = copy.deepcopy(config)
    envs = {str(k): None if v is None else str(v) for k, v in (config.get('envs') or {}).items()}
    if 'envs' in config:
        config['envs'] = envs
    out = [f"task: {e.message}" for e in validator(SKYPILOT['task_schema']).iter_errors(
        {k: v for k, v in config.items() if v is not None})]
    envs.update(env_overrides or {})
    out += [f"env {k} is null: needs --env {k}=..." for k, v in envs.items() if v is None]
    res = {k: v for k, v in (config.get('resources') or {}).items() if v is not None}
    out += [f"resources: {e.message}" for e in validator(SKYPILOT['resources_schema']).iter_errors(res)]
    recovery = res.get('job_recovery')
    strategy = recovery.get('strategy') if isinstance(recovery, dict) else recovery
    if strategy and str(strategy).lower() not in SKYPILOT['recovery_strategies']:
        out.append(f"job_recovery: no strategy {strategy!r} (SkyPilot's: {SKYPILOT['recovery_strategies']})")
    accelerators = res.get('accelerators') or []
    for name in [accelerators] if isinstance(accelerators, str) else accelerators:
        name = str(name).split(':')[0]
        if name not in SKYPILOT['tpus' if name.startswith('tpu-') else 'gpus']:
            out.append(f"accelerators: {name!r} is not in SkyPilot's list")
    return out


def tpu_runtimes():
    """docs/tpu.md's table: accelerator type -> the runtime (--version) it gives for it."""
    rows = [[c.strip() for c in l.split('|')[1:-1]] for l in open(os.path.join(ROOT, 'docs', 'tpu.md'))
            if l.startswith('| `')]
    return {r[0].split()[0].strip('`'): r[6].strip('`') for r in rows}


def variants(name):
    """The file as written, and the generations its comments name ('# v5e: tpu-v5litepod-8  v6e: ...' after the
    accelerator and after the runtime): {generation: config}."""
    text = open(os.path.join(SKY, name)).read()
    out = {'as written': task(name, text)}
    pairs = re.findall(r'^ *(accelerators|runtime_version): (\S+) +# (.*)$', text, re.M)
    named = {key: dict(re.findall(r'(v\w+): ([\w-]+)', comment)) for key, _, comment in pairs}
    for gen in set(named.get('accelerators', {})) & set(named.get('runtime_version', {})):
        v = copy.deepcopy(out['as written'])
        v['resources'].update(accelerators=named['accelerators'][gen])
        v['resources']['accelerator_args'].update(runtime_version=named['runtime_version'][gen])
        out[gen] = v
    return out


TRAINS = dict(command='python train.py', strategy='FAILOVER', nodes=1)
TPU_SETUP = 'pip install -r requirements.txt "torch_xla[tpu]==2.9.0"'  # the trainer's packages (hub, YAML) too
EXPECTED = {
    'tpu-pod.yaml': dict(TRAINS, tpu='v4-32', variants={'as written', 'v5e', 'v6e'}, setup=TPU_SETUP),
    'tpu-torchtpu.yaml': dict(TRAINS, tpu='v6e-8', variants={'as written'}, setup='requirements-torchtpu.txt',
                              command='python train.py $CONFIG --device=tpu'),
    'gpu.yaml': dict(TRAINS, gpus=1, strategy='EAGER_NEXT_REGION', setup='pip install -r requirements.txt'),
    'gpu-nodes.yaml': dict(gpus=8, nodes=2, strategy='EAGER_NEXT_REGION', setup='pip install -r requirements.txt',
                           command='torchrun --nnodes=$SKYPILOT_NUM_NODES'
                                   ' --nproc_per_node=$SKYPILOT_NUM_GPUS_PER_NODE'),
    'study-pod.yaml': dict(tpu='v4-32', strategy='FAILOVER', nodes=1, variants={'as written', 'v5e', 'v6e'},
                           setup=TPU_SETUP, command='python study.py'),
}


def test_every_task_file_is_described_here():
    assert sorted(EXPECTED) == TASKS


@pytest.mark.parametrize('name', TASKS)
def test_every_task_file_passes_skypilot_s_schema_and_asks_for_what_the_docs_say(name):
    want, runtimes = EXPECTED[name], tpu_runtimes()
    configs = variants(name)
    assert set(configs) == want.get('variants', {'as written'})
    for gen, cfg in configs.items():
        assert refusals(cfg, {'BUCKET': 'my-bucket'}) == [], (name, gen)
        res = cfg['resources']
        if 'tpu' in want:  # a runtime docs/tpu.md gives for that accelerator type
            acc = res['accelerators'][len('tpu-'):]
            assert res['accelerator_args']['runtime_version'] == runtimes[acc], (name, gen, acc)
            assert gen != 'as written' or acc == want['tpu']
        else:
            assert all(n == want['gpus'] for n in res['accelerators'].values()), name
    cfg = configs['as written']
    res, envs, run, setup = cfg['resources'], cfg['envs'], cfg['run'], cfg['setup']
    assert res['use_spot'] is True and res['infra'] == 'gcp' and cfg.get('num_nodes', 1) == want['nodes']
    assert res['job_recovery'] == dict(strategy=want['strategy'], max_restarts_on_errors=0,
                                       recover_on_exit_codes=[HUNG_EXIT])  # and not HUNG_AGAIN_EXIT, nor 1
    assert envs['BUCKET'] is None and envs['RUN'] == '' and cfg['workdir'] == '.'
    assert refusals(cfg) == ["env BUCKET is null: needs --env BUCKET=..."]  # a job without a bucket is refused
    assert want['setup'] in setup and setup.rstrip().endswith('dataset_once'), name
    assert setup.startswith('source sky/job.sh'), name  # its traps first: a notice during pip exits 75
    assert want['command'] in ' '.join(run.split()) and run.count('source sky/job.sh') == 1, name
    assert run.rstrip().splitlines()[-1].startswith('job_exit $?'), name
    if name != 'study-pod.yaml':
        for flag in ('--data_path=gs://$BUCKET/data/$DATA', '--out_dir=gs://$BUCKET/runs/$RUN', '--init_from=resume',
                     '--checkpoint_interval=$CHECKPOINT_INTERVAL', '--wandb_run_name=$RUN'):
            assert flag in run, (name, flag)
        assert run.rstrip().endswith('job_exit $? gs://$BUCKET/runs/$RUN/results.json')
    else:
        assert '--hosts_mode=share --host_index=$SKYPILOT_NODE_RANK' in run and 'fetch_dataset' in run
        assert '--out_root=gs://$BUCKET/studies/$RUN' in run and '--init_from' not in run  # study.py resumes


def test_docs_spot_md_names_each_file_s_accelerators_envs_and_recovery_strategy():
    page = open(os.path.join(ROOT, 'docs', 'spot.md')).read()
    rows = {r[0].strip('` '): r for r in (l.split('|')[1:-1] for l in page.splitlines() if l.startswith('| `sky/'))}
    assert sorted(f[len('sky/'):] for f in rows) == TASKS
    for name in TASKS:
        cfg, row = task(name), rows[f'sky/{name}']
        res = cfg['resources']
        assert row[3].strip(' `') == res['job_recovery']['strategy'], name
        for acc in [res['accelerators']] if isinstance(res['accelerators'], str) else res['accelerators']:
            assert (f'`{acc}`' if acc.startswith('tpu-') else acc) in row[2], (name, acc)
        named = set(re.findall(r'`([A-Z_]+)`', page[page.index('The envs every file takes'):]))
        assert set(cfg['envs']) <= named, (name, set(cfg['envs']) - named)


def test_the_trainer_imports_nothing_of_skypilot():
    import ast
    for f in sorted(f for f in os.listdir(ROOT) if f.endswith('.py')):
        tree = ast.parse(open(os.path.join(ROOT, f)).read())
        names = {a.name.split('.')[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module.split('.')[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert 'sky' not in names, f


MISSPELT = [('use_spot:', 'use_spots:'), ('max_restarts_on_errors:', 'max_restart_on_errors:'),
            ('recover_on_exit_codes:', 'recover_on_exitcodes:'), ('[75]', '[75, 300]'),
            ('strategy: FAILOVER', 'strategy: FAIL_OVER'), ('strategy: EAGER_NEXT_REGION', 'strategy: EAGER'),
            ('runtime_version:', 'runtime_versions:'), ('tpu-v4-32', 'tpu-v4-23'), ('H100: ', 'H1OO: '),
            ('\nsetup:', '\nset_up:'), ('\nenvs:', '\nenv:'), ('\nnum_nodes: 2', '\nnum_nodes: two'),
            ('  RUN:', '  RUN-NAME:')]


@pytest.mark.parametrize('old,new', MISSPELT)
def test_a_misspelt_field_or_name_is_refused(old, new):
    mutated = 0
    for name in TASKS:
        text = open(os.path.join(SKY, name)).read()
        if old in text:
            assert refusals(task(name, text.replace(old, new, 1)), {'BUCKET': 'b'}), (name, old, new)
            mutated += 1
    assert mutated, old  # the test changes something in at least one file


# -----------------------------------------------------------------------------
# the task's setup and run, executed as SkyPilot 0.14.1 executes them (the script its make_task_bash_script writes)

class Node:
    """One VM of a SkyPilot cluster: its own home, with the workdir synced into ~/sky_workdir (the repository's
    files, without out/ and data/, as .gitignore keeps them out), and the task's commands run from there."""

    def __init__(self, root, name, task_file, envs, sky_vars):
        self.home = os.path.join(root, name)
        self.workdir = os.path.join(self.home, 'sky_workdir')
        shutil.copytree(ROOT, self.workdir, ignore=shutil.ignore_patterns(
            '.git', 'out', 'data', 'wandb', 'tests', 'docs', '__pycache__', '.pytest_cache', '*.pyc', '.venv', 'venv',
            '.benchmarks', '*.tmp'))
        self.task = task(task_file)
        self.envs = {k: '' if v is None else str(v) for k, v in self.task['envs'].items()}
        self.envs.update(self.task.get('secrets') or {}, **envs)
        self.sky_vars, self.log, self.run_env = sky_vars, [], {}

    def script(self, what, extra):
        lines = ['#!/bin/bash', '[ -f ~/.bashrc ] && source ~/.bashrc', 'export PYTHONUNBUFFERED=1',
                 'cd ~/sky_workdir']
        lines += [f'export {k}={shlex.quote(v)}' for k, v in {**self.envs, **self.sky_vars, **extra}.items()]
        lines += [self.task[what], '__skypilot_user_exit_code=$?', 'exit $__skypilot_user_exit_code', '']
        path = os.path.join(self.home, f'sky_{what}_{len(self.log)}.sh')
        with open(path, 'w') as f:
            f.write('\n'.join(lines))
        return path

    def hold_after(self, name):
        """The node's run trains at a real model's pace, STEP_S a step at least, and holds before the step after
        its first checkpoint whose path holds `name` until the test has given its notice (notice()): whatever
        the machine's speed, the notice comes well before the run's end, and the stop it asks for (agreed every
        ~2 s of steps: 2 / STEP_S of them at most) too."""
        self.held, self.noticed = os.path.join(self.home, 'held'), os.path.join(self.home, 'noticed')
        self.run_env = dict(site_hook(os.path.join(self.home, 'hook'), HOLD, root=self.workdir), TEST_HOLD_AFTER=name,
                            TEST_HELD=self.held, TEST_NOTICED=self.noticed)
        return self

    def start(self, what, bin_dir):
        extra = dict(SKYPILOT_SETUP_NODE_RANK=self.sky_vars['SKYPILOT_NODE_RANK'],
                     SKYPILOT_SETUP_NODE_IPS=self.sky_vars['SKYPILOT_NODE_IPS']) if what == 'setup' else {}
        env = {k: v for k, v in os.environ.items() if not k.startswith(('SKYPILOT_', 'PJRT_', 'TPU_'))}
        env.update(HOME=self.home, PATH=f"{bin_dir}:{env['PATH']}", WANDB_MODE='disabled', OMP_NUM_THREADS='1',
                   **(self.run_env if what == 'run' else {}))
        proc = subprocess.Popen(['/bin/bash', '-i', self.script(what, extra)], cwd=self.home, env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                bufsize=0, start_new_session=True)
        self.log.append(Lines(proc))
        return self.log[-1]


# Node.hold_after's sitecustomize.py: a run that is preempted or lost mid-run, on every machine. A notice sent
# after a line the run printed races the run to its end: it asks for a stop the ranks agree on only every ~2 s of
# steps, and 40 tiny steps take less than that on a fast machine
STEP_S = 0.1
HOLD = f'''
if sys.argv[0].endswith('train.py') or sys.argv[-1] == '--multiprocessing-fork':  # a trainer, or its worker
    import step
    from runkeep import checkpoint
    real_write, real_step, held = checkpoint.write_checkpoint, step.train_step, []

    def write_checkpoint(state, path, *args, **kwargs):
        out = real_write(state, path, *args, **kwargs)
        if os.environ['TEST_HOLD_AFTER'] in str(path) and not held:
            held.append(str(path))
        return out

    def train_step(*args, **kwargs):
        t = time.time()
        if held and not os.path.exists(os.environ['TEST_NOTICED']):
            with open(os.environ['TEST_HELD'], 'w') as f:
                f.write(held[0])
            while not os.path.exists(os.environ['TEST_NOTICED']):
                time.sleep(0.05)
        out = real_step(*args, **kwargs)
        time.sleep(max(0.0, {STEP_S} - (time.time() - t)))
        return out

    checkpoint.write_checkpoint, step.train_step = write_checkpoint, train_step
'''


def signal_one(pid, sig):
    try:
        os.kill(pid, sig)
    except ProcessLookupError:  # it ended meanwhile
        pass


def signal_all(pid, sig):
    """sig to every process of a node at once, as the VM's shutdown sends SIGTERM to all of them."""
    for p in [pid] + below(pid):  # torchrun's workers and torch_xla's have sessions of their own
        signal_one(p, sig)


def vm_gone(*runs):
    """Every process of the nodes dies at once, as with VMs that are gone: all stopped first (none can exit, save
    or start another), then all killed."""
    while True:
        pids = [p for r in runs for p in [r.proc.pid] + below(r.proc.pid)]
        for p in pids:
            signal_one(p, signal.SIGSTOP)
        if sorted(pids) == sorted(p for r in runs for p in [r.proc.pid] + below(r.proc.pid)):
            break
    for p in pids:
        signal_one(p, signal.SIGKILL)
    for r in runs:
        r.proc.wait()


@pytest.fixture
def bin_dir(tmp_path):
    """What a node's PATH finds first: python and torchrun of this test's environment, and a pip that only
    writes down what it was asked to install (a node here installs nothing)."""
    d = tmp_path / 'bin'
    d.mkdir()
    for name, body in (('python', f'exec {sys.executable} "$@"'),
                       ('torchrun', f'exec {sys.executable} -m torch.distributed.run "$@"'),
                       ('pip', f'echo "$*" >> {tmp_path}/pip.log')):
        (d / name).write_text(f'#!/bin/sh\n{body}\n')
        (d / name).chmod(0o755)
    return str(d)


def ran(lines, timeout=300):
    """The whole output of a setup or run, once it ended, and its exit code."""
    text = lines.rest(timeout)
    return text, lines.proc.returncode


def objects(prefix):
    return sorted(os.path.basename(u) for u, _ in gcs.list_objects(f'gs://{BUCKET}/{prefix}/'))


def last_checkpoint(prefix):
    """The step of the newest checkpoint in the bucket under prefix (0: none)."""
    return max([int(o[5:13]) for o in objects(prefix) if re.fullmatch(r'ckpt_\d{8}\.pt', o)], default=0)


def wait_for_checkpoint(prefix, after, *nodes, timeout=180):
    """Waits, reading the nodes' output meanwhile, until the bucket holds a checkpoint past step `after`."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if last_checkpoint(prefix) > after:
            return last_checkpoint(prefix)
        for lines in nodes:
            lines.drain()
            assert lines.proc.poll() is None, '\n'.join(lines.seen)[-3000:]
        time.sleep(0.2)
    raise AssertionError(f"no checkpoint past step {after} in gs://{BUCKET}/{prefix}:\n"
                         + '\n'.join(nodes[0].seen)[-3000:])


def until_held(node, *nodes, timeout=300):
    """Waits, reading the nodes' output meanwhile, until the node's run holds after its checkpoint (hold_after);
    returns that checkpoint's path."""
    deadline = time.time() + timeout
    while not os.path.exists(node.held):
        for lines in nodes:
            lines.drain()
            assert lines.proc.poll() is None and time.time() < deadline, '\n'.join(lines.seen)[-3000:]
        time.sleep(0.05)
    return open(node.held).read()


def notice(node, *nodes):
    """The preemption notice, once the node's run holds after its checkpoint: SIGTERM to every process of the
    nodes, then the run goes on."""
    until_held(node, *nodes)
    for lines in nodes:
        signal_all(lines.proc.pid, signal.SIGTERM)
    open(node.noticed, 'w').close()


def final_lines(text, run):
    """A finished run's final evaluation and what follows it, up to job.sh's verdict, its name made RUN and the
    seconds a save took made T (the clock's, not the run's: any machine may take 0.1 s where another took 0.0 s)."""
    lines = text[text.rindex('\neval on'):text.rindex('\njob: finished')].replace(run, 'RUN')
    return re.sub(r'(MB in )\d+\.\d s\)', r'\1T s)', lines)


# 60 generated 4x4 Sudokus and a tiny model: 120 steps of batch 50, a checkpoint every 20
SUDOKU4 = dict(DATA='sudoku4-60', BUILD='python prepare_sudoku.py --generate 60 --size 4 --num_test 10',
               CHECKPOINT_INTERVAL='20',
               ARGS=' '.join(TOY_ARGS + ['--mlp_t=False', '--epochs=100', '--eval_every_epochs=1000', '--log_interval=4']))


def one_node(tmp_path, name, task_file, task_id, envs, **sky_vars):
    return Node(str(tmp_path), name, task_file, dict(dict(BUCKET=BUCKET), **envs),
                dict(dict(SKYPILOT_TASK_ID=task_id, SKYPILOT_NODE_RANK='0', SKYPILOT_NODE_IPS='127.0.0.1',
                          SKYPILOT_NUM_NODES='1', SKYPILOT_NUM_GPUS_PER_NODE='1'), **sky_vars))


def launch(node, bin_dir):
    """SkyPilot's launch on a node: setup, then run (started, not waited for)."""
    text, code = ran(node.start('setup', bin_dir))
    assert code == 0, text[-3000:]
    return text, node.start('run', bin_dir)


def test_the_gpu_task_resumes_after_a_preemption_notice_and_after_a_lost_vm(emu, bin_dir, tmp_path):
    # the same job uninterrupted: the line it must end with
    ref_id = 'sky-managed-2026-11-25-10-00-00-000001_trm-gpu_1-0'
    ref = one_node(tmp_path, 'ref', 'gpu.yaml', ref_id, SUDOKU4)
    setup, run = launch(ref, bin_dir)
    assert 'job: building dataset gs://test-bucket/data/sudoku4-60' in setup
    text, code = ran(run)
    assert code == 0 and 'init_from=resume: no checkpoint' in text and 'job: finished' in text, text[-3000:]
    want = final_lines(text, ref_id)
    assert want.count('\n') >= 5 and 'saved' in want, want
    assert open(tmp_path / 'pip.log').read().splitlines()[0] == 'install -r requirements.txt'

    job_id = 'sky-managed-2026-11-25-11-00-00-000002_trm-gpu_2-0'  # SKYPILOT_TASK_ID: one through the recoveries
    out = f'runs/{job_id}'
    # 1. the notice: SIGTERM to every process of the node; the checkpoint is saved, the job exits 75 (run again)
    first = one_node(tmp_path, 'vm1', 'gpu.yaml', job_id, SUDOKU4).hold_after('ckpt_')
    setup, run = launch(first, bin_dir)
    assert 'job: dataset gs://test-bucket/data/sudoku4-60 is there' in setup and 'building' not in setup
    notice(first, run)
    text, code = ran(run, 120)
    assert code == HUNG_EXIT and 'stopped cleanly' in text and 'job: stopped before the end' in text, text[-3000:]
    stopped_at = last_checkpoint(out)
    saved = [l for l in text.splitlines() if l.startswith('saved') and '(stop requested)' in l]
    assert 'results.json' not in objects(out) and f'ckpt_{stopped_at:08d}.pt' in saved[0], text[-3000:]
    # 2. a new VM resumes it; then the VM is gone at once (no notice): its last checkpoint is what the bucket has
    second = one_node(tmp_path, 'vm2', 'gpu.yaml', job_id, SUDOKU4).hold_after('ckpt_')
    setup, run = launch(second, bin_dir)
    assert run.until('resuming from', timeout=300).endswith(f'(step {stopped_at})')
    until_held(second, run)
    lost_at = wait_for_checkpoint(out, stopped_at, run)
    vm_gone(run)
    # 3. a third VM resumes from the bucket and ends as the uninterrupted job did
    third = one_node(tmp_path, 'vm3', 'gpu.yaml', job_id, SUDOKU4)
    setup, run = launch(third, bin_dir)
    text, code = ran(run)
    assert code == 0 and f'gs://{BUCKET}/{out}/results.json is there' in text, text[-3000:]
    assert int(re.search(r'resuming from \S+ \(step (\d+)\)', text).group(1)) >= lost_at
    assert final_lines(text, job_id) == want
    assert 'job: building' not in setup and objects('data').count('sudoku4-60.built') == 1


def test_the_tpu_task_runs_under_torch_xla_s_launcher_and_resumes_after_a_notice(emu, bin_dir, tmp_path):
    """The TPU pod task's own run on the CPU's XLA device (--env PJRT_DEVICE=CPU): torch_xla's launcher and its
    worker, in a process group of its own, stop on the notice; the next VM resumes and ends."""
    pytest.importorskip('torch_xla')  # Linux wheels only
    args = SUDOKU4['ARGS'].replace('--device=cpu', '--device=auto') + ' --max_steps=60'
    envs = dict(SUDOKU4, DATA='sudoku4-60-xla', PJRT_DEVICE='CPU', CPU_NUM_DEVICES='1', ARGS=args)
    job_id = 'sky-managed-2026-11-25-16-00-00-000001_trm-tpu-pod_1-0'
    out = f'runs/{job_id}'
    first = one_node(tmp_path, 'vm1', 'tpu-pod.yaml', job_id, envs).hold_after('ckpt_')
    setup, run = launch(first, bin_dir)
    assert run.until('device xla x1', timeout=300)
    notice(first, run)
    text, code = ran(run, 120)
    assert code == HUNG_EXIT and 'stopped cleanly' in text and 'job: stopped before the end' in text, text[-3000:]
    stopped_at = last_checkpoint(out)
    setup, run = launch(one_node(tmp_path, 'vm2', 'tpu-pod.yaml', job_id, envs), bin_dir)
    text, code = ran(run, 600)
    assert code == 0 and f'(step {stopped_at})' in text and 'step 60/60' in text, text[-3000:]
    assert 'CPU fallbacks: none' in text and f'gs://{BUCKET}/{out}/results.json is there' in text, text[-3000:]


def test_a_config_error_ends_the_job_and_the_watchdog_s_exit_runs_it_again(emu, bin_dir, tmp_path):
    envs = dict(SUDOKU4, DATA='sudoku4-60-errors', ARGS='--lr=-1')
    setup, run = launch(one_node(tmp_path, 'vm', 'gpu.yaml', 'sky-managed-x_trm-gpu_3-0', envs), bin_dir)
    text, code = ran(run)
    assert code == 1 and 'config error: lr=-1' in text and 'job: exit code 1: not run again' in text, text[-3000:]
    # a dataset name whose marker says another command built it: setup stops with one line, and builds nothing
    node = one_node(tmp_path, 'vm2', 'gpu.yaml', 'sky-managed-x_trm-gpu_3-0', dict(envs, BUILD=envs['BUILD'] + '0'))
    text, code = ran(node.start('setup', bin_dir))
    assert code == 1 and 'Traceback' not in text and 'job: building' not in text, text[-3000:]
    assert f"gs://{BUCKET}/data/sudoku4-60-errors was built by '{envs['BUILD']}', not by this job's BUILD" in text
    # job_exit alone: the watchdog's codes pass as they are, a stop before the end becomes 75
    for cmd, want in ((f'job_exit {HUNG_EXIT}', HUNG_EXIT), (f'job_exit {HUNG_AGAIN_EXIT}', HUNG_AGAIN_EXIT),
                      ('job_exit 0 gs://test-bucket/nothing/results.json', HUNG_EXIT),
                      ('kill -TERM $$; job_exit 1', HUNG_EXIT), ('job_exit 0', 0)):
        assert sourced(cmd, bin_dir).returncode == want, cmd


def test_the_multi_node_task_ends_with_its_ranks_watchdog_code_not_torchrun_s(emu, bin_dir, tmp_path):
    """torchrun exits 1 whatever code its ranks failed with: the job ends with theirs, 75 (run again) when the
    watchdog fires, 70 (not) when the next run hangs on the same work (the same node: its watchdog.json), 1."""
    envs = dict(SUDOKU4, DATA='sudoku4-60-hung', ARGS=SUDOKU4['ARGS'] + ' --log_interval=2 --watchdog_minutes=0.05')
    node = one_node(tmp_path, 'vm', 'gpu-nodes.yaml', 'sky-managed-x_trm-gpu-nodes_6-0', envs,
                    SKYPILOT_NUM_GPUS_PER_NODE='2')
    node.run_env = hang_at(tmp_path, 'step 25', root=node.workdir)  # both ranks, in every run
    for want in (HUNG_EXIT, HUNG_AGAIN_EXIT):
        node.envs['MASTER_PORT'] = str(free_port())  # torchrun's rendezvous: a port of its own per launch
        text, code = ran(launch(node, bin_dir)[1])
        assert sorted(re.findall(r'exiting with code (\d+):', text)) == [str(want)] * 2, text[-3000:]
        assert code == want and f'job: exit code {want}' in text, text[-3000:]
    p = sourced('job_torchrun --standalone --nproc_per_node=2 train.py --lr=-1; job_exit $?', bin_dir)
    assert p.returncode == 1 and 'config error: lr=-1' in p.stderr, p.stderr[-3000:]  # a rank's 1 stays 1
    p = sourced('job_torchrun --nproc_per_node', bin_dir)  # a typo in the yaml: torchrun's usage, named so
    assert p.returncode == 2 and 'torchrun: error: argument --nproc-per-node' in p.stderr, p.stderr[-3000:]


def sourced(cmd, bin_dir, bucket=BUCKET):
    """cmd in a bash that sourced sky/job.sh, as a task's setup and run do, with --env BUCKET=bucket."""
    return subprocess.run(['bash', '-c', f'source sky/job.sh; {cmd}'], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, BUCKET=bucket, PATH=f"{bin_dir}:{os.environ['PATH']}"))


@pytest.mark.parametrize('bucket', ['', 'gs://test-bucket', 'Test Bucket', 'test-bucket/data'])
def test_an_empty_or_malformed_bucket_is_refused_at_the_start_in_one_line(emu, bin_dir, tmp_path, bucket):
    node = one_node(tmp_path, 'vm', 'gpu.yaml', 'sky-managed-x_trm-gpu_5-0', dict(SUDOKU4, BUCKET=bucket))
    for what in ('setup', 'run'):
        text, code = ran(node.start(what, bin_dir))
        assert code == 1 and 'Traceback' not in text and 'job: building' not in text, (what, text[-3000:])
        said = [l for l in text.splitlines() if l.startswith('job:')]
        assert len(said) == 1 and said[0].startswith(f"job: BUCKET={bucket!r} is not a bucket name"), text
        assert 'config:' not in text, text  # train.py never started
    assert not os.path.exists(tmp_path / 'pip.log')  # refused before the set-up installs anything


def test_gcs_call_tells_an_absent_object_from_a_failed_call_and_setup_builds_nothing_after_a_failure(
        emu, bin_dir, tmp_path):
    assert sourced(f'gcs_call put gs://{BUCKET}/sky/there x', bin_dir).returncode == 0
    assert sourced(f'gcs_call get gs://{BUCKET}/sky/there', bin_dir).stdout.strip() == 'x'
    for what in ('get', 'exists'):
        absent = sourced(f'gcs_call {what} gs://{BUCKET}/sky/none', bin_dir)
        assert absent.returncode == 3 and absent.stderr == '', (what, absent.stderr)
    assert sourced(f'gcs_call exists gs://{BUCKET}/sky/there', bin_dir).returncode == 0
    # an unexpected error (a URI the client refuses: ValueError) is a failure in one line, not "absent"
    p = sourced('gcs_call exists gs:///data/x.built', bin_dir)
    assert p.returncode == 2 and p.stderr.startswith('job: exists gs:///data/x.built failed'), p.stderr[-3000:]
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    # a dataset's marker that cannot be read as text (UnicodeDecodeError): setup stops, and builds nothing
    gcs.GCS(endpoint=emu).put(f'gs://{BUCKET}/data/sudoku4-60-marker.built', b'\xff\xfe')
    node = one_node(tmp_path, 'vm', 'gpu.yaml', 'sky-managed-x_trm-gpu_6-0', dict(SUDOKU4, DATA='sudoku4-60-marker'))
    text, code = ran(node.start('setup', bin_dir))
    assert code == 1 and 'job: building' not in text and 'Traceback' not in text, text[-3000:]
    assert 'job: cannot tell whether gs://test-bucket/data/sudoku4-60-marker is built' in text, text[-3000:]
    assert objects('data/sudoku4-60-marker') == [], objects('data/sudoku4-60-marker')


def test_a_notice_during_setup_runs_the_job_again(emu, bin_dir, tmp_path):
    """The notice can come while setup installs the packages (minutes on a new VM): SkyPilot then sees a failed
    setup, which it runs again only for a code in recover_on_exit_codes."""
    pip = os.path.join(bin_dir, 'pip')
    with open(pip, 'a') as f:
        f.write('sleep 120\n')  # a long download
    node = one_node(tmp_path, 'vm', 'gpu.yaml', 'sky-managed-x_trm-gpu_4-0', SUDOKU4)
    setup = node.start('setup', bin_dir)
    deadline = time.time() + 60
    while not os.path.exists(tmp_path / 'pip.log'):
        assert time.time() < deadline and setup.proc.poll() is None, '\n'.join(setup.seen)
        time.sleep(0.1)
    signal_all(setup.proc.pid, signal.SIGTERM)
    text, code = ran(setup, 60)
    assert code == HUNG_EXIT, (code, text[-3000:])


def bucket_text(uri, tmp_path):
    path = str(tmp_path / 'downloaded')
    gcs.download_file(uri, path)
    return open(path).read()


# the cpu scale's dataset of rec_* (study_plan.dataset_for), with 50 test puzzles instead of 200 (a shorter test)
STUDY = dict(PATTERN='rec_L2,rec_L4', SLOTS='1', DATA='study-cpu/sudoku4-200-aug-10', PJRT_DEVICE='',
             BUILD='python prepare_sudoku.py --generate 1000 --size 4 --num_test 50 --subsample_size 200 '
                   '--num_aug 10 --seed 0', EXTRA='--max_steps=60 --checkpoint_interval=15', STUDY_ARGS='--scale=cpu')


def test_the_study_task_resumes_its_runs_after_a_notice_and_after_a_lost_vm(emu, bin_dir, tmp_path):
    def finals(task_id):  # each run's final evaluation, as its train.log in the bucket ends with it
        logs = {r: bucket_text(f'gs://{BUCKET}/studies/{task_id}/{r}/train.log', tmp_path) for r in ('rec_L2', 'rec_L4')}
        return {r: [l for l in log.splitlines() if l.startswith('eval on')][-1] for r, log in logs.items()}

    ref_id = 'sky-managed-2026-11-25-12-00-00-000001_trm-study_1-0'
    setup, run = launch(one_node(tmp_path, 'ref', 'study-pod.yaml', ref_id, STUDY), bin_dir)
    assert 'job: building dataset gs://test-bucket/data/study-cpu/sudoku4-200-aug-10' in setup, setup
    text, code = ran(run, 600)
    assert code == 0 and 'job: finished' in text and 'study: building' not in text, text[-3000:]
    want, order = finals(ref_id), re.findall(r'^study: (rec_L\d) \[', text, re.M)  # the study's own order
    assert sorted(order) == ['rec_L2', 'rec_L4'], text[-3000:]

    job_id = 'sky-managed-2026-11-25-13-00-00-000002_trm-study_2-0'
    out = f'studies/{job_id}'
    first = one_node(tmp_path, 'vm1', 'study-pod.yaml', job_id, STUDY).hold_after(f'/{order[0]}/ckpt_')
    setup, run = launch(first, bin_dir)
    assert 'is there' in setup and 'job: building' not in setup
    notice(first, run)
    text, code = ran(run, 120)
    assert code == HUNG_EXIT and 'study: stopped' in text and 'job: stopped before the end' in text, text[-3000:]

    second = one_node(tmp_path, 'vm2', 'study-pod.yaml', job_id, STUDY).hold_after(f'/{order[1]}/ckpt_')
    setup, run = launch(second, bin_dir)
    assert 'resuming from its checkpoint' in run.until(f'study: {order[0]} [', timeout=300)
    until_held(second, run)  # the first run finished, the second under way
    wait_for_checkpoint(f'{out}/{order[1]}', 0, run)
    vm_gone(run)

    third = one_node(tmp_path, 'vm3', 'study-pod.yaml', job_id, STUDY)
    setup, run = launch(third, bin_dir)
    text, code = ran(run, 600)
    assert code == 0 and 'job: finished' in text, text[-3000:]
    assert 'resuming from its checkpoint' in text[text.index(f'study: {order[1]} ['):], text[-3000:]
    summary = text[text.rindex('study: summary'):]
    assert re.search(rf'{order[0]} +done before', summary) and re.search(rf'{order[1]} +done ', summary), summary
    assert finals(job_id) == want


def two_nodes(tmp_path, tag, task_id, envs):
    """Two nodes of one cluster (torchrun's static rendezvous on the first: a port of its own per launch)."""
    port = str(free_port())
    return [Node(str(tmp_path), f'{tag}-{rank}', 'gpu-nodes.yaml', dict(BUCKET=BUCKET, MASTER_PORT=port, **envs),
                 dict(SKYPILOT_TASK_ID=task_id, SKYPILOT_NODE_RANK=str(rank), SKYPILOT_NODE_IPS='127.0.0.1\n127.0.0.1',
                      SKYPILOT_NUM_NODES='2', SKYPILOT_NUM_GPUS_PER_NODE='1')) for rank in (0, 1)]


def launch_all(nodes, bin_dir):
    """Setup on every node at once; once all are done, run on every node."""
    setups = [n.start('setup', bin_dir) for n in nodes]
    for s in setups:
        text, code = ran(s)
        assert code == 0, text[-3000:]
    return [n.start('run', bin_dir) for n in nodes]


def test_the_multi_node_task_resumes_on_two_nodes_after_a_notice_and_after_lost_vms(emu, bin_dir, tmp_path):
    envs = dict(SUDOKU4, DATA='sudoku4-60-nodes')
    ref_id = 'sky-managed-2026-11-25-14-00-00-000001_trm-gpu-nodes_1-0'
    runs = launch_all(two_nodes(tmp_path, 'ref', ref_id, envs), bin_dir)
    (text, code), (text1, code1) = ran(runs[0]), ran(runs[1])
    assert code == code1 == 0 and 'device cpu x2' in text, text[-3000:] + text1[-3000:]
    want = final_lines(text, ref_id)

    job_id = 'sky-managed-2026-11-25-15-00-00-000002_trm-gpu-nodes_2-0'
    out = f'runs/{job_id}'
    nodes = [n.hold_after('ckpt_') for n in two_nodes(tmp_path, 'vm1', job_id, envs)]  # rank 0's node saves
    runs = launch_all(nodes, bin_dir)
    notice(nodes[0], *runs)
    for r in runs:
        text, code = ran(r, 120)
        assert code == HUNG_EXIT and 'job: stopped before the end' in text, text[-3000:]
    stopped_at = last_checkpoint(out)

    nodes = [n.hold_after('ckpt_') for n in two_nodes(tmp_path, 'vm2', job_id, envs)]
    runs = launch_all(nodes, bin_dir)
    assert runs[0].until('resuming from', timeout=300).endswith(f'(step {stopped_at})')
    until_held(nodes[0], *runs)
    wait_for_checkpoint(out, stopped_at, *runs)
    vm_gone(*runs)

    runs = launch_all(two_nodes(tmp_path, 'vm3', job_id, envs), bin_dir)
    (text, code), (text1, code1) = ran(runs[0]), ran(runs[1])
    assert code == code1 == 0 and 'job: finished' in text1, text[-3000:] + text1[-3000:]
    assert final_lines(text, job_id) == want
