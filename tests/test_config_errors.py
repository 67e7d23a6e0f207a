"""
Bad configuration: every rule names its key, the value and what is allowed; a config file with a syntax error,
an empty out_dir and a wrong type are one line each.
"""











import pytest

from conftest import assert_user_error, run, train


def test_an_empty_out_dir_and_a_config_file_with_a_syntax_error_are_one_line(toy, tmp_path):
    p = train(toy, '', '--max_steps=2', check=False)
    assert_user_error(p, 'config error', "out_dir=''")
    cfg = tmp_path / 'bad.py'
    cfg.write_text("lr = 1e-3\nx = (\n")
    p = run(['train.py', str(cfg)], check=False)
    assert_user_error(p, 'config error', f'{cfg}, line 2')
    cfg.write_text("lr = 1e-3\nhidden_size = undefined_name\n")
    p = run(['train.py', str(cfg)], check=False)
    assert_user_error(p, 'config error', f'{cfg}, line 2', 'undefined_name')


def test_a_type_error_names_train_py_s_default_not_an_earlier_flag(toy, tmp_path):
    p = run(['train.py', '--L_cycles=3', "--L_cycles='x'"], check=False)
    assert_user_error(p, 'L_cycles', '(default 6)')
    assert '(default 3)' not in p.stdout + p.stderr


RULE_CASES = [('--lr=-1', 'lr=-1'), ('--H_cycles=0', 'H_cycles=0'), ('--L_cycles=0', 'L_cycles=0'),
              ('--ema_rate=2.0', 'ema_rate=2.0'), ('--halt_exploration_prob=5', 'halt_exploration_prob=5'),
              ('--eval_every_epochs=0', 'eval_every_epochs=0'), ('--global_batch_size=0', 'global_batch_size=0'),
              ('--global_batch_size=-4', 'global_batch_size=-4'), ('--hidden_size=-1', 'hidden_size=-1'),
              ('--halt_max_steps=0', 'halt_max_steps=0'), ('--pos_encodings=alibi', "pos_encodings='alibi'"),
              ('--keep_last_n=-1', 'keep_last_n=-1'), ('--forward_dtype=int8', "forward_dtype='int8'")]


@pytest.mark.parametrize('flag,words', RULE_CASES)
def test_each_config_rule_names_key_value_and_what_is_allowed(toy, tmp_path, flag, words):
    p = train(toy, tmp_path / 'o', flag, check=False)
    assert_user_error(p, 'config error', words, 'allowed')


def test_config_keys_is_not_a_key(toy, tmp_path):
    p = train(toy, tmp_path / 'o', '--config_keys=[]', check=False)
    assert_user_error(p, "unknown key 'config_keys'")



@pytest.mark.parametrize('flags,words', [
    (['config/arc1.py', '--hidden_size=16'], ['puzzle_emb_ndim=512 does not fit', '16 * 16']),
    (['--mlp_t=False', '--hidden_size=30', '--num_heads=4'], ['hidden_size=30 is not divisible by num_heads=4']),
    (['--mlp_t=False', '--num_heads=0'], ['num_heads=0 (allowed: > 0)']),
])
def test_keys_that_must_agree_are_a_config_error_before_torch(tmp_path, flags, words):
    """Keys that contradict each other (the model's shape) are one line, said before torch is imported."""
    p = run(['train.py', *flags, f'--out_dir={tmp_path}/o'], check=False, env=dict(PYTHONPROFILEIMPORTTIME='1'))
    imported = {l.split('|')[-1].strip() for l in p.stderr.splitlines() if l.startswith('import time:')}
    p.stderr = '\n'.join(l for l in p.stderr.splitlines() if not l.startswith('import time:'))
    assert_user_error(p, 'config error', *words)
    assert len(p.stderr.strip().splitlines()) == 1 and 'torch' not in imported, p.stderr
