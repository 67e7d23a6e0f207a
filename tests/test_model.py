"""
The model: parameter counts, reference-checkpoint equivalence, initialisation, ACT halting, the loss, FLOPs,
the optimisers (AdamATan2, sign-SGD) and the LR schedule. In-process, CPU only, seconds.
    python -m pytest -q tests/test_model.py
"""
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT, TINY
from model import TRM, TRMConfig, act_loss, from_reference_state_dict, to_reference_state_dict, token_losses
from step import AdamATan2, lr_at, sign_sgd_update_


def test_parameter_counts_match_the_reference():
    assert TRM(TRMConfig(mlp_t=True, pos_encodings='none')).num_params() == 5_028_866
    att = TRM(TRMConfig(mlp_t=False, pos_encodings='rope')).num_params()
    assert att == 6_828_034  # ~6.83M, the paper's 7M


def reference_forward(sd, cfg, inputs, puzzle_ids, n_steps):
    """TRM written straight from the paper's description as plain functions over the REFERENCE's key names,
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
        preds, q_halt, _ = m.predict(dict(inputs=inputs, puzzle_identifiers=ids), n_steps=2)
        # the model's own last logits: run heads on the same recursion
        latents = m.init_latents(3, 'cpu')
        x = m.input_embeddings(inputs, m.puzzle_rows(ids))
        with torch.no_grad():
            for _ in range(2):
                latents = m.recursion(latents, x)
            logits, qh, qc = m.heads(latents)
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
    """Both paths crash in the reference implementation."""
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
    logits = torch.tensor([[[-1.0, 0.0, 2.0]]], dtype=torch.float64)
    s = torch.tensor([1 / 2, 1.0, 3.0], dtype=torch.float64)
    want = -math.log(s[2] / s.sum())
    got = token_losses(logits, torch.tensor([[2]]), 'stablemax', 'float64')
    assert abs(got.item() - want) < 1e-12
    assert token_losses(logits, torch.tensor([[-100]]), 'stablemax', 'float64').item() == 0


def test_flops_count_the_no_grad_passes():
    m = TRM(TRMConfig(mlp_t=True, pos_encodings='none'))
    f_eval, f_train = m.flops_per_example(train=False), m.flops_per_example()
    # one net call on 97 tokens (81 cells, 16 puzzle rows; the lm_head runs on all 97): 2 * params * tokens for the
    # channel MLPs, 2 * params * D for mlp_t
    per_call = 2 * (2 * 2359296 * 97 + 2 * 148992 * 512)
    assert f_eval == 21 * per_call + 2 * 512 * 11 * 97 + 2 * 512 * 2
    assert f_train == f_eval + 2 * (7 * per_call + 2 * 512 * 11 * 97 + 2 * 512 * 2)


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


def test_adam_atan2_state_dict_resumes_exactly_in_torch_optim_layout_without_importing_dynamo(tmp_path):
    """state_dict() has torch.optim's layout (checkpoints of the torch.optim-based version load); a new optimizer
    loaded from it continues exactly; a wrong model is named; and using it never imports torch._dynamo (the
    torch.optim base class does, 2 s of CPU start-up in every run)."""
    import subprocess
    import sys
    code = r"""
import sys, torch
from step import AdamATan2
torch.manual_seed(0)
ps = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
nograd = torch.nn.Parameter(torch.randn(2))  # never gets a gradient: no state
grads = [[torch.randn_like(p) for p in ps] for _ in range(4)]
def run(opt, params, steps):
    for g in steps:
        for p, gi in zip(params, g):
            p.grad = gi.clone()
        opt.step(lr=torch.tensor(0.01))
        opt.zero_grad()
a = AdamATan2(ps + [nograd], lr=0.1, betas=(0.9, 0.95), weight_decay=0.1)
run(a, ps, grads[:2])
sd = a.state_dict()
assert sorted(sd) == ['param_groups', 'state'] and sorted(sd['state']) == [0, 1], sd['state'].keys()
assert sd['param_groups'] == [dict(lr=0.1, betas=(0.9, 0.95), weight_decay=0.1, params=[0, 1, 2])]
assert sorted(sd['state'][0]) == ['exp_avg', 'exp_avg_sq', 't'] and sd['state'][0]['t'].item() == 2
torch.save(dict(optimizer=sd), sys.argv[1])
copies = [torch.nn.Parameter(p.detach().clone()) for p in ps]
b = AdamATan2(copies + [torch.nn.Parameter(nograd.detach().clone())], lr=0.1, betas=(0.9, 0.95), weight_decay=0.1)
b.load_state_dict(torch.load(sys.argv[1], weights_only=True)['optimizer'])
run(a, ps, grads[2:])
run(b, copies, grads[2:])
assert all(torch.equal(p, q) for p, q in zip(ps, copies))
try:
    AdamATan2(ps).load_state_dict(sd)
    raise AssertionError('loaded into a model with other parameters')
except ValueError as e:
    assert 'groups of [3] parameters; this model has one group of 2' in str(e), e
print('dynamo imported:', 'torch._dynamo' in sys.modules)
"""
    p = subprocess.run([sys.executable, '-c', code, str(tmp_path / 'opt.pt')], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert 'dynamo imported: False' in p.stdout, p.stdout


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


def test_stablemax_in_float32_has_a_finite_gradient_at_a_logit_of_one():
    """bfloat16 logits land on exactly 1.0 often; the branch for negative logits, 1/(1 - x), is unused there but
    its gradient (1e30 squared) overflows float32 and would turn the whole gradient into NaN."""
    logits = torch.tensor([[[1.0, -0.5, 0.25, 2.0]]], requires_grad=True)
    for dtype in ('float32', 'float64'):
        loss = token_losses(logits, torch.tensor([[1]]), 'stablemax', dtype).sum()
        grad, = torch.autograd.grad(loss, logits)
        assert torch.isfinite(grad).all(), (dtype, grad)
        s = torch.tensor([2.0, 1 / 1.5, 1.25, 3.0], dtype=torch.float64)  # s(x) of each logit
        assert abs(loss.item() - float(-torch.log(s[1] / s.sum()))) < 1e-6


def test_predict_asks_should_stop_between_steps_without_a_chunk():
    """predict's should_stop alone (no chunk) is asked after every step while steps remain; a stop abandons."""
    m = TRM(TRMConfig(**TINY)).eval()
    batch = dict(inputs=torch.randint(0, 6, (3, 8)), puzzle_identifiers=torch.tensor([0, 2, 1]))
    asked = []
    preds, q_halt, halted = m.predict(batch, 3, should_stop=lambda: asked.append(1) and False)
    assert preds.shape == (3, 3, 8) and len(asked) == 2
    assert m.predict(batch, 3, should_stop=lambda: True) is None
