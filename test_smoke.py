"""
Tests that run real code on small real runs. Run with:  python -m pytest -q test_smoke.py
Sections: model, optimisers, data, training runs (learning, resume, torchrun, signals, W&B), configurator,
GCS (against a real emulator server), XLA on the CPU (PJRT_DEVICE=CPU), dataset builders, bench.py.
"""
import glob
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import numpy as np
import pytest
import requests
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import gcs  # noqa: E402
from data import EvalLoader, TrainLoader, load_arrays, load_metadata, write_split  # noqa: E402
from model import (TRM, AdamATan2, TRMConfig, act_loss, from_reference_state_dict, lr_at,  # noqa: E402
                   sign_sgd_update_, to_reference_state_dict)

TINY = dict(vocab_size=6, seq_len=8, num_puzzle_identifiers=3, hidden_size=32, num_heads=2, expansion=2.0,
            H_cycles=2, L_cycles=2, halt_max_steps=4, puzzle_emb_ndim=32, puzzle_emb_len=2,
            forward_dtype='float32', loss_dtype='float32')


def run(args, timeout=600, env=None, check=True):
    """Run a script of this repo in a new process, as a user would."""
    e = dict(os.environ, WANDB_MODE='disabled', PYTHONUNBUFFERED='1')
    e.pop('PJRT_DEVICE', None)
    e.update(env or {})
    p = subprocess.run([sys.executable] + args, cwd=HERE, env=e, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{args} exited {p.returncode}\nstdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-4000:]}")
    return p


def make_reverse_dataset(root, n_train=1000, n_test=200, L=8, seed=0):
    """A toy task a tiny TRM learns in a minute: write the input sequence backwards."""
    rng = np.random.default_rng(seed)
    for split, n in (('train', n_train), ('test', n_test)):
        x = rng.integers(2, 6, (n, L))
        write_split(root, split, x, x[:, ::-1], np.zeros(n), np.arange(n + 1), np.arange(n + 1), vocab_size=6)
    return root


@pytest.fixture(scope='module')
def toy(tmp_path_factory):
    return make_reverse_dataset(str(tmp_path_factory.mktemp('toy')))


TOY_ARGS = ['--hidden_size=64', '--num_heads=2', '--mlp_t=True', '--pos_encodings=none', '--puzzle_emb_ndim=0',
            '--H_cycles=2', '--L_cycles=2', '--halt_max_steps=4', '--global_batch_size=50', '--lr=2e-3',
            '--lr_warmup_steps=10', '--weight_decay=0.1', '--forward_dtype=float32', '--loss_dtype=float32',
            '--device=cpu', '--ema_rate=0.95', '--xla_cache_dir=']


# -----------------------------------------------------------------------------
# model

def test_parameter_counts_match_the_reference():
    assert TRM(TRMConfig(mlp_t=True, pos_encodings='none')).num_params() == 5_028_866
    att = TRM(TRMConfig(mlp_t=False, pos_encodings='rope')).num_params()
    assert att == 6_828_034  # ~6.83M (TRM_SPEC section 1)


def reference_forward(sd, cfg, inputs, puzzle_ids, n_steps):
    """TRM written straight from TRM_SPEC sections 1-2 as plain functions over the REFERENCE's key names,
    independent of model.py: what the reference computes with these weights."""
    p = lambda k: sd['_orig_mod.model.inner.' + k].double()
    D, P, eps = cfg.hidden_size, cfg.puzzle_emb_len, cfg.rms_norm_eps
    rms = lambda h: h / torch.sqrt((h * h).mean(-1, keepdim=True) + eps)

    def swiglu(h, prefix):
        gu = h @ p(prefix + '.gate_up_proj.weight').T
        g, u = gu.chunk(2, -1)
        return (F.silu(g) * u) @ p(prefix + '.down_proj.weight').T

    hd = D // cfg.num_heads
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = torch.outer(torch.arange(cfg.seq_len + P, dtype=torch.float64), inv)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()

    def attn(h, i):
        B, L, _ = h.shape
        qkv = (h @ p(f'L_level.layers.{i}.self_attn.qkv_proj.weight').T).view(B, L, 3, cfg.num_heads, hd)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        rot = lambda t: torch.cat([-t[..., hd // 2:], t[..., :hd // 2]], -1)
        if cfg.pos_encodings == 'rope':
            q = q * cos[:, None] + rot(q) * sin[:, None]
            k = k * cos[:, None] + rot(k) * sin[:, None]
        a = torch.softmax(torch.einsum('bqhd,bkhd->bhqk', q, k) / math.sqrt(hd), -1)
        o = torch.einsum('bhqk,bkhd->bqhd', a, v).reshape(B, L, D)
        return o @ p(f'L_level.layers.{i}.self_attn.o_proj.weight').T

    def net(h, inj):
        h = h + inj
        for i in range(cfg.L_layers):
            if cfg.mlp_t:
                h = rms((h.transpose(1, 2) + swiglu(h.transpose(1, 2), f'L_level.layers.{i}.mlp_t'))).transpose(1, 2)
            else:
                h = rms(h + attn(h, i))
            h = rms(h + swiglu(h, f'L_level.layers.{i}.mlp'))
        return h

    B = inputs.shape[0]
    emb = p('embed_tokens.embedding_weight')[inputs.long()]
    pe = torch.zeros(B, P * D, dtype=torch.float64)
    pe[:, :cfg.puzzle_emb_ndim] = p('puzzle_emb.weights')[puzzle_ids.long()]
    x = torch.cat([pe.view(B, P, D), emb], 1)
    if cfg.pos_encodings == 'learned':
        x = 0.707106781 * (x + p('embed_pos.embedding_weight'))
    x = math.sqrt(D) * x
    y = p('H_init').expand(B, cfg.seq_len + P, D)
    z = p('L_init').expand(B, cfg.seq_len + P, D)
    for _ in range(n_steps):
        for _ in range(cfg.H_cycles):
            for _ in range(cfg.L_cycles):
                z = net(z, y + x)
            y = net(y, z)
    logits = (y @ p('lm_head.weight').T)[:, P:]
    q = y[:, 0] @ p('q_head.weight').T + p('q_head.bias')
    return logits, q


@pytest.mark.parametrize('variant', [dict(mlp_t=False, pos_encodings='rope'), dict(mlp_t=False, pos_encodings='learned'),
                                     dict(mlp_t=True, pos_encodings='none')])
def test_reference_checkpoint_loads_and_computes_the_reference_outputs(variant):
    torch.manual_seed(0)
    cfg = TRMConfig(**dict(TINY, **variant))
    # a checkpoint as the reference saves it: random weights everywhere, including the zero-initialised
    # puzzle embedding and q head, so every tensor matters
    sd = {k: torch.randn_like(v) * (0.1 if v.dim() > 1 else 1.0) for k, v in TRM(cfg).state_dict().items()}
    ref_sd = to_reference_state_dict(sd)
    assert all(k.startswith('_orig_mod.model.inner.') for k in ref_sd)
    assert '_orig_mod.model.inner.L_level.layers.1.mlp.gate_up_proj.weight' in ref_sd
    assert '_orig_mod.model.inner.puzzle_emb.weights' in ref_sd
    assert ('_orig_mod.model.inner.L_level.layers.0.mlp_t.down_proj.weight' in ref_sd) == cfg.mlp_t
    inputs = torch.randint(0, 6, (3, 8))
    ids = torch.tensor([0, 2, 1])
    want_logits, want_q = reference_forward(ref_sd, cfg, inputs, ids, n_steps=2)
    for keys in (ref_sd, {k[len('_orig_mod.model.'):]: v for k, v in ref_sd.items()}):  # prefixed and not
        m = TRM(cfg)
        m.load_state_dict(from_reference_state_dict(keys))
        preds, q_halt = m.predict(dict(inputs=inputs, puzzle_identifiers=ids), n_steps=2)
        # the model's own last logits: run heads on the same recursion
        y, z = m.init_latents(3, 'cpu')
        x = m.input_embeddings(inputs, m.puzzle_rows(ids))
        with torch.no_grad():
            for _ in range(2):
                y, z = m.recursion(y, z, x)
            logits, qh, qc = m.heads(y)
        torch.testing.assert_close(logits.double(), want_logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(qh.double(), want_q[:, 0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(qc.double(), want_q[:, 1], rtol=1e-4, atol=1e-4)
        assert torch.equal(preds[-1], want_logits.argmax(-1).int())
        torch.testing.assert_close(q_halt[-1].double(), want_q[:, 0], rtol=1e-4, atol=1e-4)


def test_fresh_model_matches_the_reference_initialisation():
    m = TRM(TRMConfig(**TINY))
    assert torch.all(m.q_head.weight == 0) and torch.all(m.q_head.bias == -5)
    assert torch.all(m.puzzle_emb == 0)
    names = {n for n, _ in m.named_parameters()}
    assert not {'puzzle_emb', 'H_init', 'L_init'} & names  # buffers: no optimizer, no EMA
    w = m.net.layers[0].mlp.gate_up_proj.weight
    assert w.abs().max() <= 2 * 1.0 / math.sqrt(32) / 0.8796 + 1e-6  # truncated at 2 sigma
    assert abs(w.std().item() * math.sqrt(32) - 1) < 0.1


def act_batch(B, seed):
    g = torch.Generator().manual_seed(seed)
    return dict(inputs=torch.randint(0, 6, (B, 8), generator=g, dtype=torch.int32),
                labels=torch.randint(2, 6, (B, 8), generator=g, dtype=torch.int32),
                puzzle_identifiers=torch.randint(0, 3, (B,), generator=g, dtype=torch.int32))


def test_act_semantics_on_a_hand_made_batch():
    torch.manual_seed(0)
    cfg = TRMConfig(**dict(TINY, halt_exploration_prob=0.0))
    m = TRM(cfg).train()
    b1, b2 = act_batch(4, 1), act_batch(4, 2)
    carry = m.refill(m.initial_carry(b1), b1)
    assert torch.equal(carry['inputs'], b1['inputs']) and torch.all(carry['steps'] == 0)
    assert torch.equal(carry['y'][0, 0], m.H_init) and torch.equal(carry['z'][3, 5], m.L_init)
    carry, out = m(carry)
    assert torch.all(carry['steps'] == 1) and not carry['halted'].any()  # q_halt starts at -5: no halting
    # make row 1 halt by hand: next call must reset it and load b2's row 1, keep the others
    carry['halted'] = torch.tensor([False, True, False, False])
    y_before = carry['y'].clone()
    carry = m.refill(carry, b2)
    assert torch.equal(carry['inputs'][1], b2['inputs'][1])
    assert torch.equal(carry['inputs'][0], b1['inputs'][0]) and torch.equal(carry['inputs'][2], b1['inputs'][2])
    assert torch.equal(carry['steps'], torch.tensor([1, 0, 1, 1], dtype=torch.int32))
    assert torch.equal(carry['y'][1, 0], m.H_init) and torch.equal(carry['y'][0], y_before[0])
    m2 = TRM(cfg).train()
    c = m2.refill(m2.initial_carry(b1), b1)
    halted_at = []
    for s in range(1, 9):
        c, _ = m2(c)
        halted_at.append(c['halted'].clone())
        assert torch.all(c['steps'] <= cfg.halt_max_steps)
        c = m2.refill(c, b1)
    assert [bool(h.all()) for h in halted_at] == [False, False, False, True] * 2  # forced halt at 4, then restart

    # q_halt > 0 halts early in training, never in eval (evaluation always runs halt_max_steps)
    with torch.no_grad():
        m2.q_head.bias.fill_(5.0)
    c = m2.refill(m2.initial_carry(b1), b1)
    c, _ = m2(c)
    assert c['halted'].all() and torch.all(c['steps'] == 1)
    m2.eval()
    c = m2.refill(m2.initial_carry(b1), b1)
    c, _ = m2(c)
    assert not c['halted'].any()


def test_exploration_sets_a_minimum_number_of_steps():
    torch.manual_seed(0)
    cfg = TRMConfig(**dict(TINY, halt_exploration_prob=1.0, halt_max_steps=6))
    m = TRM(cfg).train()
    with torch.no_grad():
        m.q_head.bias.fill_(5.0)  # the q head always says halt ...
    b = act_batch(256, 3)
    c = m.refill(m.initial_carry(b), b)
    lengths = torch.zeros(256, dtype=torch.int32)
    done = torch.zeros(256, dtype=torch.bool)
    for s in range(1, 7):
        c, _ = m(c)
        lengths = torch.where(c['halted'] & ~done, c['steps'], lengths)
        done |= c['halted']
        c = m.refill(c, b)
    # ... but every row explores: it halts after a number of steps drawn from [2, halt_max_steps]
    assert done.all() and lengths.min() == 2 and lengths.max() == 6
    assert len(torch.unique(lengths)) == 5


def test_bootstrapped_q_continue_and_softmax_loss_work():
    """Both paths crash in the reference (TRM_SPEC section 8)."""
    torch.manual_seed(0)
    for extra in (dict(no_ACT_continue=False), dict(loss_type='softmax'), dict(loss_dtype='float64')):
        cfg = TRMConfig(**dict(TINY, **extra))
        m = TRM(cfg).train()
        b = act_batch(4, 0)
        c, out = m(m.refill(m.initial_carry(b), b))
        loss, metrics = act_loss(c, out, cfg)
        loss.backward()
        assert torch.isfinite(loss)
        if not cfg.no_ACT_continue:
            assert out['target_q_continue'].shape == (4,) and metrics['q_continue_loss'] > 0
        assert m.q_head.weight.grad is not None


def test_stablemax_loss_matches_its_formula():
    from model import token_losses
    logits = torch.tensor([[[-1.0, 0.0, 2.0]]], dtype=torch.float64)
    s = torch.tensor([1 / 2, 1.0, 3.0], dtype=torch.float64)
    want = -math.log(s[2] / s.sum())
    got = token_losses(logits, torch.tensor([[2]]), 'stablemax', 'float64')
    assert abs(got.item() - want) < 1e-12
    assert token_losses(logits, torch.tensor([[-100]]), 'stablemax', 'float64').item() == 0


def test_flops_count_the_no_grad_passes():
    m = TRM(TRMConfig(mlp_t=True, pos_encodings='none'))
    f_eval, f_train = m.flops_per_example(train=False), m.flops_per_example()
    # one net call on 97 tokens: 2 * params * tokens for the channel MLPs, 2 * params * D for mlp_t
    per_call = 2 * (2 * 2359296 * 97 + 2 * 148992 * 512)
    assert f_eval == 21 * per_call + 2 * 512 * 11 * 81 + 2 * 512 * 2
    assert f_train == f_eval + 2 * (7 * per_call + 2 * 512 * 11 * 81 + 2 * 512 * 2)


# -----------------------------------------------------------------------------
# optimisers

def test_adam_atan2_step_matches_the_formula():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5, 3))
    p0 = p.detach().clone()
    grads = [torch.randn(5, 3), torch.randn(5, 3)]
    lr, wd, b1, b2 = 0.01, 0.5, 0.9, 0.95
    opt = AdamATan2([p], lr=lr, betas=(b1, b2), weight_decay=wd)
    m = torch.zeros(5, 3)
    v = torch.zeros(5, 3)
    want = p0.clone()
    for t, g in enumerate(grads, start=1):
        p.grad = g.clone()
        opt.step()
        want = want * (1 - lr * wd)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        want = want - lr / (1 - b1 ** t) * torch.atan2(m, v.sqrt() / math.sqrt(1 - b2 ** t))
        torch.testing.assert_close(p.detach(), want, rtol=1e-6, atol=1e-7)


def test_sign_sgd_touches_only_the_batch_rows():
    table = torch.arange(12, dtype=torch.float32).view(4, 3) / 10
    before = table.clone()
    ids = torch.tensor([1, 3, 1])
    grads = torch.tensor([[1.0, -2.0, 0.0], [-1.0, 1.0, 3.0], [-3.0, 1.0, 0.0]])
    lr, wd = 0.1, 0.5
    sign_sgd_update_(table, ids, grads, lr, wd)
    # id 1: gradient sum [-2, -1, 0]; id 3: [-1, 1, 3]; ids 0 and 2 untouched (no decay either)
    assert torch.equal(table[0], before[0]) and torch.equal(table[2], before[2])
    torch.testing.assert_close(table[1], before[1] * (1 - lr * wd) - lr * torch.tensor([-1.0, -1.0, 0.0]))
    torch.testing.assert_close(table[3], before[3] * (1 - lr * wd) - lr * torch.tensor([-1.0, 1.0, 1.0]))


def test_lr_schedule_warmup_cosine_and_never_zero():
    assert lr_at(0, 1.0, 10, 100, 0.1).item() > 0
    assert abs(lr_at(4, 1.0, 10, 100, 0.1).item() - 0.5) < 1e-6
    assert abs(lr_at(9, 1.0, 10, 100, 0.1).item() - 1.0) < 1e-6
    assert abs(lr_at(99, 1.0, 10, 100, 0.1).item() - 0.1) < 1e-6
    assert abs(lr_at(54, 1.0, 10, 100, 0.1).item() - 0.55) < 1e-2
    assert lr_at(500, 1.0, 10, 100, 1.0).item() == 1.0  # the reference default: constant after warmup


# -----------------------------------------------------------------------------
# data

def grouped_dataset(root):
    """3 groups with 1, 2 and 3 puzzles; puzzles with 1-4 examples; distinct ids per puzzle."""
    sizes = [2, 1, 3, 4, 1, 2]
    n = sum(sizes)
    x = np.arange(n)[:, None] * np.ones((1, 4), dtype=np.int64) % 50 + 2
    puzzle_indices = np.concatenate([[0], np.cumsum(sizes)])
    write_split(root, 'train', x, x, np.arange(6) % 4, puzzle_indices, [0, 1, 3, 6], vocab_size=60,
                num_puzzle_identifiers=4)
    return root


def test_train_loader_is_seeded_resumable_and_sliced_by_rank(tmp_path):
    root = grouped_dataset(str(tmp_path))
    a = TrainLoader(root, 4, seed=3)
    seq = [a.next_global_indices() for _ in range(10)]
    assert all(len(ex) == 4 for ex, _ in seq)  # always the full global batch
    b = TrainLoader(root, 4, seed=3)
    for _ in range(4):
        b.next_global_indices()
    state = b.state_dict()
    c = TrainLoader(root, 4, seed=3)
    c.load_state_dict(state)
    for i in range(4, 10):
        ex, pz = c.next_global_indices()
        assert np.array_equal(ex, seq[i][0]) and np.array_equal(pz, seq[i][1])
    # examples belong to the puzzle they are listed with, and each puzzle's examples are distinct
    pi = load_arrays(root, 'train')['puzzle_indices']
    for ex, pz in seq:
        assert np.all((ex >= pi[pz]) & (ex < pi[pz + 1]))
    other = TrainLoader(root, 4, seed=4)
    assert any(not np.array_equal(other.next_global_indices()[0], ex) for ex, _ in seq)  # the seed matters
    # every rank takes its slice of the same global batch
    r0, r1 = TrainLoader(root, 4, rank=0, world_size=2, seed=3), TrainLoader(root, 4, rank=1, world_size=2, seed=3)
    full = TrainLoader(root, 4, seed=3).next_batch()
    both = np.concatenate([r0.next_batch()['inputs'], r1.next_batch()['inputs']])
    assert np.array_equal(both, full['inputs'])


def test_train_loader_visits_every_group_once_per_epoch(tmp_path):
    root = make_reverse_dataset(str(tmp_path), n_train=20, n_test=4)
    ld = TrainLoader(root, 5, seed=0)
    seen = np.concatenate([ld.next_global_indices()[0] for _ in range(4)])
    assert sorted(seen) == list(range(20)) and ld.epoch == 1 and ld.cursor == 0
    assert ld.steps_for(3) == 12


def test_eval_loader_pads_the_last_batch(tmp_path):
    root = make_reverse_dataset(str(tmp_path), n_train=8, n_test=10)
    batches = list(EvalLoader(root, 4))
    assert len(batches) == 3 and all(b['inputs'].shape == (4, 8) for b in batches)
    last = batches[-1]
    assert last['valid'].tolist() == [True, True, False, False]
    assert np.all(last['labels'][2:] == -100) and np.all(last['inputs'][2:] == 0)
    # a seeded subset is fixed
    s1, s2 = EvalLoader(root, 4, subset=6, seed=1), EvalLoader(root, 4, subset=6, seed=1)
    assert np.array_equal(s1.example_idx, s2.example_idx) and len(s1.example_idx) == 6


def test_evaluation_counts_only_real_rows(tmp_path):
    import importlib
    root = make_reverse_dataset(str(tmp_path), n_train=8, n_test=10)
    sys.argv = ['train.py']
    train = importlib.import_module('train')
    torch.manual_seed(0)
    cfg = TRMConfig(**dict(TINY, num_puzzle_identifiers=1))
    m = TRM(cfg)
    dev = train.Device('cpu')
    res, _ = train.evaluate(m, EvalLoader(root, 4), dev, 4, 4)
    assert res['count'] == 10
    # the same numbers computed row by row over the 10 real examples
    arrays = load_arrays(root, 'test')
    inputs = torch.tensor(np.asarray(arrays['inputs']), dtype=torch.int32)
    labels = torch.tensor(np.asarray(arrays['labels']))
    preds, _ = m.predict(dict(inputs=inputs, puzzle_identifiers=torch.zeros(10, dtype=torch.int32)), 4)
    tok = (preds[-1] == labels).float().mean(-1)
    assert abs(res['token_accuracy'] - tok.mean().item()) < 1e-6
    assert abs(res['exact_accuracy'] - (tok == 1).float().mean().item()) < 1e-6
    lo, hi = res['exact_ci_low'], res['exact_ci_high']
    assert 0 <= lo <= res['exact_accuracy'] <= hi <= 1


# -----------------------------------------------------------------------------
# training runs (real processes, as a user runs them)

def eval_lines(out):
    return [l for l in out.splitlines() if l.startswith('eval on')]


def step_lines(out):
    rows = []
    for l in out.splitlines():
        if l.startswith('step '):
            row = {}
            for field in l.split('|'):  # 'step 20/320', 'loss 1.23', ..., '456 ex/s'
                a, b = field.split()
                key, val = (b, a) if b == 'ex/s' else (a, b.split('/')[0])
                row[key] = float(val)
            rows.append(row)
    return rows


def test_a_tiny_trm_learns(toy, tmp_path):
    p = run(['train.py', f'--data_path={toy}', f'--out_dir={tmp_path}/out', '--epochs=16', '--eval_interval=8',
             '--log_interval=20'] + TOY_ARGS)
    rows = step_lines(p.stdout)
    print('\n'.join(l for l in p.stdout.splitlines() if l.startswith(('step', 'eval'))))
    assert rows[-1]['loss'] < 0.5 * rows[0]['loss']
    assert rows[-1]['acc'] > 0.9
    final = eval_lines(p.stdout)[-1]
    exact = float(final.split('exact ')[1].split()[0])
    assert exact > 0.5, final  # chance is 4^-8
    assert 'verified' not in final  # no verifier for a toy task


def final_state(path):
    ck = torch.load(path, weights_only=True)
    return ck


def assert_same_state(a, b, exact=True):
    for key in ('model', 'ema'):
        for k in a[key]:
            if exact:
                assert torch.equal(a[key][k], b[key][k]), (key, k)
            else:
                torch.testing.assert_close(a[key][k], b[key][k], rtol=1e-4, atol=5e-5, msg=f'{key} {k}')  # float noise ~1e-5; a step moves ~1e-3


def test_resume_continues_exactly(toy, tmp_path):
    common = [f'--data_path={toy}', '--epochs=4', '--eval_interval=100', '--log_interval=5', '--puzzle_emb_ndim=16',
              '--halt_exploration_prob=0.5'] + TOY_ARGS
    common = [a for a in common if not a.startswith('--puzzle_emb_ndim=0')]
    run(['train.py', f'--out_dir={tmp_path}/straight', '--max_steps=16'] + common)
    run(['train.py', f'--out_dir={tmp_path}/split', '--max_steps=8'] + common)
    assert os.path.exists(f'{tmp_path}/split/ckpt_00000008.pt')
    p = run(['train.py', f'--out_dir={tmp_path}/split', '--max_steps=16', '--init_from=resume'] + common)
    assert 'resuming from' in p.stdout and 'step 8' in p.stdout
    a = final_state(f'{tmp_path}/straight/ckpt_00000016.pt')
    b = final_state(f'{tmp_path}/split/ckpt_00000016.pt')
    assert_same_state(a, b, exact=True)
    assert torch.equal(a['model']['puzzle_emb'], b['model']['puzzle_emb']) and a['model']['puzzle_emb'].abs().sum() > 0
    for k in a['carry']:
        assert torch.equal(a['carry'][k], b['carry'][k]), k
    assert a['loader'] == b['loader'] and a['step'] == b['step'] == 16


def test_torchrun_two_processes_equal_one(toy, tmp_path):
    common = [f'--data_path={toy}', '--epochs=2', '--eval_interval=100', '--log_interval=10', '--max_steps=10',
              '--halt_exploration_prob=0.0', '--puzzle_emb_ndim=16'] + TOY_ARGS
    common = [a for a in common if not a.startswith('--puzzle_emb_ndim=0')]
    run(['train.py', f'--out_dir={tmp_path}/one'] + common)
    run(['-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', 'train.py', f'--out_dir={tmp_path}/two']
        + common, env=dict(OMP_NUM_THREADS='1'))
    a = final_state(f'{tmp_path}/one/ckpt_00000010.pt')
    b = final_state(f'{tmp_path}/two/ckpt_00000010.pt')
    assert_same_state(a, b, exact=False)
    torch.testing.assert_close(a['model']['puzzle_emb'], b['model']['puzzle_emb'])
    assert b['carry']['inputs'].shape[0] == 50  # the whole global batch's carry is saved


def test_sigterm_saves_and_resume_continues(toy, tmp_path):
    args = ['train.py', f'--data_path={toy}', f'--out_dir={tmp_path}/o', '--epochs=200', '--eval_interval=1000',
            '--log_interval=1'] + TOY_ARGS
    e = dict(os.environ, WANDB_MODE='disabled', PYTHONUNBUFFERED='1')
    proc = subprocess.Popen([sys.executable] + args, cwd=HERE, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = []
    for line in proc.stdout:
        out.append(line)
        if line.startswith('step 3/'):
            proc.send_signal(signal.SIGTERM)
            break
    rest, _ = proc.communicate(timeout=120)
    out = ''.join(out) + rest
    assert proc.returncode == 0, out
    assert 'stopped cleanly' in out
    ckpts = glob.glob(f'{tmp_path}/o/ckpt_*.pt')
    assert len(ckpts) == 1
    step = torch.load(ckpts[0], weights_only=True)['step']
    assert step >= 3
    p = run(args + ['--init_from=resume', f'--max_steps={step + 2}'])
    assert f'resuming from' in p.stdout and f'step {step + 2}/' in p.stdout


def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(toy, tmp_path):
    args = ['train.py', f'--data_path={toy}', f'--out_dir={tmp_path}/o', '--epochs=1', '--eval_interval=100',
            '--log_interval=5', '--checkpoint_interval=5'] + TOY_ARGS
    run(args + ['--max_steps=5'])
    p = run(args + ['--init_from=resume', '--lr=1e30', '--lr_warmup_steps=1'], check=False)
    assert p.returncode != 0
    assert 'loss became NaN or inf at step' in p.stdout + p.stderr
    assert sorted(os.listdir(f'{tmp_path}/o')) == ['ckpt_00000005.pt']


def test_truncated_checkpoint_is_reported_and_not_loaded(toy, tmp_path):
    import importlib
    sys.argv = ['train.py']
    train = importlib.import_module('train')
    args = ['train.py', f'--data_path={toy}', f'--out_dir={tmp_path}/o', '--epochs=1', '--eval_interval=100',
            '--log_interval=2', '--checkpoint_interval=2'] + TOY_ARGS
    run(args + ['--max_steps=4', '--keep_last_n=3'])
    newest = f'{tmp_path}/o/ckpt_00000004.pt'
    data = open(newest, 'rb').read()
    open(newest, 'wb').write(data[:len(data) // 2])
    with pytest.raises(train.CheckpointError, match='ckpt_00000004.pt is corrupt or truncated'):
        train.load_checkpoint(newest)
    # resume reports it and continues from the newest good one
    p = run(args + ['--init_from=resume', '--max_steps=6'])
    assert 'ckpt_00000004.pt is corrupt or truncated' in p.stdout
    assert 'resuming from' in p.stdout and '(step 2)' in p.stdout


def test_wandb_offline_run_is_continued_after_resume(toy, tmp_path):
    args = ['train.py', f'--data_path={toy}', f'--out_dir={tmp_path}/o', '--epochs=1', '--eval_interval=100',
            '--log_interval=2', '--wandb_log=True', '--wandb_run_name=smoke'] + TOY_ARGS
    env = dict(WANDB_MODE='offline', WANDB_SILENT='true')
    run(args + ['--max_steps=4'], env=env)
    run(args + ['--max_steps=6', '--init_from=resume'], env=env)
    runs = sorted(glob.glob(f'{tmp_path}/o/wandb/offline-run-*'))
    assert len(runs) == 2
    ids = {r.rsplit('-', 1)[1] for r in runs}
    assert len(ids) == 1  # the same run id both times
    ck = torch.load(f'{tmp_path}/o/ckpt_00000006.pt', weights_only=True)
    assert ck['wandb_run_id'] == ids.pop()


# -----------------------------------------------------------------------------
# configurator

def test_configurator_errors_and_overrides(toy, tmp_path):
    p = run(['train.py', '--L_cycle=4'], check=False)
    assert p.returncode != 0 and "unknown key 'L_cycle'" in p.stderr and 'L_cycles' in p.stderr
    p = run(['train.py', '--L_cycles=four'], check=False)
    assert p.returncode != 0 and 'L_cycles' in p.stderr and 'int' in p.stderr
    cfg = tmp_path / 'bad.py'
    cfg.write_text("lr = 1e-3\nhiden_size = 8\n")
    p = run(['train.py', str(cfg)], check=False)
    assert "unknown key 'hiden_size'" in p.stderr and str(cfg) in p.stderr and 'hidden_size' in p.stderr
    cfg.write_text("lr = 1e-3\nx = (\n")
    p = run(['train.py', str(cfg)], check=False)
    assert p.returncode != 0 and 'bad.py' in p.stderr and 'line 2' in p.stderr
    p = run(['train.py', '--no_such_file.py'], check=False)
    assert p.returncode != 0
    # an int where a float is expected, a value containing '=', a file then an override
    good = tmp_path / 'good.py'
    good.write_text(f"data_path = '{toy}'\nmax_steps = 1\nlr = 1\n")
    p = run(['train.py', str(good), f'--out_dir={tmp_path}/a=b', '--max_steps=2', '--eval_only=True',
             '--init_from=scratch', '--wandb_run_name=x=y'] + TOY_ARGS)
    assert "out_dir = '" + f'{tmp_path}/a=b' in p.stdout and "wandb_run_name = 'x=y'" in p.stdout
    assert 'eval on 200' in p.stdout


# -----------------------------------------------------------------------------
# GCS, against a real emulator server (pip package gcp-storage-emulator). Only 127.0.0.1 is ever
# contacted: every test runs with STORAGE_EMULATOR_HOST set, which also keeps gcs.get_token() away
# from the metadata server and gcloud.

BUCKET = "test-bucket"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed on exit: nothing listens there afterwards


@pytest.fixture(autouse=True)
def _no_real_gcs(monkeypatch):
    # default for every test: an emulator address where nothing listens, so no test can
    # ever reach real GCS, the metadata server or gcloud by accident
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"127.0.0.1:{_free_port()}")


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    port = _free_port()
    workdir = tmp_path_factory.mktemp("emulator")
    log = open(workdir / "emulator.log", "wb")
    # --in-memory and cwd=workdir: it keeps nothing on disk, and nothing in the repo
    proc = subprocess.Popen([sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1",
                             "--port", str(port), "--in-memory", "-q"], cwd=workdir, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 20
        while True:
            try:
                if requests.get(url + "/", timeout=1).status_code == 200:  # emulator's health check
                    break
            except requests.ConnectionError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                pytest.fail("gcp-storage-emulator did not start:\n" + (workdir / "emulator.log").read_text())
            time.sleep(0.1)
        r = requests.post(url + "/storage/v1/b", params={"project": "test"}, json={"name": BUCKET}, timeout=5)
        assert r.status_code == 200, r.text
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture
def emu(emulator, monkeypatch):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", emulator.replace("http://", ""))  # gcs.py must add the scheme
    return emulator


class Proxy:
    """A real HTTP proxy in front of the emulator adding what the emulator lacks: list pagination
    (it ignores maxResults) and, on request, losing the reply to one resumable upload chunk."""

    def __init__(self, upstream):
        self.upstream = upstream
        self.list_pages = 0
        self.drop_reply_at = None  # byte offset of the chunk whose reply is replaced by a 503
        self.corrupt_uploads = False  # flip the first byte of every upload chunk in transit
        self.dropped = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                proxy.handle(self)
            do_PUT = do_POST = do_DELETE = do_GET

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def handle(self, h):
        body = h.rfile.read(int(h.headers.get("Content-Length") or 0))
        # Host is passed on so the emulator's upload session URLs point back at the proxy
        headers = {k: v for k, v in h.headers.items() if k.lower() not in ("connection", "content-length")}
        url = urlsplit(h.path)
        query = parse_qs(url.query)
        if self.corrupt_uploads and h.command == "PUT" and body:
            body = bytes([body[0] ^ 0xFF]) + body[1:]
        if h.command == "GET" and url.path.endswith("/o") and "maxResults" in query:
            status, resp_headers, content = self.paginate(url.path, query)
        else:
            r = requests.request(h.command, self.upstream + h.path, data=body, headers=headers,
                                 allow_redirects=False, timeout=10)
            status, resp_headers, content = r.status_code, r.headers, r.content
            if h.command == "PUT" and self.drop_reply_at is not None and \
                    h.headers.get("Content-Range", "").startswith(f"bytes {self.drop_reply_at}-"):
                # the emulator stored the chunk, but the client sees a failure: it must ask
                # where to resume instead of resending or skipping bytes
                self.drop_reply_at = None
                self.dropped += 1
                status, resp_headers, content = 503, {}, b""
        h.send_response(status)
        for k, v in resp_headers.items():
            if k.lower() not in ("content-length", "transfer-encoding", "connection", "content-encoding"):
                h.send_header(k, v)
        h.send_header("Content-Length", str(len(content)))
        h.end_headers()
        h.wfile.write(content)

    def paginate(self, path, query):
        params = {k: v[0] for k, v in query.items() if k not in ("maxResults", "pageToken")}
        items = requests.get(self.upstream + path, params=params, timeout=10).json().get("items") or []
        n, start = int(query["maxResults"][0]), int(query.get("pageToken", ["0"])[0])
        page = {"items": items[start:start + n]}
        if start + n < len(items):
            page["nextPageToken"] = str(start + n)
        self.list_pages += 1
        return 200, {"Content-Type": "application/json"}, json.dumps(page).encode()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def proxy(emulator):
    p = Proxy(emulator)
    yield p
    p.close()


def _write(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


def _read(path):
    with open(path, "rb") as f:
        return f.read()

# -----------------------------------------------------------------------------


def test_paths():
    assert gcs.is_gcs("gs://b/x") and not gcs.is_gcs("/tmp/x") and not gcs.is_gcs(None)
    assert gcs.split_gcs("gs://b/run 1/ckpt.pt") == ("b", "run 1/ckpt.pt")
    assert gcs.split_gcs("gs://b") == ("b", "")
    assert gcs.split_gcs("gs://b/") == ("b", "")
    for bad in ("gs://", "/local/path", "s3://b/x"):
        with pytest.raises(ValueError):
            gcs.split_gcs(bad)
    # the JSON API needs '/' inside an object name escaped (the emulator accepts it raw, so check the URL)
    url = gcs.GCS(endpoint="http://127.0.0.1:1")._object_url("b", "run 1/ckpt #1?.pt", alt="media")
    assert url == "http://127.0.0.1:1/storage/v1/b/b/o/run%201%2Fckpt%20%231%3F.pt?alt=media"


def test_no_token_with_emulator(emu):
    assert gcs.get_token() is None


def test_roundtrip(emu, tmp_path):
    # 256 KiB chunks so the 3 MB file takes the multi-chunk resumable path
    client = gcs.GCS(chunk_size=256 * 1024)
    files = {
        "rt/run 1/sub dir/ckpt #1+x?&=%.pt": os.urandom(3 * 1024 * 1024 + 123),
        "rt/run 1/état.json": "{\"step\": 1}".encode(),
        "rt/empty.bin": b"",
    }
    for name, data in files.items():
        client.upload(_write(tmp_path / "up" / "f", data), f"gs://{BUCKET}/{name}")
    # the module-level helper works too, and re-uploading replaces the object
    gcs.upload_file(_write(tmp_path / "up" / "g", b"v2"), f"gs://{BUCKET}/rt/empty.bin")
    files["rt/empty.bin"] = b"v2"

    listed = gcs.list_objects(f"gs://{BUCKET}/rt/")
    assert sorted(listed) == sorted((f"gs://{BUCKET}/{n}", len(d)) for n, d in files.items())
    odd = "rt/run 1/sub dir/ckpt #1+x?&=%.pt"
    assert gcs.list_objects(f"gs://{BUCKET}/rt/run 1/sub") == [(f"gs://{BUCKET}/{odd}", len(files[odd]))]
    for i, (uri, _) in enumerate(listed):
        dst = tmp_path / "down" / f"{i}" / "file.pt"  # parent dirs are created
        assert gcs.download_file(uri, str(dst)) == str(dst)
        assert _read(dst) == files[gcs.split_gcs(uri)[1]]
        assert gcs.object_exists(uri)
    assert not [p for p in (tmp_path / "down").rglob("*.part")]  # temp files renamed away


def test_list_pagination(emu, proxy, tmp_path):
    src = _write(tmp_path / "f", b"x")
    names = [f"page/obj {i:02d}" for i in range(7)]
    for n in names:
        gcs.upload_file(src, f"gs://{BUCKET}/{n}")
    want = [(f"gs://{BUCKET}/{n}", 1) for n in names]
    assert gcs.GCS(endpoint=proxy.url).list(f"gs://{BUCKET}/page/", max_results=3) == want
    assert proxy.list_pages == 3  # 3 + 3 + 1, following nextPageToken
    assert gcs.GCS().list(f"gs://{BUCKET}/page/", max_results=3) == want  # straight to the emulator


def test_upload_resumes_after_lost_reply(emu, proxy, tmp_path):
    data = os.urandom(1024 * 1024 + 7)
    proxy.drop_reply_at = 256 * 1024  # the second chunk
    client = gcs.GCS(endpoint=proxy.url, chunk_size=256 * 1024, backoff=0.01)
    client.upload(_write(tmp_path / "f", data), f"gs://{BUCKET}/resume/ckpt.pt")
    assert proxy.dropped == 1
    client.download(f"gs://{BUCKET}/resume/ckpt.pt", str(tmp_path / "back"))
    assert _read(tmp_path / "back") == data


def test_corrupted_upload_is_rejected(emu, proxy, tmp_path):
    # gcs.py sends the file's md5 up front, so GCS refuses to create an object from bad bytes
    proxy.corrupt_uploads = True
    uri = f"gs://{BUCKET}/corrupt/ckpt.pt"
    with pytest.raises(gcs.GCSError, match="corrupt/ckpt.pt.*400"):
        gcs.GCS(endpoint=proxy.url).upload(_write(tmp_path / "f", os.urandom(1000)), uri)
    assert not gcs.object_exists(uri)


def test_delete(emu, tmp_path):
    uri = f"gs://{BUCKET}/del/ckpt.pt"
    gcs.upload_file(_write(tmp_path / "f", b"abc"), uri)
    assert gcs.object_exists(uri)
    assert gcs.delete_object(uri) is True
    assert not gcs.object_exists(uri)
    assert gcs.list_objects(f"gs://{BUCKET}/del/") == []
    assert gcs.delete_object(uri) is False  # already gone is not an error (idempotent retries)
    with pytest.raises(gcs.NotFoundError):
        gcs.GCS().delete(uri, missing_ok=False)


def test_download_missing_names_object(emu, tmp_path):
    uri = f"gs://{BUCKET}/nope/missing ckpt.pt"
    with pytest.raises(gcs.NotFoundError, match="missing ckpt.pt.*404") as exc:
        gcs.download_file(uri, str(tmp_path / "out.pt"))
    assert isinstance(exc.value, FileNotFoundError) and exc.value.status == 404
    assert os.listdir(tmp_path) == []  # neither the target nor a temp file left behind


def test_client_error_fails_fast(emu, tmp_path):
    client = gcs.GCS(retries=5, backoff=10.0)  # a retry would take >= 5 s
    t0 = time.time()
    with pytest.raises(gcs.GCSError, match="gs://no-such-bucket/x.pt.*404"):
        client.upload(_write(tmp_path / "f", b"x"), "gs://no-such-bucket/x.pt")
    assert time.time() - t0 < 3


def test_uploader_background(emu, tmp_path):
    done = []
    up = gcs.Uploader(on_success=lambda local, uri: done.append(uri))
    uris = [f"gs://{BUCKET}/bg/ckpt_{i}.pt" for i in range(3)]
    for i, uri in enumerate(uris):
        up.submit(_write(tmp_path / f"c{i}", os.urandom(200_000)), uri)
    assert up.wait(timeout=30)
    assert up.failures == 0 and done == uris  # one thread: uploads finish in submit order
    assert [u for u, _ in gcs.list_objects(f"gs://{BUCKET}/bg/")] == uris
    assert up.wait(timeout=0)  # nothing pending: returns at once


def test_uploader_unreachable_logs_and_counts(tmp_path, capfd):
    # autouse fixture: STORAGE_EMULATOR_HOST is a closed 127.0.0.1 port -> connection refused
    done = []
    up = gcs.Uploader(client=gcs.GCS(retries=2, backoff=0.01), on_success=lambda *a: done.append(a))
    t0 = time.time()
    up.submit(_write(tmp_path / "f", b"x"), f"gs://{BUCKET}/unreachable/ckpt.pt")
    assert time.time() - t0 < 0.5  # submit doesn't block on the network
    assert up.wait(timeout=30)
    assert up.failures == 1 and done == []
    err = capfd.readouterr().err
    assert "gs://test-bucket/unreachable/ckpt.pt" in err and "failed" in err


def test_training_to_a_bucket_resumes_from_it(emu, toy, tmp_path):
    args = ['train.py', f'--data_path={toy}', f'--out_dir=gs://{BUCKET}/runs/r1', f'--local_dir={tmp_path}/local',
            '--epochs=1', '--eval_interval=100', '--log_interval=2', '--checkpoint_interval=2', '--keep_last_n=2'] + TOY_ARGS
    env = dict(STORAGE_EMULATOR_HOST=emu.replace('http://', ''))
    run(args + ['--max_steps=6'], env=env)
    names = sorted(u for u, _ in gcs.list_objects(f'gs://{BUCKET}/runs/r1/'))
    assert names == [f'gs://{BUCKET}/runs/r1/ckpt_0000000{i}.pt' for i in (4, 6)]  # pruned to keep_last_n (+ best)
    # a new VM: nothing local; resume finds the newest complete checkpoint in the bucket
    import shutil
    shutil.rmtree(f'{tmp_path}/local')
    p = run(args + ['--max_steps=8', '--init_from=resume'], env=env)
    assert f'downloading gs://{BUCKET}/runs/r1/ckpt_00000006.pt' in p.stdout and '(step 6)' in p.stdout
    assert 'step 8/' in p.stdout
    assert f'gs://{BUCKET}/runs/r1/ckpt_00000008.pt' in [u for u, _ in gcs.list_objects(f'gs://{BUCKET}/runs/r1/')]


def test_failed_uploads_do_not_stop_training(toy, tmp_path):
    # the autouse fixture points STORAGE_EMULATOR_HOST at a closed port: every upload fails
    p = run(['train.py', f'--data_path={toy}', f'--out_dir=gs://{BUCKET}/down', f'--local_dir={tmp_path}/local',
             '--epochs=1', '--eval_interval=100', '--log_interval=2', '--checkpoint_interval=2', '--max_steps=4',
             '--gcs_retries=2'] + TOY_ARGS)
    assert 'step 4/' in p.stdout and 'upload(s) to gs://test-bucket/down failed' in p.stdout
    assert 'ckpt_00000002.pt' in p.stderr  # each failure is logged with the object
    assert sorted(os.listdir(f'{tmp_path}/local')) == ['ckpt_00000002.pt', 'ckpt_00000004.pt']


# -----------------------------------------------------------------------------
# XLA on the CPU (PJRT_DEVICE=CPU): the same training step as on CPU and CUDA, through torch_xla.launch

XLA_ENV = dict(PJRT_DEVICE='CPU', CPU_NUM_DEVICES='1')


def test_xla_training_matches_cpu_and_stops_compiling(toy, tmp_path):
    common = [f'--data_path={toy}', '--epochs=2', '--eval_interval=100', '--log_interval=5', '--max_steps=30',
              '--halt_exploration_prob=0.0', '--mlp_t=False', '--pos_encodings=rope', '--puzzle_emb_ndim=16'] + TOY_ARGS
    common = [a for a in common if a not in ('--mlp_t=True', '--pos_encodings=none', '--puzzle_emb_ndim=0', '--device=cpu')]
    x = run(['train.py', f'--out_dir={tmp_path}/x', '--device=xla'] + common, env=XLA_ENV)
    c = run(['train.py', f'--out_dir={tmp_path}/c', '--device=cpu'] + common)
    assert 'device xla x1' in x.stdout  # through torch_xla.launch, one process
    xr, cr = step_lines(x.stdout), step_lines(c.stdout)
    assert len(xr) == len(cr) == 6
    for a, b in zip(xr, cr):
        assert abs(a['loss'] - b['loss']) <= 1e-3 * abs(b['loss']), (a, b)
    compiles = [r['compiles'] for r in xr]
    assert compiles[1] == compiles[-1], compiles  # no new graph after warm-up (steps 1 and 2 differ)
    assert 'CPU fallbacks: none' in x.stdout
    a = torch.load(f'{tmp_path}/x/ckpt_00000030.pt', weights_only=True)
    b = torch.load(f'{tmp_path}/c/ckpt_00000030.pt', weights_only=True)
    for k in b['model']:
        torch.testing.assert_close(a['model'][k], b['model'][k], rtol=1e-3, atol=2e-4, msg=k)


XLA_EVAL = """
import json, sys
sys.argv = ['train.py', '--device=xla']
import torch, torch_xla, torch_xla.debug.metrics as met
import train
from data import EvalLoader
from model import TRM, TRMConfig
dev = train.Device('xla')
model = TRM(TRMConfig(vocab_size=6, seq_len=8, hidden_size=32, num_heads=2, H_cycles=2, L_cycles=2, halt_max_steps=4,
                      puzzle_emb_ndim=16, puzzle_emb_len=1, mlp_t=False, forward_dtype='float32')).to(dev.device)
loader = EvalLoader(sys.argv_path, 4)  # 10 examples: 3 batches, the last one padded
count = lambda name: (met.metric_data(name) or [0])[0]
train.evaluate(model, loader, dev, 6, 4)
c0, e0 = count('CompileTime'), count('ExecuteTime')
res, _ = train.evaluate(model, loader, dev, 6, 4)
print(json.dumps(dict(batches=len(loader), compiles=count('CompileTime') - c0, executions=count('ExecuteTime') - e0,
                      count=res['count'], fallbacks=train.Device.xla_report(dev)[1])))
"""


def test_xla_evaluation_runs_one_graph_per_batch(tmp_path):
    root = make_reverse_dataset(str(tmp_path), n_train=8, n_test=10)
    p = run(['-c', XLA_EVAL.replace('sys.argv_path', repr(root))], env=XLA_ENV)
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r['batches'] == 3 and r['count'] == 10
    assert r['compiles'] == 0  # the second evaluation reuses every graph
    assert r['executions'] <= r['batches'] + 1  # one graph per batch (+ the final reduction)
    assert r['fallbacks'] == []
