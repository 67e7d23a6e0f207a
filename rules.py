"""
The allowed values of train.py's config keys, in one place: train.py checks its config with them before anything
runs, solve.py the model keys it takes, published.py the model keys of an all_config.yaml. A value from a file
passes the same rules as one typed on a command line.
    RULES           key -> (test, what is allowed)
    problems(cfg)   ['key=value (allowed: ...)', ...] for the keys cfg holds, and the rules between the keys
                    of the model's shape
Nothing here imports torch: a config error answers at once.
"""

_pos, _nonneg = (lambda v: v > 0, '> 0'), (lambda v: v >= 0, '>= 0')
_unit = (lambda v: 0 <= v < 1, 'in [0, 1)')
_one_of = lambda *a: (lambda v: v in a, ' | '.join(map(repr, a)))
_range = lambda v: v == '' or (v.count(':') == 1 and all(p.isascii() and p.isdigit() for p in v.split(':'))
                               and int(v.split(':')[0]) < int(v.split(':')[1]))
RULES = dict(out_dir=(lambda v: bool(v.strip()), 'a folder or gs://BUCKET/prefix, not empty'),
             eval_interval=_pos, eval_subset=_nonneg, eval_steps=_nonneg, eval_views=_pos,
             eval_batch_size=_nonneg, log_interval=_pos, checkpoint_interval=_nonneg, keep_last_n=_nonneg,
             global_batch_size=_pos, epochs=_pos, max_steps=_nonneg, max_minutes=_nonneg,
             hidden_size=_pos, num_heads=_pos, expansion=_pos, L_layers=_pos, H_cycles=_pos, L_cycles=_pos,
             halt_max_steps=_pos, halt_exploration_prob=(lambda v: 0 <= v <= 1, 'a probability in [0, 1]'),
             pos_encodings=_one_of('rope', 'learned', 'none'), puzzle_emb_ndim=_nonneg, puzzle_emb_len=_pos,
             forward_dtype=_one_of('auto', 'bfloat16', 'float16', 'float32'), rms_norm_eps=_pos,
             rope_theta=_pos, loss_type=_one_of('stablemax', 'softmax'),
             loss_dtype=_one_of('auto', 'float64', 'float32'),
             lr=_pos, lr_min_ratio=(lambda v: 0 <= v <= 1, 'in [0, 1]'), lr_warmup_steps=_nonneg,
             beta1=_unit, beta2=_unit, weight_decay=_nonneg, puzzle_emb_lr=_nonneg,
             puzzle_emb_weight_decay=_nonneg, ema_rate=_unit, grad_clip=_nonneg,
             gradient_accumulation_steps=_pos,
             device=_one_of('auto', 'cpu', 'cuda', 'xla', 'tpu'), gcs_retries=_pos, watchdog_minutes=_nonneg,
             smoke_phase=_one_of(0, 1, 2), profile_steps=(_range, "'' or 'START:END' with 0 <= START < END"))


def problems(cfg):
    """The values of cfg (any of train.py's keys) that break a rule, each as 'key=value (allowed: ...)', then
    the keys of the model's shape that contradict each other (checked only where each of them is allowed)."""
    broken = {k for k, (ok, _) in RULES.items() if k in cfg and not ok(cfg[k])}
    bad = [f"{k}={cfg[k]!r} (allowed: {RULES[k][1]})" for k in RULES if k in broken]
    usable = lambda *keys: all(k in cfg and k not in broken for k in keys)
    if usable('puzzle_emb_ndim', 'puzzle_emb_len', 'hidden_size') and \
            cfg['puzzle_emb_ndim'] > cfg['puzzle_emb_len'] * cfg['hidden_size']:
        bad.append(f"puzzle_emb_ndim={cfg['puzzle_emb_ndim']} does not fit in puzzle_emb_len * hidden_size = "
                   f"{cfg['puzzle_emb_len']} * {cfg['hidden_size']}: lower it or raise puzzle_emb_len")
    if usable('mlp_t', 'hidden_size', 'num_heads') and not cfg['mlp_t'] and cfg['hidden_size'] % cfg['num_heads']:
        bad.append(f"hidden_size={cfg['hidden_size']} is not divisible by num_heads={cfg['num_heads']} "
                   "(attention: mlp_t=False)")
    return bad
