"""
The configuration as a user writes it: every error (a key the trainer does not have, a value of the wrong type,
a config file that does not run, a value a rule does not allow, keys that contradict each other) is one line
naming the key or the file's line, the value and what is allowed, said before torch is imported; and a config
file with flags after it, values holding '=' and an int where a float is expected, run.
    python -m pytest -q tests/test_config_errors.py
"""
import re

import pytest

from configurator import config_problems
from conftest import FAST, TOY_ARGS, assert_user_error, run, step_lines

TOY = ['--data_path={toy}', '--out_dir={out}'] + FAST  # a run that starts, but for the key under test


def case(args, *words, file=None, absent=(), id=None):
    """train.py ARGS ({toy}, {out} and {cfg}, a config file holding `file`, filled in): an error holding words."""
    return pytest.param(args, words, file, absent, id=id)


RULES = [('--lr=-1', 'lr=-1'), ('--H_cycles=0', 'H_cycles=0'), ('--L_cycles=0', 'L_cycles=0'),
         ('--ema_rate=2.0', 'ema_rate=2.0'), ('--halt_exploration_prob=5', 'halt_exploration_prob=5'),
         ('--eval_every_epochs=0', 'eval_every_epochs=0'), ('--global_batch_size=0', 'global_batch_size=0'),
         ('--global_batch_size=-4', 'global_batch_size=-4'), ('--hidden_size=-1', 'hidden_size=-1'),
         ('--halt_max_steps=0', 'halt_max_steps=0'), ('--pos_encodings=alibi', "pos_encodings='alibi'"),
         ('--keep_last_n=-1', 'keep_last_n=-1'), ('--forward_dtype=int8', "forward_dtype='int8'"),
         ('--max_minutes=-1', 'max_minutes=-1', '>= 0'), ('--seed=-1', 'seed=-1', '>= 0'),
         # digits that str.isdigit accepts and int() does not (or reads as another digit)
         ('--profile_steps=²:3', "profile_steps='²:3'"), ('--profile_steps=1:³', "profile_steps='1:³'"),
         ('--profile_steps=١:٣', "profile_steps='١:٣'")]

CASES = [
    # a key the trainer does not have: the nearest keys it has
    case(['--L_cycle=4'], "unknown key 'L_cycle'", 'L_cycles', id='unknown-flag'),
    case(['{cfg}'], "unknown key 'hiden_size'", '{cfg}', 'hidden_size', file="lr = 1e-3\nhiden_size = 8\n",
         id='unknown-in-file'),
    case(TOY + ['--config_keys=[]'], "unknown key 'config_keys'", id='config_keys'),
    case(['--no_such_file.py'], '--no_such_file.py', 'should look like --key=value', id='not-a-flag'),
    # a flag and its value apart: the flag named, not its value read as a config file
    case(['--L_cycles', '4'], '--L_cycles should look like --key=value', absent=['cannot read'],
         id='flag-without-equals'),
    # a value of the wrong type: train.py's default is named, not an earlier flag's value
    case(['--L_cycles=four'], 'L_cycles', 'int', id='type'),
    case(['--L_cycles=3', "--L_cycles='x'"], 'L_cycles', '(default 6)', absent=['(default 3)'], id='type-default'),
    case(['{cfg}'], "L_cycles='x' in {cfg}, line 2", file="lr = 1e-3\nL_cycles = 'x'\n", id='type-in-file'),
    # a boolean spelled otherwise than Python spells it: the two values it takes
    *[case([flag], flag, 'is a bool', 'allowed: True | False', id=flag[2:]) for flag in ('--ema=false', '--ema=0')],
    case(['{cfg}'], "ema='no' in {cfg}, line 1", 'allowed: True | False', file="ema = 'no'\n", id='bool-in-file'),
    # a key given a function or a module: refused, not dropped as the file's own helpers are
    case(['{cfg}'], 'L_cycles=<function', 'is a function, but L_cycles is an int',
         file="def three():\n    return 3\nL_cycles = three\n", id='function-in-file'),
    case(['{cfg}'], "lr=<module 'math'", 'is a module', file="import math as lr\n", id='module-in-file'),
    # a number too large for a float reads as inf, which `> 0` would let through
    case(TOY + ['--lr=1e400'], 'lr=inf in --lr=1e400 is not a finite number', id='inf'),
    case(['{cfg}'], "lr=nan in {cfg}, line 1 is not a finite number", file="lr = float('nan')\n", id='nan-in-file'),
    # None only where the default is None: no key of train.py's
    case(TOY + ['--max_steps=None'], 'max_steps=None in --max_steps=None is None', 'an int (default 0)',
         id='none-flag'),
    case(TOY + ['--seed=None'], 'seed=None', 'an int (default 0)', id='none-seed'),
    case(['{cfg}'], 'max_steps=None in {cfg}, line 2', file="lr = 1e-3\nmax_steps = None\n", id='none-in-file'),
    # a config file that does not run: its path and line
    case(['{cfg}'], '{cfg}, line 2', file="lr = 1e-3\nx = (\n", id='syntax'),
    case(['{cfg}'], '{cfg}, line 2', 'undefined_name', file="lr = 1e-3\nhidden_size = undefined_name\n",
         id='name'),
    # a file cut to nothing (a partial copy) or to its header comment: the defaults, the paper's full recipe, ran
    case(['{cfg}'], '{cfg} sets nothing (it is empty or holds only comments', file='', id='empty'),
    case(['{cfg}'], '{cfg} sets nothing', file="# the quick start's recipe, wider\n", id='comments-only'),
    # `key: value` (a flat YAML file, or a typo for '='): an annotation, which sets nothing
    case(['{cfg}'], "{cfg}, line 2: 'max_steps: 2' sets nothing", 'write max_steps = 2',
         file="lr = 1e-3\nmax_steps: 2\n", id='annotation'),
    # a _base that is no path (True would be open()'s file descriptor 1: stdout)
    case(['{cfg}'], '{cfg}: _base must be a path string, got an int', file="_base = 5\n", id='base-int'),
    case(['{cfg}'], '{cfg}: _base must be a path string, got a list', file="_base = ['config/quickstart.py']\n",
         id='base-list'),
    case(['{cfg}'], '{cfg}: _base must be a path string, got a bool', file="_base = True\n", id='base-bool'),
    # a _base that names no file: the file and line that name it, not only the path it was looked for at
    case(['{cfg}'], "{cfg}, line 2: _base = 'config/nosuch.py'", 'No such file', file="lr = 1e-3\n_base = "
         "'config/nosuch.py'\n", id='base-missing'),
    # a value a rule does not allow: the value and what is allowed
    case(['--data_path={toy}', '--out_dir='] + FAST + ['--max_steps=2'], "out_dir=''", 'allowed', id='out_dir'),
    # an empty data_path would be the working folder, blamed for lacking train/dataset.json after torch's import
    case(['--data_path=', '--out_dir={out}'] + FAST + ['--max_steps=2'], "data_path=''", 'allowed', id='data_path'),
    case(['--data_path=gs://', '--out_dir={out}'] + FAST + ['--max_steps=2'], "data_path='gs://'", 'BUCKET',
         id='data_path-no-bucket'),
    *[case(TOY + [flag], *words, 'allowed', id=flag[2:]) for flag, *words in RULES],
    # a project name W&B refuses: the run would go on without W&B, its start-up saying so among many lines
    case(TOY + ['--wandb_log=True', '--wandb_project=sudoku/mlp'], "wandb_project='sudoku/mlp'", 'allowed', '/',
         id='wandb-project-slash'),
    case(TOY + ['--wandb_log=True', f"--wandb_project={'p' * 129}"], 'wandb_project=', 'allowed', '128',
         id='wandb-project-long'),
    # ... and where it was set: the file and its line, or the flag
    case(['{cfg}', '--out_dir={out}'], 'lr=-1.0 (allowed: > 0), from {cfg}, line 2',
         file="hidden_size = 64\nlr = -1.0\n", id='rule-in-file'),
    case(['{cfg}', '--lr=-2', '--out_dir={out}'], 'lr=-2.0 (allowed: > 0), from --lr=-2', absent=['line'],
         file="lr = -1.0\n", id='rule-flag-over-file'),
    # flags come after every config file, wherever they are typed
    case(['--lr=-2', '{cfg}', '--out_dir={out}'], 'lr=-2.0 (allowed: > 0), from --lr=-2', absent=['line'],
         file="lr = 1e-3\n", id='rule-flag-before-file'),
    # keys that contradict each other (the model's shape)
    case(['config/arc1.py', '--hidden_size=16', '--out_dir={out}'], 'puzzle_emb_ndim=512 does not fit', '16 * 16',
         'from --hidden_size=16', absent=['arc1.py'], id='emb-fit'),
    case(['--mlp_t=False', '--hidden_size=30', '--num_heads=4', '--out_dir={out}'],
         'hidden_size=30 is not divisible by num_heads=4', id='heads-divide'),
    case(['{cfg}', '--num_heads=4', '--out_dir={out}'], 'hidden_size=30 is not divisible by num_heads=4',
         'from {cfg}, lines 1, 3 and --num_heads=4', file="mlp_t = False\nlr = 1e-3\nhidden_size = 30\n",
         id='heads-divide-where'),
    case(TOY + ['--mlp_t=False', '--pos_encodings=rope', '--hidden_size=30', '--num_heads=2'],
         'hidden_size=30 / num_heads=2 = 15', "pos_encodings='rope'", 'mlp_t=False', 'allowed', id='rope-odd-head'),
    case(['--mlp_t=False', '--num_heads=0', '--out_dir={out}'], 'num_heads=0 (allowed: > 0)', id='heads'),
]


@pytest.mark.parametrize('args,words,file,absent', CASES)
def test_a_config_error_is_one_line_before_torch(toy, tmp_path, args, words, file, absent):
    cfg = tmp_path / 'bad.py'
    if file is not None:
        cfg.write_text(file)
    fill = lambda s: s.format(toy=toy, out=tmp_path / 'o', cfg=cfg) if '{' in s else s
    p = run(['train.py', *map(fill, args)], check=False, env=dict(PYTHONPROFILEIMPORTTIME='1'))
    imported = {l.split('|')[-1].strip() for l in p.stderr.splitlines() if l.startswith('import time:')}
    p.stderr = '\n'.join(l for l in p.stderr.splitlines() if not l.startswith('import time:'))
    line = assert_user_error(p, 'config error: ', *map(fill, words), one_line=True)
    assert p.returncode == 1 and 'torch' not in imported, p.stderr
    assert all(l.startswith('config: ') for l in p.stdout.splitlines()), p.stdout  # the flags echoed, nothing more
    assert not any(a in line for a in absent), line
    assert not (tmp_path / 'o').exists()


def test_a_config_file_outside_the_working_folder_is_echoed_by_its_own_path(tmp_path):
    cfg = tmp_path / 'mine.py'
    cfg.write_text("max_steps = -1\n")
    p = run(['train.py', str(cfg)], check=False)
    assert p.stdout.splitlines()[0] == f"config: {cfg}", p.stdout  # not '../../tmp/...' from the repository


def test_rope_needs_an_even_head_dim_in_attention_only():
    """RoPE rotates a head's channels in pairs; mlp_t's blocks have no heads (its RoPE tables go unused)."""
    shape = dict(hidden_size=30, num_heads=2, mlp_t=False, pos_encodings='rope')
    assert config_problems(shape) and not config_problems(dict(shape, mlp_t=True))
    assert not config_problems(dict(shape, pos_encodings='learned'))
    assert not config_problems(dict(shape, hidden_size=32))


def test_cuda_without_a_gpu_is_one_line_before_the_run_writes(toy, tmp_path):
    hidden = dict(CUDA_VISIBLE_DEVICES='')  # a machine without one, wherever this runs
    p = run(['train.py', f'--data_path={toy}', f'--out_dir={tmp_path}/o', *FAST, '--device=cuda'], check=False,
            env=hidden)
    assert_user_error(p, "config error: device='cuda'", '--device=cpu', '--device=auto', one_line=True)
    assert not (tmp_path / 'o').exists()


def test_a_config_file_then_flags_with_values_holding_equals_signs_run(toy, tmp_path):
    good = tmp_path / 'good.py'
    good.write_text(f"data_path = '{toy}'\nmax_steps = 1\nlr = 1\n")  # an int where a float is expected
    p = run(['train.py', str(good), f'--out_dir={tmp_path}/a=b', '--max_steps=2', '--init_from=scratch',
             '--wandb_run_name=x=y'] + TOY_ARGS)
    assert "out_dir = '" + f'{tmp_path}/a=b' in p.stdout and "wandb_run_name = 'x=y'" in p.stdout
    assert 'eval on 200' in p.stdout


def test_a_config_file_is_one_scope_its_functions_and_comprehensions_read_its_names(toy, tmp_path):
    cfg = tmp_path / 'scope.py'
    cfg.write_text(f"data_path = '{toy}'\n_n = 2\ndef _twice(k):\n    return _n * k\n"
                   "globals()['log_interval'] = _twice(1)\n"  # a name set through globals() is set too
                   "max_steps = [_n * i for i in range(3)][-1]\n")
    p = run(['train.py', str(cfg), f'--out_dir={tmp_path}/o', '--epochs=2', '--eval_every_epochs=100'] + TOY_ARGS)
    assert [r['step'] for r in step_lines(p.stdout)] == [2, 4], p.stdout


def test_hidden_size_alone_says_the_reference_ties_the_puzzle_embedding_to_it(toy, tmp_path):
    untied = [a for a in TOY_ARGS if not a.startswith('--puzzle_emb_ndim')]  # hidden_size 32, the embedding 512
    p = run(['train.py', f'--data_path={toy}', f'--out_dir={tmp_path}/a', '--max_steps=1'] + untied)
    assert "note: puzzle_emb_ndim=512 with hidden_size=32: the reference ties them (--puzzle_emb_ndim=32 builds " \
        "its model)" in p.stdout, p.stdout
    for tied in (['--puzzle_emb_ndim=32'], ['--puzzle_emb_ndim=512']):  # tied, or untied on purpose: no note
        p = run(['train.py', f'--data_path={toy}', f'--out_dir={tmp_path}/b{tied[0][-2:]}', '--max_steps=1']
                + untied + tied)
        assert 'note: puzzle_emb_ndim' not in p.stdout, p.stdout


def test_help_says_what_a_config_file_may_set_besides_the_keys():
    # a recipe of one's own is the file of the run it changes plus a few lines: --help is where a user looks
    p = run(['train.py', '--help'])
    assert "_base = 'config/baseline.py'" in p.stdout and 'config keys' in p.stdout, p.stdout[:2000]


def test_the_first_line_says_where_max_steps_ends_the_run_and_where_it_evaluates(toy, tmp_path):
    # the schedule spans `epochs`; --max_steps=3 ends this run before the first interval's evaluation
    p = run(['train.py', f'--data_path={toy}', f'--out_dir={tmp_path}/o', '--max_steps=3', '--epochs=10',
             '--eval_every_epochs=2'] + TOY_ARGS)
    assert re.search(r'\| \d+ steps \(10 epochs of \d+ groups, batch \d+\), this run to step 3 \(max_steps\), '
                     r'eval every \d+ \(this run: at 3\)\n', p.stdout), p.stdout
    # --eval_only evaluates its checkpoint once: the schedule's steps are not what it does
    p = run(['train.py', f'--data_path={toy}', f'--out_dir={tmp_path}/o', '--epochs=10', '--eval_every_epochs=4',
             '--init_from=resume', '--eval_only=True'] + TOY_ARGS)
    assert 'evaluation saved to' in p.stdout and 'this run: at' not in p.stdout, p.stdout


@pytest.mark.parametrize('script,word,flag', [
    ('publish.py', 'init_from=x.pt', '--init_from=x.pt'), ('publish.py', '-init_from=x.pt', '--init_from=x.pt'),
    ('study.py', '\u2014pattern=rec_*', '--pattern=rec_*'), ('bench.py', '\u2013steps=2', '--steps=2')])
def test_a_flag_without_its_two_dashes_is_said_as_a_flag_not_a_missing_config_file(script, word, flag):
    """A key typed with one dash, none, or the dash a text editor makes of two (an en or em dash) was read as a
    config file's name: 'cannot read config file <the repository>/-init_from=x.pt'."""
    said = assert_user_error(run([script, word], check=False), f'config error: {word!r}', f'write {flag}',
                             one_line=True)
    assert 'cannot read' not in said, said


def test_a_checkpoint_missing_from_its_run_folder_names_the_newest_one_there(toy, tmp_path):
    # the README's step after a shorter run, or the run's folder itself: the newest checkpoint in it is named
    run(['train.py', f'--data_path={toy}', f'--out_dir={tmp_path}/a', '--max_steps=2'] + TOY_ARGS)
    newest = f'--init_from={tmp_path}/a/ckpt_00000002.pt'
    for given, what in ((f'{tmp_path}/a/ckpt_00000703.pt', 'no such file on this host'),
                        (f'{tmp_path}/a', 'a folder, not a checkpoint file')):
        p = run(['train.py', f'--data_path={toy}', f'--out_dir={tmp_path}/b', f'--init_from={given}'] + TOY_ARGS,
                check=False)
        assert_user_error(p, f'init_from={given}: {what}; the newest checkpoint there: {newest}')
    p = run(['train.py', f'--data_path={toy}', f'--out_dir={tmp_path}/b', f'--init_from={tmp_path}/none.pt']
            + TOY_ARGS, check=False)  # a folder without checkpoints: what init_from may be
    assert_user_error(p, f'init_from={tmp_path}/none.pt: no such file on this host (init_from is ')
