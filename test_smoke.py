"""
Tests that run real code on small real runs. Run with:  python -m pytest -q test_smoke.py
Sections: model, optimisers, data, training runs (learning, resume, torchrun, signals, W&B), configurator,
GCS (against a real emulator server), XLA on the CPU (PJRT_DEVICE=CPU), dataset builders, bench.py.
"""
import csv
import filecmp
import functools
import glob
import http.server
import json
import math
import os
import re
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
import prepare_maze as pm  # noqa: E402
import prepare_sudoku as ps  # noqa: E402
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
    assert 'resuming from' in p.stdout and f'step {step + 2}/' in p.stdout



def test_sigterm_to_one_rank_stops_all_ranks_at_the_same_step(toy, tmp_path):
    args = ['-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', 'train.py', f'--data_path={toy}',
            f'--out_dir={tmp_path}/o', '--epochs=200', '--eval_interval=1000', '--log_interval=2'] + TOY_ARGS
    e = dict(os.environ, WANDB_MODE='disabled', PYTHONUNBUFFERED='1', OMP_NUM_THREADS='1')
    proc = subprocess.Popen([sys.executable] + args, cwd=HERE, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    out = []
    for line in proc.stdout:
        out.append(line)
        if line.startswith('step 4/'):
            workers = subprocess.run(['pgrep', '-P', str(proc.pid)], capture_output=True, text=True).stdout.split()
            assert len(workers) == 2, workers
            os.kill(int(workers[1]), signal.SIGTERM)  # rank 1 only: as when one host is told first
            break
    try:
        rest, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    out = ''.join(out) + rest
    assert proc.returncode == 0, out
    assert 'stopped cleanly' in out
    ckpts = glob.glob(f'{tmp_path}/o/ckpt_*.pt')
    assert len(ckpts) == 1 and torch.load(ckpts[0], weights_only=True)['carry']['inputs'].shape[0] == 50


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



def test_eval_only_with_test_time_scaling(toy, tmp_path):
    args = ['train.py', f'--data_path={toy}', f'--out_dir={tmp_path}/o', '--epochs=1', '--eval_interval=100',
            '--log_interval=5'] + TOY_ARGS
    run(args + ['--max_steps=5'])
    p = run(args + [f'--init_from={tmp_path}/o/ckpt_00000005.pt', '--eval_only=True', '--eval_steps=6'])
    line = eval_lines(p.stdout)[-1]
    assert 'loaded weights from' in p.stdout and 'eval on 200' in line
    by_steps = line.split('exact by steps: ')[1].split()
    assert [s.split(':')[0] for s in by_steps] == ['1', '2', '3', '4', '5', '6']
    exact_at_4 = float(line.split('exact ')[1].split()[0])
    assert abs(float(by_steps[3].split(':')[1]) - exact_at_4) < 1e-3  # the headline is at halt_max_steps
    assert 'with q_halt stop' in line


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


# -----------------------------------------------------------------------------
# prepare_sudoku.py: real files, a real HTTP server on 127.0.0.1, no mocks. The full-size speed
# check (3.8M + 423k rows, <= 15 s, <= 1 GB) is opt-in: TRM_BENCH_FULL=1.

HARD_9X9 = {  # well-known very hard puzzles, typed in row by row
    'inkala': '8..........36......7..9.2...5...7.......457.....1...3...1....68..85...1..9....4..',
    'golden_nugget': '.......39.....1..5..3.5.8....8.9...6.7...2...1..4.......9.8..5..2....6..4..7.....',
    'easter_monster': '1.......2.9.4...5...6...7...5.9.3.......7.......85..4.7.....6...3...9.8...2.....1',
    'platinum_blonde': '.......12........3..23..4....18....5.6..7.8.......9.....85.....9...4.5..47...6...',
    'ai_escargot': '1....7.9..3..2...8..96..5....53..9...1..8...26....4...3......1..4......7..7...3..',
}
INKALA_SOLUTION = '812753649943682175675491283154237896369845721287169534521974368438526917796318452'


# -----------------------------------------------------------------------------
# synthetic CSVs: valid Sudokus of any count, vectorised (also used for the full-size benchmark)

def _valid_grids(rng, k, n=9):
    """k valid solved grids [k, n*n] (digits 1..n): a pattern grid under random relabelling and
    band/row/stack/column permutations (argsort of random keys; independent of prepare_sudoku)."""
    br, bc = ps.BOXES[n]
    r, c = np.meshgrid(np.arange(n), np.arange(n), indexing='ij')
    base = (bc * (r % br) + r // br + c) % n  # a valid grid (digits 0..n-1)
    perm = lambda *shape: np.argsort(rng.random(shape), axis=-1)
    rows = (perm(k, n // br)[:, :, None] * br + perm(k, n // br, br)).reshape(k, n)
    cols = (perm(k, n // bc)[:, :, None] * bc + perm(k, n // bc, bc)).reshape(k, n)
    grids = base[rows[:, :, None], cols[:, None, :]].reshape(k, n * n)
    return np.take_along_axis(perm(k, n), grids, axis=1) + 1


def write_synthetic_csv(path, rows, seed=0, n=9, blank_p=0.7, chunk=200_000):
    """`rows` data rows of valid puzzles: answers from a pool of random valid grids, questions with
    random blanks ('.'), ratings 0..999 and sources of different lengths (variable-width rows)."""
    rng = np.random.default_rng(seed)
    L = n * n
    pool = _valid_grids(rng, 4096, n).astype(np.uint8) + 48
    sources = [b'puzzles0_kaggle', b'puzzles2_17_clue', b'puzzles4_forum_hardest_1905', b'puzzles7_serg_benchmark']
    width = max(map(len, sources))
    src = np.zeros((len(sources), width), np.uint8)
    for i, s in enumerate(sources):
        src[i, :len(s)] = np.frombuffer(s, np.uint8)
    with open(path, 'wb') as f:
        f.write(ps.HEADER.encode() + b'\n')
        for start in range(0, rows, chunk):
            k = min(chunk, rows - start)
            a = pool[rng.integers(0, len(pool), k)]
            q = np.where(rng.random((k, L)) < blank_p, np.uint8(46), a)
            s = rng.integers(0, len(sources), k)
            rating = rng.integers(0, 1000, k)
            rlen = 1 + (rating >= 10) + (rating >= 100)
            j = np.arange(3)
            rdig = (rating[:, None] // 10 ** np.clip(rlen[:, None] - 1 - j, 0, 2) % 10 + 48).astype(np.uint8)
            line = np.concatenate([src[s], np.full((k, 1), 44, np.uint8), q, np.full((k, 1), 44, np.uint8), a,
                                   np.full((k, 1), 44, np.uint8), rdig, np.full((k, 1), 10, np.uint8)], axis=1)
            used = np.ones(line.shape, bool)
            used[:, :width] = np.arange(width) < np.array(list(map(len, sources)))[s][:, None]
            used[:, width + 2 * L + 3:width + 2 * L + 6] = j < rlen[:, None]
            f.write(line[used].tobytes())
    return path


def read_csv_rows(path):
    with open(path, newline='') as f:
        reader = csv.reader(f)
        next(reader)
        return list(reader)


def reference_arrays(path, min_difficulty=None):
    """What a straightforward per-row builder (the reference's algorithm, num_aug 0, no subsample)
    gives for one CSV: digits + 1, '.' -> blank token 1."""
    ins, labs = [], []
    for source, q, a, rating in read_csv_rows(path):
        if min_difficulty is None or int(rating) >= min_difficulty:
            ins.append(np.frombuffer(q.replace('.', '0').encode(), np.uint8) - 48 + 1)
            labs.append(np.frombuffer(a.encode(), np.uint8) - 48 + 1)
    return np.array(ins, np.int32), np.array(labs, np.int32)


def load_split(root, split):
    d = os.path.join(root, split)
    arrays = {k: np.load(os.path.join(d, f'all__{k}.npy')) for k in
              ('inputs', 'labels', 'puzzle_identifiers', 'puzzle_indices', 'group_indices')}
    with open(os.path.join(d, 'dataset.json')) as f:
        return arrays, json.load(f)


def split_bytes(root):
    out = {}
    for split in ('train', 'test'):
        for name in sorted(os.listdir(os.path.join(root, split))):
            with open(os.path.join(root, split, name), 'rb') as f:
                out[split, name] = f.read()
    return out


@pytest.fixture
def csv_dir(tmp_path):
    d = tmp_path / 'csv'
    d.mkdir()
    write_synthetic_csv(d / 'train.csv', 400, seed=1)
    write_synthetic_csv(d / 'test.csv', 300, seed=2)
    return d


# -----------------------------------------------------------------------------
# CSV -> .npy

def test_sudoku_test_split_round_trips_and_matches_reference(csv_dir, tmp_path):
    out = tmp_path / 'out'
    ps.build(csv_dir, out, num_aug=3, subsample_size=50)
    arrays, meta = load_split(out, 'test')
    rows = read_csv_rows(csv_dir / 'test.csv')
    assert ps.tokens_to_strings(arrays['inputs']) == [r[1] for r in rows]
    assert ps.tokens_to_strings(arrays['labels']) == [r[2] for r in rows]
    ref_in, ref_lab = reference_arrays(csv_dir / 'test.csv')
    N = len(rows)
    assert arrays['inputs'].dtype == np.int32 and np.array_equal(arrays['inputs'], ref_in)
    assert np.array_equal(arrays['labels'], ref_lab)
    assert np.array_equal(arrays['puzzle_indices'], np.arange(N + 1))
    assert np.array_equal(arrays['group_indices'], np.arange(N + 1))
    assert np.array_equal(arrays['puzzle_identifiers'], np.zeros(N))
    assert meta == dict(pad_id=0, ignore_label_id=0, blank_identifier_id=0, vocab_size=11, seq_len=81,
                        num_puzzle_identifiers=1, total_groups=N, mean_puzzle_examples=1.0, total_puzzles=N,
                        sets=['all'], puzzle_type='sudoku', grid_size=9)
    assert json.load(open(out / 'identifiers.json')) == ['<blank>']
    # train without subsample/augmentation is the reference's too; '0' blanks read like '.'
    text = (csv_dir / 'train.csv').read_text()
    (csv_dir / 'train.csv').write_text(text.replace('.', '0'))
    ps.build(csv_dir, tmp_path / 'full')
    arrays, _ = load_split(tmp_path / 'full', 'train')
    ref_in, ref_lab = reference_arrays(csv_dir / 'train.csv')
    assert np.array_equal(arrays['inputs'], ref_in) and np.array_equal(arrays['labels'], ref_lab)


def test_sudoku_train_layout_subsample_and_min_difficulty(csv_dir, tmp_path):
    ps.build(csv_dir, tmp_path / 'o', subsample_size=40, num_aug=5, min_difficulty=300, seed=3)
    arrays, meta = load_split(tmp_path / 'o', 'train')
    assert meta['total_groups'] == 40 and meta['total_puzzles'] == 240 and len(arrays['inputs']) == 240
    assert np.array_equal(arrays['group_indices'], np.arange(0, 241, 6))
    assert np.array_equal(arrays['puzzle_indices'], np.arange(241))
    # every group starts with an unaugmented row of the CSV whose rating passes the filter
    rows = {(q, a): int(r) for _, q, a, r in read_csv_rows(csv_dir / 'train.csv')}
    originals = zip(ps.tokens_to_strings(arrays['inputs'][::6]), ps.tokens_to_strings(arrays['labels'][::6]))
    ratings = [rows[key] for key in originals]
    assert min(ratings) >= 300 and len(set(ratings)) > 1


def test_sudoku_seed_determinism(csv_dir, tmp_path):
    for name, seed in (('a', 0), ('b', 0), ('c', 1)):
        ps.build(csv_dir, tmp_path / name, subsample_size=30, num_aug=20, seed=seed)
    a, b, c = (split_bytes(tmp_path / x) for x in 'abc')
    assert a == b
    assert a[('train', 'all__inputs.npy')] != c[('train', 'all__inputs.npy')]
    assert a[('test', 'all__inputs.npy')] == c[('test', 'all__inputs.npy')]  # test split has no randomness


def _check_augmented(inputs, labels, K, n):
    L = n * n
    assert ps.sudoku_correct(inputs, labels, n).all()  # labels solve their (augmented) inputs
    assert ps.sudoku_correct(labels, labels, n).all()
    g_in, g_lab = inputs.reshape(-1, K, L), labels.reshape(-1, K, L)
    # a copy keeps the number of givens, and every given agrees with the copy's solution
    assert ((g_in == 1).sum(2) == (g_in[:, :1] == 1).sum(2)).all()
    assert ((g_in == g_lab) | (g_in == 1)).all()
    assert (g_lab[:, 1:] != g_lab[:, :1]).any(2).mean() > 0.9  # copies really are shuffled


def test_sudoku_augmentations_keep_solutions_valid(csv_dir, tmp_path):
    ps.build(csv_dir, tmp_path / 'o', subsample_size=20, num_aug=50, seed=5)
    arrays, _ = load_split(tmp_path / 'o', 'train')
    _check_augmented(arrays['inputs'], arrays['labels'], 51, 9)
    rng = np.random.default_rng(0)
    for n in (4, 6, 9):
        grids = _valid_grids(rng, 30, n)
        q = np.where(rng.random(grids.shape) < 0.5, 0, grids)
        inp, lab = ps.augment(q.astype(np.uint8) + 1, grids.astype(np.uint8) + 1, n, 40, rng)
        _check_augmented(inp, lab, 41, n)
        pos, token_map = ps.random_transforms(rng, 4000, n)
        assert (np.sort(pos, 1) == np.arange(n * n)).all()  # every position map is a permutation
        assert (token_map[:, :2] == (0, 1)).all() and (np.sort(token_map[:, 2:n + 2], 1) == np.arange(2, n + 2)).all()
        src_row = pos.reshape(-1, n, n) // n
        transposed = ~(src_row == src_row[:, :, :1]).all(2)  # an output row drawn from several input rows
        assert (0.45 < transposed.mean() < 0.55) if n != 6 else not transposed.any()  # 6x6: boxes not square


# -----------------------------------------------------------------------------
# verifier

def test_sudoku_verifier():
    sol = np.frombuffer(INKALA_SOLUTION.encode(), np.uint8).astype(np.int64) - 48 + 1
    puzzle = np.frombuffer(HARD_9X9['inkala'].replace('.', '0').encode(), np.uint8).astype(np.int64) - 48 + 1
    assert ps.sudoku_correct(puzzle[None], sol[None]).tolist() == [True]
    changed_given = puzzle.copy()
    changed_given[0] = 2 if sol[0] != 2 else 3  # a given the solution contradicts
    r, c = np.divmod(np.arange(81), 9)
    latin = (r + c) % 9 + 2  # rows and columns fine, boxes repeat digits
    bad_digit = sol.copy()
    bad_digit[40] = 0  # PAD is no digit
    swapped = sol.copy()
    swapped[[1, 2]] = swapped[[2, 1]]  # two blanks of row 1 swapped: the columns repeat digits
    relabelled = np.where(sol == 2, 3, np.where(sol == 3, 2, sol))  # a valid grid that changes givens
    blank = np.ones(81, np.int64)
    got = ps.sudoku_correct(np.stack([changed_given, blank, blank, puzzle, puzzle, blank]),
                            np.stack([sol, latin, bad_digit, swapped, relabelled, relabelled]))
    assert got.tolist() == [False, False, False, False, False, True]
    for n in (4, 6):  # other sizes, n inferred from seq_len
        g = _valid_grids(np.random.default_rng(n), 5, n) + 1
        assert ps.sudoku_correct(np.ones_like(g), g).all()
        broken = g.copy()
        broken[:, [0, n]] = broken[:, [n, 0]]  # swap two cells of one column: rows and boxes break
        assert not ps.sudoku_correct(np.ones_like(g), broken).any()


# -----------------------------------------------------------------------------
# solver and generator

def test_sudoku_hard_puzzles_solve():
    for name, p in HARD_9X9.items():
        assert len(p) == 81, name
        sols, guesses = ps.solve(p)
        assert ps.count_solutions(p) == 1, name
        q = np.array([[1 if ch == '.' else int(ch) + 1 for ch in p]])
        assert ps.sudoku_correct(q, np.array(sols) + 1).all(), name
        assert guesses > 0, name
    assert ''.join(map(str, ps.solve(HARD_9X9['inkala'])[0][0])) == INKALA_SOLUTION
    assert ps.count_solutions('.' * 81) == 2 and ps.count_solutions('11' + '.' * 79) == 0


@pytest.mark.parametrize('n,count,min_rating', [(4, 60, 0), (6, 20, 0), (9, 4, 1)])
def test_sudoku_generator(n, count, min_rating):
    puzzles = ps.generate_puzzles(count, n, seed=7, min_rating=min_rating)
    assert puzzles == ps.generate_puzzles(count, n, seed=7, min_rating=min_rating)  # seeded
    assert len({q for q, _, _ in puzzles}) == count
    for q, a, rating in puzzles:
        assert len(q) == len(a) == n * n
        assert ps.count_solutions(q) == 1
        sols, guesses = ps.solve(q)
        assert ''.join(map(str, sols[0])) == a and rating == guesses >= min_rating


def test_sudoku_generate_cli(tmp_path, capsys):
    out = tmp_path / 's6'
    assert ps.main(['--generate', '12', '--num_test', '3', '--size', '6', '--num_aug', '4',
                    '--output_dir', str(out), '--seed', '2']) == 0
    first = (out / 'csv' / 'train.csv').read_bytes()
    arrays, meta = load_split(out, 'train')
    assert meta['vocab_size'] == 8 and meta['seq_len'] == 36 and meta['grid_size'] == 6
    assert meta['total_groups'] == 12 and meta['total_puzzles'] == 60
    _check_augmented(arrays['inputs'], arrays['labels'], 5, 6)
    test_arrays, test_meta = load_split(out, 'test')
    assert test_meta['total_puzzles'] == 3 and test_meta['puzzle_type'] == 'sudoku'
    assert ps.tokens_to_strings(test_arrays['inputs']) == [r[1] for r in read_csv_rows(out / 'csv' / 'test.csv')]
    assert ps.main(['--generate', '12', '--num_test', '3', '--size', '6', '--output_dir', str(tmp_path / 'again'),
                    '--seed', '2']) == 0
    assert (tmp_path / 'again' / 'csv' / 'train.csv').read_bytes() == first
    capsys.readouterr()
    assert ps.main(['--generate', '50', '--size', '4', '--min_rating', '1', '--output_dir', str(tmp_path / 'x')]) == 1
    assert 'found only 0 of 55 distinct 4x4 puzzles with rating >= 1' in capsys.readouterr().err


# -----------------------------------------------------------------------------
# malformed rows

BAD_ROWS = [  # (how to break a good row, words the message must contain)
    (lambda s, q, a, r: f"{s},{q},{a}", 'expected 4 fields'),
    (lambda s, q, a, r: f"{s},{q[:-1]},{a},{r}", 'question has 80 characters'),
    (lambda s, q, a, r: f"{s},{q},{a}5,{r}", 'answer has 82 characters'),
    (lambda s, q, a, r: f"{s},x{q[1:]},{a},{r}", "invalid character 'x' at position 1"),
    (lambda s, q, a, r: f"{s},{q},0{a[1:]},{r}", "answer has the invalid character '0'"),
    (lambda s, q, a, r: f"{s},{q},{a},1.5", "rating '1.5' is not an integer"),
    (lambda s, q, a, r: f"{s},{q},{a},", "rating '' is not an integer"),
    (lambda s, q, a, r: f"{s},{q[:80]}{int(a[80]) % 9 + 1},{a},{r}", 'where the question gives'),
    (lambda s, q, a, r: f"{s},{q},{a[1]}{a[0]}{a[2:]},{r}", 'answer repeats the digit'),
]


def test_sudoku_malformed_rows(csv_dir, tmp_path, capsys):
    lines = (csv_dir / 'train.csv').read_text().splitlines()
    good = list(lines)
    bad_lines = []
    for k, (breaker, _) in enumerate(BAD_ROWS):
        at = 5 + 7 * k  # 0-based index in the file = 1-based line - 1
        lines[at] = breaker(*lines[at].split(','))
        bad_lines.append(at + 1)
    for k, (breaker, words) in enumerate(BAD_ROWS):  # each kind alone: the message names file and line
        one = list(good)
        one[bad_lines[k] - 1] = lines[bad_lines[k] - 1]
        path = tmp_path / f'bad{k}.csv'
        path.write_text('\n'.join(one) + '\n')
        with pytest.raises(ps.CSVFormatError) as e:
            ps.build_split(path, tmp_path / 'o', 'test')
        assert isinstance(e.value, ValueError)
        assert str(e.value).startswith(f"{path}:{bad_lines[k]}: ") and words in str(e.value), (k, str(e.value))
    (csv_dir / 'train.csv').write_text('\r\n'.join(lines))  # CRLF, no final newline: still read right
    assert ps.main(['--csv_dir', str(csv_dir), '--output_dir', str(tmp_path / 'x')]) == 1
    assert f"train.csv:{bad_lines[0]}: expected 4 fields" in capsys.readouterr().err
    assert ps.main(['--csv_dir', str(csv_dir), '--output_dir', str(tmp_path / 'x'), '--skip_bad']) == 0
    captured = capsys.readouterr()
    assert f"400 rows read, {len(BAD_ROWS)} bad rows skipped, {400 - len(BAD_ROWS)} groups" in captured.out
    assert captured.err.count('skipped ') == 5  # the first few are shown
    arrays, _ = load_split(tmp_path / 'x', 'train')
    good_rows = [r.split(',') for i, r in enumerate(lines) if i > 0 and i + 1 not in bad_lines]
    assert ps.tokens_to_strings(arrays['inputs']) == [r[1] for r in good_rows]
    # a subsample draws only good rows: content-bad rows drawn are replaced from the rest
    ps.build(csv_dir, tmp_path / 'sub', subsample_size=400 - len(BAD_ROWS), skip_bad=True, seed=4)
    arrays, _ = load_split(tmp_path / 'sub', 'train')
    assert ps.tokens_to_strings(arrays['inputs']) == [r[1] for r in good_rows]  # all good rows, file order
    with pytest.raises(ps.CSVFormatError, match=rf"train\.csv:{bad_lines[0]}: expected 4 fields"):
        ps.build(csv_dir, tmp_path / 'sub2', subsample_size=10)  # structure is checked on every row
    # line 1 must be a header (other column names only give a note, as the reference skips line 1)
    body = (csv_dir / 'test.csv').read_text().split('\n', 1)[1]
    for header in ('source,question,answer\n', ''):
        (csv_dir / 'test.csv').write_text(header + body)
        with pytest.raises(ps.CSVFormatError, match=r'test\.csv:1: expected the header'):
            ps.scan_csv(csv_dir / 'test.csv')
    (csv_dir / 'test.csv').write_text('a,b,c,d\n' + body)
    assert ps.scan_csv(csv_dir / 'test.csv')['rows'] == 300 and 'differs from' in capsys.readouterr().err


# -----------------------------------------------------------------------------
# download against a local server

class _Handler(http.server.BaseHTTPRequestHandler):
    files, log, fail_once, drop_once = {}, [], set(), set()

    def log_message(self, *args):
        pass

    def do_GET(self):
        status, body, headers = 200, b'', {}
        if self.path.startswith('/status/'):
            status = int(self.path.split('/')[2])
        elif self.path in self.fail_once:
            self.fail_once.discard(self.path)
            status = 503
        elif self.path not in self.files:
            status = 404
        else:
            body = self.files[self.path]
            m = re.fullmatch(r'bytes=(\d+)-', self.headers.get('Range', ''))
            if m:
                start = int(m.group(1))
                status, headers['Content-Range'] = 206, f'bytes {start}-{len(body) - 1}/{len(body)}'
                body = body[start:]
        self.log.append((self.path, self.headers.get('Range'), status))
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        if self.path in self.drop_once and status == 200:  # the connection dies halfway through
            self.drop_once.discard(self.path)
            body = body[:len(body) // 2]
            self.close_connection = True
        self.wfile.write(body)


@pytest.fixture
def server():
    srv = http.server.ThreadingHTTPServer(('127.0.0.1', 0), _Handler)
    thread = threading.Thread(target=srv.serve_forever, kwargs=dict(poll_interval=0.05), daemon=True)
    thread.start()
    _Handler.log.clear()
    try:
        yield f'http://127.0.0.1:{srv.server_address[1]}'
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(5)
        assert not thread.is_alive()


def test_sudoku_download(server, tmp_path, csv_dir):
    content = (csv_dir / 'test.csv').read_bytes()
    _Handler.files.update({'/d/test.csv': content, '/d/train.csv': (csv_dir / 'train.csv').read_bytes()})
    dest = tmp_path / 'dl' / 'test.csv'
    dest.parent.mkdir()
    (tmp_path / 'dl' / 'test.csv.part').write_bytes(content[:10_000])  # an interrupted earlier run
    assert ps.download(f'{server}/d/test.csv', str(dest), expected_rows=300) == str(dest)
    assert dest.read_bytes() == content and not (tmp_path / 'dl' / 'test.csv.part').exists()
    assert _Handler.log == [('/d/test.csv', 'bytes=10000-', 206)]
    ps.download(f'{server}/d/test.csv', str(dest), expected_rows=300)  # cached: no request
    assert len(_Handler.log) == 1
    _Handler.log.clear()
    with pytest.raises(ps.DownloadError, match=r'300 data rows, expected 299'):
        ps.download(f'{server}/d/test.csv', str(dest), expected_rows=299)  # wrong count is a clear error
    with pytest.raises(ps.DownloadError, match=rf'{server}/d/test.csv: 300 data rows, expected 301'):
        ps.download(f'{server}/d/test.csv', str(tmp_path / 'other.csv'), expected_rows=301)
    assert not (tmp_path / 'other.csv').exists() and (tmp_path / 'other.csv.part').exists()
    with pytest.raises(ps.DownloadError) as e:
        ps.download(f'{server}/status/404', str(tmp_path / 'a.csv'))
    assert f'GET {server}/status/404 failed: HTTP 404' in str(e.value)
    with pytest.raises(ps.DownloadError) as e:
        ps.download(f'{server}/status/500', str(tmp_path / 'b.csv'), retries=2, backoff=0.01)
    assert f'GET {server}/status/500 failed: HTTP 500' in str(e.value) and '3 attempts' in str(e.value)
    assert [s for p, _, s in _Handler.log if p == '/status/500'] == [500, 500, 500]
    _Handler.fail_once.add('/d/flaky.csv')  # one 503, then fine: retried
    _Handler.files['/d/flaky.csv'] = content
    ps.download(f'{server}/d/flaky.csv', str(tmp_path / 'flaky.csv'), backoff=0.01)
    assert (tmp_path / 'flaky.csv').read_bytes() == content
    _Handler.drop_once.add('/d/drop.csv')  # dropped mid-stream: the retry resumes with a Range
    _Handler.files['/d/drop.csv'] = big = content * 10
    ps.download(f'{server}/d/drop.csv', str(tmp_path / 'drop.csv'), backoff=0.01)
    assert (tmp_path / 'drop.csv').read_bytes() == big
    (_, first, s1), (_, second, s2) = [x for x in _Handler.log if x[0] == '/d/drop.csv']
    assert first is None and s1 == 200 and s2 == 206
    assert 0 < int(re.fullmatch(r'bytes=(\d+)-', second).group(1)) <= len(big) // 2
    with socket.socket() as s:  # a port with nothing listening
        s.bind(('127.0.0.1', 0))
        closed_port = s.getsockname()[1]
    with pytest.raises(ps.DownloadError, match=f'GET http://127.0.0.1:{closed_port}/x.csv failed: ConnectionError'):
        ps.download(f'http://127.0.0.1:{closed_port}/x.csv', str(tmp_path / 'c.csv'), retries=0)
    # the CLI downloads from --base_url into --download_dir, then builds
    out = tmp_path / 'built'
    assert ps.main(['--base_url', f'{server}/d', '--download_dir', str(tmp_path / 'cache'), '--output_dir',
                    str(out), '--subsample_size', '10', '--num_aug', '2']) == 0
    assert load_split(out, 'train')[1]['total_puzzles'] == 30 and load_split(out, 'test')[1]['total_puzzles'] == 300


# -----------------------------------------------------------------------------
# full-size speed and memory (opt-in: about a minute to write 800 MB of CSV)

@pytest.mark.skipif(not os.environ.get('TRM_BENCH_FULL'), reason='set TRM_BENCH_FULL=1 to run the full-size build')
def test_sudoku_full_size_build_speed(tmp_path):
    d = tmp_path / 'csv'
    d.mkdir()
    write_synthetic_csv(d / 'train.csv', ps.EXPECTED_ROWS['train'], seed=1)
    write_synthetic_csv(d / 'test.csv', ps.EXPECTED_ROWS['test'], seed=2)
    cmd = ['/usr/bin/time', '-v', sys.executable, os.path.join(HERE, 'prepare_sudoku.py'), '--csv_dir', str(d),
           '--output_dir', str(tmp_path / 'out'), '--subsample_size', '1000', '--num_aug', '1000']
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE)
    assert res.returncode == 0, res.stderr
    wall = re.search(r'Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (?:(\d+):)?(\d+):([\d.]+)', res.stderr)
    seconds = int(wall.group(1) or 0) * 3600 + int(wall.group(2)) * 60 + float(wall.group(3))
    rss_mb = int(re.search(r'Maximum resident set size \(kbytes\): (\d+)', res.stderr).group(1)) / 1024
    print(f"full-size build: {seconds:.2f} s wall, {rss_mb:.0f} MB peak RSS")
    assert seconds <= 15 and rss_mb <= 1024


# -----------------------------------------------------------------------------
# prepare_maze.py

def _rows(path):
    with open(path, newline='') as f:
        return list(csv.DictReader(f))


def _write_csv(path, rows):
    with open(path, 'w', newline='') as f:
        w = csv.writer(f, lineterminator='\n')
        w.writerow(['source', 'question', 'answer', 'rating'])
        w.writerows(rows)
    return str(path)


def _tokens(*grids):
    """Mazes given as lists of row strings -> [B, n*n] tokens."""
    return pm.encode([''.join(g) for g in grids]).astype(np.int64)


@pytest.fixture(scope='module')
def gen_csv(tmp_path_factory):
    """A small generated 30x30 set (hard threshold 110), shared by the tests that only read it."""
    d = tmp_path_factory.mktemp('maze_gen') / 'csv'
    pm.generate_csvs(str(d), 24, 8, size=30, seed=0)
    return d


def test_maze_csv_roundtrip(gen_csv, tmp_path):
    out = str(tmp_path / 'ds')
    pm.build_dataset(str(gen_csv), out)
    for split, n_rows in (('train', 24), ('test', 8)):
        rows, arr, meta = _rows(gen_csv / f'{split}.csv'), load_arrays(out, split), load_metadata(out, split)
        assert len(rows) == n_rows
        assert [pm.decode(r) for r in arr['inputs']] == [r['question'] for r in rows]
        assert [pm.decode(r) for r in arr['labels']] == [r['answer'] for r in rows]
        assert meta['vocab_size'] == 6 and meta['seq_len'] == 900 and meta['pad_id'] == 0
        assert meta['ignore_label_id'] == 0 and meta['blank_identifier_id'] == 0
        assert meta['num_puzzle_identifiers'] == 1 and meta['puzzle_type'] == 'maze' and meta['grid_size'] == 30
        assert meta['total_groups'] == meta['total_puzzles'] == n_rows and meta['mean_puzzle_examples'] == 1
        assert np.array_equal(arr['puzzle_indices'], np.arange(n_rows + 1))
        assert np.array_equal(arr['group_indices'], np.arange(n_rows + 1))
        assert not arr['puzzle_identifiers'].any() and arr['inputs'].dtype == np.int32
    with open(os.path.join(out, 'identifiers.json')) as f:
        assert json.load(f) == ['<blank>']
    # other CSV dialects of the same table (CRLF, every field quoted) read the same
    rows = _rows(gen_csv / 'test.csv')
    with open(tmp_path / 'crlf.csv', 'w', newline='') as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL, lineterminator='\r\n')
        w.writerow(['source', 'question', 'answer', 'rating'])
        w.writerows([[r['source'], r['question'], r['answer'], r['rating']] for r in rows])
    q, a, n, skipped = pm.read_csv(str(tmp_path / 'crlf.csv'))
    assert n == 30 and not skipped and np.array_equal(q, load_arrays(out, 'test')['inputs'])


def test_maze_seed_determinism(gen_csv, tmp_path):
    dirs = {}
    for name, seed in (('a', 3), ('b', 3), ('c', 4)):
        dirs[name] = str(tmp_path / name)
        pm.build_dataset(str(gen_csv), dirs[name], aug=True, subsample_size=20, seed=seed)
    for split in ('train', 'test'):
        names = sorted(os.listdir(os.path.join(dirs['a'], split)))
        match, mismatch, errors = filecmp.cmpfiles(os.path.join(dirs['a'], split), os.path.join(dirs['b'], split),
                                                   names, shallow=False)
        assert match == names and not mismatch and not errors
    a, c = load_arrays(dirs['a'], 'train'), load_arrays(dirs['c'], 'train')
    assert not np.array_equal(a['inputs'], c['inputs'])
    # augmentation order alone (no subsample) also depends on the seed
    for name, seed in (('d', 1), ('e', 2)):
        pm.build_dataset(str(gen_csv), str(tmp_path / name), aug=True, seed=seed)
    assert not np.array_equal(load_arrays(str(tmp_path / 'd'), 'train')['inputs'],
                              load_arrays(str(tmp_path / 'e'), 'train')['inputs'])


def test_maze_dihedral_augmentation(gen_csv, tmp_path):
    out = str(tmp_path / 'aug')
    pm.build_dataset(str(gen_csv), out, aug=True, seed=0)
    arr, meta = load_arrays(out, 'train'), load_metadata(out, 'train')
    x, y = np.asarray(arr['inputs']), np.asarray(arr['labels'])
    assert meta['total_groups'] == 24 and meta['total_puzzles'] == 192 and len(x) == 192
    assert np.array_equal(arr['group_indices'], np.arange(0, 193, 8))
    assert pm.maze_correct(x, y).all()  # every image of a label is still an optimal path of its image
    orig = [r['question'] for r in _rows(gen_csv / 'train.csv')]
    for g in range(24):
        assert pm.decode(x[8 * g]) == orig[g]  # identity first
        images = {x[8 * g + j].tobytes() for j in range(8)}
        expected = {pm.dihedral(x[8 * g].reshape(30, 30), k).reshape(-1).tobytes() for k in range(8)}
        assert images == expected and len(images) == 8
    assert load_metadata(out, 'test')['total_puzzles'] == 8  # test is never augmented


def test_maze_generator(gen_csv, tmp_path):
    for split in ('train', 'test'):
        rows = _rows(gen_csv / f'{split}.csv')
        q, a = _tokens(*[r['question'] for r in rows]), _tokens(*[r['answer'] for r in rows])
        steps = pm.shortest_path_length(q)
        assert (steps > 110).all() and steps.tolist() == [int(r['rating']) for r in rows]
        assert pm.maze_correct(q, a).all()
        assert ((a == pm.PATH).sum(1) + 1 == steps).all()  # length = steps = 'o' cells + 1
    # same seed -> same CSVs; other sizes get a scaled default threshold; the CLI builds the dataset
    d1, d2 = tmp_path / 'g1', tmp_path / 'g2'
    for d in (d1, d2):
        pm.main(['--generate', '6', '--num_test', '3', '--size', '12', '--seed', '5', '--output_dir', str(d)])
    for split in ('train', 'test'):
        assert filecmp.cmp(d1 / 'csv' / f'{split}.csv', d2 / 'csv' / f'{split}.csv', shallow=False)
    assert pm.default_min_path_len(30) == 110 and pm.default_min_path_len(12) == 18
    arr = load_arrays(str(d1), 'train')
    assert len(arr['inputs']) == 6 and (pm.shortest_path_length(arr['inputs']) > 18).all()
    assert load_metadata(str(d1), 'test')['grid_size'] == 12


def test_maze_verifier():
    maze5 = ['#####', '#S  #', '# # #', '#  G#', '#####']  # two shortest paths (4 steps) around the pillar
    path_a = ['#####', '#Soo#', '# #o#', '#  G#', '#####']
    path_b = ['#####', '#S  #', '#o# #', '#ooG#', '#####']
    through_wall = ['#####', '#So #', '# o #', '# oG#', '#####']  # right count, crosses the pillar
    wall_changed = [' ####', '#Soo#', '# #o#', '#  G#', '#####']
    no_start = ['#####', '# oo#', '# #o#', '#  G#', '#####']
    start_as_path = ['#####', '#ooo#', '# #o#', '#  G#', '#####']
    extra_cell = ['#####', '#Soo#', '#o#o#', '#  G#', '#####']
    assert pm.shortest_path_length(_tokens(maze5)).tolist() == [4]
    preds = [path_a, path_b, through_wall, wall_changed, no_start, start_as_path, extra_cell, maze5]
    got = pm.maze_correct(_tokens(*[maze5] * len(preds)), _tokens(*preds))
    assert got.tolist() == [True, True, False, False, False, False, False, False]
    with_pad = _tokens(path_a)
    with_pad[0, 6] = pm.PAD
    assert not pm.maze_correct(_tokens(maze5), with_pad)[0]

    maze7 = ['#######', '#S   G#', '# ### #', '#     #', '# ### #', '#     #', '#######']
    short = ['#######', '#SoooG#', '# ### #', '#     #', '# ### #', '#     #', '#######']
    longer = ['#######', '#S   G#', '#o###o#', '#ooooo#', '# ### #', '#     #', '#######']
    broken = ['#######', '#So oG#', '# ### #', '#  o  #', '# ### #', '#     #', '#######']  # 3 'o', not joined
    gap = ['#######', '#So  G#', '# ### #', '#     #', '# ### #', '#     #', '#######']
    detour_loop = ['#######', '#SoooG#', '# ### #', '#oo   #', '#o### #', '#oo   #', '#######']
    assert pm.shortest_path_length(_tokens(maze7)).tolist() == [4]
    preds = [short, longer, broken, gap, detour_loop]
    got = pm.maze_correct(_tokens(*[maze7] * len(preds)), _tokens(*preds))
    assert got.tolist() == [True, False, False, False, False]
    # an open room: many shortest paths (8 steps); extra loops or detours are rejected
    room = ['#######', '#S    #', '#     #', '#     #', '#     #', '#    G#', '#######']
    stairs = ['#######', '#So   #', '# oo  #', '#  oo #', '#   o #', '#   oG#', '#######']
    ell = ['#######', '#Soooo#', '#    o#', '#    o#', '#    o#', '#    G#', '#######']
    ell_plus_cycle = ['#######', '#Soooo#', '#    o#', '#oo  o#', '#oo  o#', '#    G#', '#######']
    detour = ['#######', '#Sooo #', '#   o #', '#  oo #', '#  ooo#', '#    G#', '#######']
    assert pm.shortest_path_length(_tokens(room)).tolist() == [8]
    got = pm.maze_correct(_tokens(*[room] * 4), _tokens(stairs, ell, ell_plus_cycle, detour))
    assert got.tolist() == [True, True, False, False]
    # an unsolvable maze is never correct, and its shortest path length is -1
    closed = ['#####', '#S# #', '### #', '#  G#', '#####']
    assert pm.shortest_path_length(_tokens(closed)).tolist() == [-1]
    assert not pm.maze_correct(_tokens(closed), _tokens(closed))[0]


def test_maze_malformed_rows(gen_csv, tmp_path):
    good = [[r['source'], r['question'], r['answer'], r['rating']] for r in _rows(gen_csv / 'test.csv')[:3]]
    src, q, a, rating = good[0]
    wall = q.index('#')
    o = a.index('o')
    cases = {
        'short': ([src, q[:-1], a[:-1], rating], 'lengths'),
        'char': ([src, 'x' + q[1:], 'x' + a[1:], rating], "outside '# SG'"),
        'two_starts': ([src, q[:wall] + 'S' + q[wall + 1:], a[:wall] + 'S' + a[wall + 1:], rating], 'exactly one S'),
        'wall': ([src, q, a[:wall] + ' ' + a[wall + 1:], rating], "differs from the question"),
        'broken_path': ([src, q, a[:o] + ' ' + a[o + 1:], rating], 'not a shortest'),
        'fields': ([src, q], 'field'),
    }
    for name, (bad, reason) in cases.items():
        path = _write_csv(tmp_path / f'{name}.csv', good[:2] + [bad] + good[2:])
        with pytest.raises(ValueError, match=f"{name}.csv:4: .*{reason}"):
            pm.read_csv(path)
    path = _write_csv(tmp_path / 'all.csv', good[:1] + [bad for bad, _ in cases.values()] + good[1:])
    with pytest.raises(ValueError, match=r"all\.csv:3: .*\(5 more bad row"):
        pm.read_csv(path)
    qs, ans, n, skipped = pm.read_csv(path, skip_bad=True)
    assert skipped == len(cases) and n == 30 and [pm.decode(r) for r in qs] == [g[1] for g in good]
    (tmp_path / 'empty.csv').write_text('')
    (tmp_path / 'nohead.csv').write_text(f'{src},{q},{a},{rating}\n')
    for name in ('empty', 'nohead'):
        with pytest.raises(ValueError, match=f"{name}.csv:1: expected a header"):
            pm.read_csv(str(tmp_path / f'{name}.csv'))
    with pytest.raises(ValueError, match="no data rows"):
        pm.read_csv(_write_csv(tmp_path / 'header_only.csv', []))
    # through the CLI: an error by default, a dataset with --skip_bad
    os.makedirs(tmp_path / 'csvs')
    _write_csv(tmp_path / 'csvs' / 'train.csv', good[:1] + [cases['wall'][0]] + good[1:])
    _write_csv(tmp_path / 'csvs' / 'test.csv', good)
    with pytest.raises(ValueError, match=r"train\.csv:3:"):
        pm.main(['--csv_dir', str(tmp_path / 'csvs'), '--output_dir', str(tmp_path / 'out')])
    pm.main(['--csv_dir', str(tmp_path / 'csvs'), '--output_dir', str(tmp_path / 'out'), '--skip_bad'])
    assert load_metadata(str(tmp_path / 'out'), 'train')['total_puzzles'] == 3


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def http_dir(tmp_path):
    """Serve a temporary folder on 127.0.0.1; the server stops when the test ends."""
    root = tmp_path / 'srv'
    root.mkdir()
    server = http.server.ThreadingHTTPServer(('127.0.0.1', 0),
                                             functools.partial(_QuietHandler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, kwargs=dict(poll_interval=0.05), daemon=True)
    thread.start()
    try:
        yield root, f'http://127.0.0.1:{server.server_port}/maze'
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_maze_download(gen_csv, http_dir, tmp_path):
    root, url = http_dir
    (root / 'maze').mkdir()
    for split in ('train', 'test'):
        (root / 'maze' / f'{split}.csv').write_bytes((gen_csv / f'{split}.csv').read_bytes())
    out = str(tmp_path / 'dl')
    pm.main(['--base_url', url, '--output_dir', out])
    for split in ('train', 'test'):
        assert filecmp.cmp(os.path.join(out, 'raw', f'{split}.csv'), gen_csv / f'{split}.csv', shallow=False)
        rows = _rows(gen_csv / f'{split}.csv')
        assert [pm.decode(r) for r in load_arrays(out, split)['labels']] == [r['answer'] for r in rows]


# -----------------------------------------------------------------------------
# bench.py: smoke runs on the CPU and on CPU-XLA (speed is measured, never asserted)

BENCH_TINY = ['--global_batch_size=8', '--hidden_size=32', '--num_heads=2', '--H_cycles=2', '--L_cycles=2',
              '--halt_max_steps=3', '--steps=3', '--warmup_steps=2', '--eval_batches=1', '--forward_dtype=float32',
              '--loss_dtype=float32', '--puzzle_emb_len=1', '--puzzle_emb_ndim=32']


def bench_summary(out):
    line = [l for l in out.splitlines() if l.startswith('bench: device=')][-1]
    return dict(kv.split('=', 1) for kv in line.split()[1:])


def test_bench_runs_on_cpu_with_a_train_config(toy):
    p = run(['bench.py', 'config/baseline.py', f'--data_path={toy}', '--device=cpu'] + BENCH_TINY)
    s = bench_summary(p.stdout)
    assert s['device'] == 'cpu' and float(s['examples_per_s']) > 0 and float(s['eval_puzzles_per_s']) > 0
    assert int(s['flops_per_example']) > 0 and s['mfu'] == 'n/a'  # no peak figure for a CPU


def test_bench_on_xla_stops_compiling(tmp_path):
    p = run(['bench.py', '--device=xla', '--mlp_t=False', '--pos_encodings=rope'] + BENCH_TINY, env=XLA_ENV)
    s = bench_summary(p.stdout)
    assert s['device'] == 'xla' and float(s['ms_per_step']) > 0
    assert s['compiles_warm'] == s['compiles_end']  # the timed steps reused the warm-up graphs
    assert s['fallbacks'] == '0' and 'CPU fallbacks in training: none; in evaluation: none' in p.stdout
