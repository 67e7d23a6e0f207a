"""
Tiny Recursive Model (TRM), "Less is More: Recursive Reasoning with Tiny Networks" (arXiv 2510.04871).

One 2-layer network `net` is applied recursively to a latent answer y and a latent reasoning state z, given the
embedded question x:
    n = L_cycles times: z = net(z, y + x);   then: y = net(y, z)
repeated T = H_cycles times per supervision step, gradients only through the last repetition. An ACT
head (q_head) learns when to stop; training runs one supervision step per optimizer step, carrying
y and z across at most N_sup = halt_max_steps steps (deep supervision). The optimizers and the training
step are in step.py, evaluation in evaluate.py.

Everything in a step follows the rules that keep XLA (TPU) from recompiling: static shapes, torch.where
instead of boolean indexing, no host reads of tensor values, fixed loop counts.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

IGNORE_LABEL_ID = -100  # labels the loss skips: data.py maps each dataset's own ignore label to this value

# The latent state a supervision step carries, each [B, total_len, hidden_size]: y, the answer, and z, the
# reasoning state (the reference's z_H and z_L). Every latent starts a fresh row from a fixed random vector, a
# buffer under the reference's name (TRM.__init__ makes one per latent). The carry, checkpoints, the memory check
# and solve.py go by these two tables: a recursion with another set of latents changes them, TRMConfig.net_calls
# and TRM.recursion.
LATENTS = ('y', 'z')
INIT_BUFFERS = dict(y='H_init', z='L_init')


# the values a model's choice keys allow (train.py and solve.py list them too, before they import torch, with
# 'auto' for the dtypes, which they resolve for the hardware; a house test keeps their lists equal to these)
MODEL_CHOICES = dict(pos_encodings=('rope', 'learned', 'none'), loss_type=('stablemax', 'softmax'),
                     forward_dtype=('bfloat16', 'float16', 'float32'), loss_dtype=('float64', 'float32'))


@dataclass
class TRMConfig:
    vocab_size: int = 11
    seq_len: int = 81
    num_puzzle_identifiers: int = 1
    hidden_size: int = 512
    num_heads: int = 8
    expansion: float = 4.0
    L_layers: int = 2
    H_cycles: int = 3
    L_cycles: int = 6
    halt_max_steps: int = 16
    halt_exploration_prob: float = 0.1
    pos_encodings: str = 'none'
    mlp_t: bool = True               # MLP-mixer over the sequence instead of attention (Sudoku)
    puzzle_emb_ndim: int = 512       # 0 disables the puzzle embedding
    puzzle_emb_len: int = 16         # prefix tokens reserved for it
    forward_dtype: str = 'bfloat16'
    no_ACT_continue: bool = True     # False: also learn q_continue against a bootstrapped target
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    loss_type: str = 'stablemax'
    loss_dtype: str = 'float64'      # stablemax precision; TPUs want 'float32'
    mlp_multiple: int = 256          # SwiGLU inner widths round up to a multiple of this (the reference's)

    def __post_init__(self):
        for k, allowed in MODEL_CHOICES.items():
            if getattr(self, k) not in allowed:
                raise ValueError(f"{k}={getattr(self, k)!r}: allowed {', '.join(map(repr, allowed))}")
        if not self.mlp_t and self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}")
        if self.puzzle_emb_ndim > self.puzzle_emb_len * self.hidden_size:
            raise ValueError("puzzle_emb_ndim must fit in puzzle_emb_len * hidden_size")

    @classmethod
    def for_data(cls, meta, **keys):
        """The config of a model for a dataset (its dataset.json): shapes from the data, the rest `keys`."""
        return cls(vocab_size=meta['vocab_size'], seq_len=meta['seq_len'],
                   num_puzzle_identifiers=meta['num_puzzle_identifiers'], **keys)

    @property
    def total_len(self):  # sequence length inside the model (Sudoku: 81 + 16 = 97)
        return self.seq_len + (self.puzzle_emb_len if self.puzzle_emb_ndim > 0 else 0)

    @property
    def prefix_len(self):
        return self.total_len - self.seq_len

    def latent_bytes(self, itemsize):
        """The bytes of one row's latents (every name in LATENTS) at `itemsize` bytes per number."""
        return len(LATENTS) * self.total_len * self.hidden_size * itemsize

    def net_calls(self):
        """The calls of `net` that TRM.recursion makes in one supervision step: (all of them, those with grad)."""
        per_round = self.L_cycles + 1
        return self.H_cycles * per_round, per_round


# the TRMConfig fields a run chooses (train.py's keys); the others come from the dataset
MODEL_KEYS = [f for f in TRMConfig.__dataclass_fields__
              if f not in ('vocab_size', 'seq_len', 'num_puzzle_identifiers')]


# -----------------------------------------------------------------------------
# building blocks

def trunc_normal_(t, std):
    """JAX-style truncated normal: cut at +-2 sigma, rescaled so the std really is `std`."""
    # the std of a unit normal truncated to [-2, 2]
    z = 0.8796256610342398
    with torch.no_grad():
        nn.init.trunc_normal_(t, mean=0.0, std=1.0, a=-2.0, b=2.0)
        t.mul_(std / z)
    return t


def round_up(x, multiple):
    return -(-x // multiple) * multiple


# mlp_t pads the sequence axis of its matmuls to a multiple of this (exactly; see Block). 1: no padding.
# Not a TRMConfig field: it changes no result and no parameter, only the speed (bench.py --seq_align=).
SEQ_ALIGN = 8


def swiglu_inter(d, expansion, multiple=256):
    """A SwiGLU's inner width: 2/3 of expansion * d, rounded up to `multiple`. The reference's 256 keeps a toy
    model's MLPs at least 256 wide whatever its d, most of its compute; a smaller multiple keeps them to scale."""
    return round_up(round(expansion * d * 2 / 3), multiple)


def rms_norm(x, eps):
    """RMSNorm without weight over the last axis, computed in fp32 as the reference does."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return x.to(dtype)


class CastedLinear(nn.Module):
    """Weights kept fp32 (optimizer and EMA see fp32), cast to the activation dtype in forward. The net runs
    many times a step (TRMConfig.net_calls); compiled (CUDA), inductor's graph CSE merges the repeated casts
    into one per weight per step, so no cast cache is kept here."""
    def __init__(self, d_in, d_out, bias=False):
        super().__init__()
        self.weight = nn.Parameter(trunc_normal_(torch.empty(d_out, d_in), std=1.0 / math.sqrt(d_in)))
        self.bias = nn.Parameter(torch.zeros(d_out)) if bias else None

    def forward(self, x, pad_in=0, pad_out=0):
        """pad_in / pad_out: zero columns / zero rows appended to the weight at use (the parameter keeps its
        shape), for an input padded with pad_in extra features and an output with pad_out extra ones."""
        w = self.weight.to(x.dtype)
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        if pad_in or pad_out:
            w = F.pad(w, (0, pad_in, 0, pad_out))
            bias = F.pad(bias, (0, pad_out)) if bias is not None else None
        return F.linear(x, w, bias)


class CastedEmbedding(nn.Module):
    def __init__(self, num, dim, std):
        super().__init__()
        self.embedding_weight = nn.Parameter(trunc_normal_(torch.empty(num, dim), std=std))

    def forward(self, idx, dtype):
        return F.embedding(idx, self.embedding_weight.to(dtype))


class SwiGLU(nn.Module):
    def __init__(self, d, expansion, multiple=256):
        super().__init__()
        inter = swiglu_inter(d, expansion, multiple)
        self.gate_up_proj = CastedLinear(d, 2 * inter)  # rows: [gate, up]
        self.down_proj = CastedLinear(inter, d)

    def forward(self, x, pad=0):
        """pad > 0: x's last axis carries `pad` padding features past the real d. The weights get zero
        columns (gate_up) and zero rows (down) at use, so whatever the padding holds is multiplied by 0,
        and the output's padded features (all 0) are cut off: the result is that of the real d features."""
        gate, up = self.gate_up_proj(x, pad_in=pad).chunk(2, dim=-1)
        out = self.down_proj(F.silu(gate) * up, pad_out=pad)
        return out[..., :out.shape[-1] - pad] if pad else out


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, hidden_size, num_heads):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.qkv_proj = CastedLinear(hidden_size, 3 * hidden_size)  # rows: [q heads, k heads, v heads]
        self.o_proj = CastedLinear(hidden_size, hidden_size)

    def forward(self, x, rope):
        B, S, D = x.shape
        qkv = self.qkv_proj(x).view(B, S, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.unbind(2)  # [B, S, heads, hd]
        if rope is not None:
            cos, sin = rope  # [S, hd] fp32
            cos, sin = cos[:, None, :], sin[:, None, :]
            q = (q.float() * cos + rotate_half(q.float()) * sin).to(x.dtype)
            k = (k.float() * cos + rotate_half(k.float()) * sin).to(x.dtype)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=False)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, D))


class Block(nn.Module):
    """Post-norm block: attention (or a SwiGLU over the sequence axis, mlp_t) then a channel SwiGLU.
    mlp_t's matmuls run on the sequence axis padded to a multiple of seq_align (97 -> 104 for Sudoku):
    GPU matmul kernels want that axis, the leading dimension of both of its matrices, a multiple of 8
    (16 bytes in bf16). Exact: the padding meets zero weight columns and its outputs are cut off before the
    residual and the RMSNorm, which therefore still normalise over the true length. Parameters unchanged."""
    def __init__(self, cfg: TRMConfig, seq_align=None):
        super().__init__()
        self.eps = cfg.rms_norm_eps
        if cfg.mlp_t:
            self.mlp_t = SwiGLU(cfg.total_len, cfg.expansion, cfg.mlp_multiple)
            self.seq_pad = round_up(cfg.total_len, seq_align or SEQ_ALIGN) - cfg.total_len
        else:
            self.self_attn = Attention(cfg.hidden_size, cfg.num_heads)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.expansion, cfg.mlp_multiple)

    def mix_sequence(self, h):
        """mlp_t: [B, S, D] -> [B, S, D], a SwiGLU across positions, then RMSNorm over the sequence axis."""
        h = h.transpose(1, 2)  # [B, D, S]
        x = F.pad(h, (0, self.seq_pad)) if self.seq_pad else h  # one copy, as the transpose needed one anyway
        return rms_norm(h + self.mlp_t(x, pad=self.seq_pad), self.eps).transpose(1, 2)

    # A fused forward of this block, fused(block, h, rope), that backends/kernels.py installs (the kernels key), or
    # None: the forward below. The fused one computes the same function, within the forward dtype's rounding.
    fused = None

    def forward(self, h, rope):
        if self.fused is not None:
            return self.fused(self, h, rope)
        if hasattr(self, 'mlp_t'):
            h = self.mix_sequence(h)
        else:
            h = rms_norm(h + self.self_attn(h, rope), self.eps)
        return rms_norm(h + self.mlp(h), self.eps)


class Net(nn.Module):
    """The one network used for both updates: net(h, injection) = blocks(h + injection)."""
    def __init__(self, cfg: TRMConfig, seq_align=None):
        super().__init__()
        self.layers = nn.ModuleList([Block(cfg, seq_align) for _ in range(cfg.L_layers)])

    def forward(self, h, injection, rope):
        h = h + injection
        for layer in self.layers:
            h = layer(h, rope)
        return h


# -----------------------------------------------------------------------------
# the model

class TRM(nn.Module):
    def __init__(self, cfg: TRMConfig, seq_align=None):
        """seq_align: mlp_t's padding of the sequence axis (default SEQ_ALIGN; 1 turns it off)."""
        super().__init__()
        self.config = cfg
        D = cfg.hidden_size
        self.embed_scale = math.sqrt(D)
        self.forward_dtype = getattr(torch, cfg.forward_dtype)
        self.embed_tokens = CastedEmbedding(cfg.vocab_size, D, std=1.0 / self.embed_scale)
        self.lm_head = CastedLinear(D, cfg.vocab_size)
        self.q_head = CastedLinear(D, 2, bias=True)
        with torch.no_grad():  # start by never halting: q_halt = -5
            self.q_head.weight.zero_()
            self.q_head.bias.fill_(-5.0)
        if cfg.pos_encodings == 'learned':
            self.embed_pos = CastedEmbedding(cfg.total_len, D, std=1.0 / self.embed_scale)
        if cfg.pos_encodings == 'rope':
            hd = D // cfg.num_heads
            inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
            freqs = torch.outer(torch.arange(cfg.total_len, dtype=torch.float32), inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            self.register_buffer('rope_cos', emb.cos(), persistent=False)
            self.register_buffer('rope_sin', emb.sin(), persistent=False)
        self.net = Net(cfg, seq_align)
        # Not parameters: the main optimizer and the EMA must not touch them (as in the reference).
        # The puzzle embedding is trained by sign-SGD (step.sign_sgd_update_); H_init/L_init stay fixed.
        self.register_buffer('puzzle_emb',
                             torch.zeros(cfg.num_puzzle_identifiers, max(cfg.puzzle_emb_ndim, 1)))
        for name in LATENTS:
            self.register_buffer(INIT_BUFFERS[name], trunc_normal_(torch.empty(D), std=1.0))

    # --- one supervision step of the recursion -------------------------------------------------

    def input_embeddings(self, inputs, puzzle_rows):
        cfg = self.config
        x = self.embed_tokens(inputs.long(), self.forward_dtype)
        if cfg.puzzle_emb_ndim > 0:
            B = inputs.shape[0]
            pad = cfg.prefix_len * cfg.hidden_size - cfg.puzzle_emb_ndim
            prefix = F.pad(puzzle_rows, (0, pad)).view(B, cfg.prefix_len, cfg.hidden_size)
            x = torch.cat((prefix.to(self.forward_dtype), x), dim=1)
        if cfg.pos_encodings == 'learned':
            x = 0.707106781 * (x + self.embed_pos.embedding_weight.to(self.forward_dtype))
        return self.embed_scale * x

    def rope(self):
        return (self.rope_cos, self.rope_sin) if self.config.pos_encodings == 'rope' else None

    def recursion(self, latents, x):
        """T = H_cycles rounds of { n = L_cycles z-updates, then a y-update }; grad through the last only.
        latents: {name: tensor} for every name in LATENTS; returns the next ones."""
        cfg, rope = self.config, self.rope()
        y, z = latents['y'], latents['z']
        with torch.no_grad():
            for _ in range(cfg.H_cycles - 1):
                for _ in range(cfg.L_cycles):
                    z = self.net(z, y + x, rope)
                y = self.net(y, z, rope)
        for _ in range(cfg.L_cycles):
            z = self.net(z, y + x, rope)
        y = self.net(y, z, rope)
        return dict(y=y, z=z)

    def heads(self, latents):
        """The answer's logits [B, seq_len, vocab] and the halting logits q_halt, q_continue [B], read off y."""
        y = latents['y']
        logits = self.lm_head(y)[:, self.config.prefix_len:]
        q = self.q_head(y[:, 0]).float()
        return logits, q[..., 0], q[..., 1]

    def puzzle_rows(self, puzzle_identifiers):
        return self.puzzle_emb[puzzle_identifiers.long()] if self.config.puzzle_emb_ndim > 0 else None

    def init_latents(self, B, device):
        """Fresh latents of B rows: {name: [B, total_len, hidden_size]} for every name in LATENTS."""
        shape = (B, self.config.total_len, self.config.hidden_size)
        # contiguous, like every later carry: a compiled step then sees one layout from its first call on
        return {name: getattr(self, INIT_BUFFERS[name]).to(self.forward_dtype).expand(shape).contiguous()
                .to(device) for name in LATENTS}

    # --- ACT: one call = one supervision step -----------------------------------------------------

    def initial_carry(self, batch):
        """All rows halted, so the first call loads every row of its batch."""
        B, device = batch['inputs'].shape[0], batch['inputs'].device
        return dict(self.init_latents(B, device), steps=torch.zeros(B, dtype=torch.int32, device=device),
                    halted=torch.ones(B, dtype=torch.bool, device=device),
                    **{k: torch.zeros_like(v) for k, v in batch.items()})

    def refill(self, carry, batch):
        """Halted rows restart: fresh latents, steps 0, and the new batch's row at the same index."""
        h = carry['halted']
        new = {name: torch.where(h[:, None, None], fresh, carry[name])
               for name, fresh in self.init_latents(h.shape[0], h.device).items()}
        new.update(steps=torch.where(h, torch.zeros_like(carry['steps']), carry['steps']), halted=h)
        for k, v in batch.items():
            new[k] = torch.where(h.view(-1, *([1] * (v.dim() - 1))), v, carry[k])
        return new

    def forward(self, carry, puzzle_rows=None):
        """One supervision step on an already refilled carry. puzzle_rows [B, puzzle_emb_ndim] are
        passed in (not looked up here) so the trainer can take their gradient for sign-SGD.
        Returns the next carry (detached latents) and the step's outputs."""
        cfg = self.config
        if puzzle_rows is None:
            puzzle_rows = self.puzzle_rows(carry['puzzle_identifiers'])
        x = self.input_embeddings(carry['inputs'], puzzle_rows)
        latents = self.recursion({name: carry[name] for name in LATENTS}, x)
        logits, q_halt, q_continue = self.heads(latents)

        steps = carry['steps'] + 1
        is_last = steps >= cfg.halt_max_steps
        halted = is_last
        out = dict(logits=logits, q_halt=q_halt, q_continue=q_continue)
        if self.training and cfg.halt_max_steps > 1:
            halted = halted | halts(q_halt, q_continue, cfg).detach()
            # exploration: some rows draw a minimum number of steps before they may halt
            explore = torch.rand(q_halt.shape, device=q_halt.device) < cfg.halt_exploration_prob
            min_steps = torch.randint(2, cfg.halt_max_steps + 1, steps.shape, device=steps.device,
                                      dtype=steps.dtype)
            halted = halted & (steps >= torch.where(explore, min_steps, torch.zeros_like(min_steps)))
            if not cfg.no_ACT_continue:
                # bootstrapped Q-learning target from one more (no-grad) step from the new latents
                with torch.no_grad():
                    nxt = self.recursion({k: v.detach() for k, v in latents.items()}, x.detach())
                    _, next_halt, next_cont = self.heads(nxt)
                out['target_q_continue'] = torch.sigmoid(
                    torch.where(is_last, next_halt, torch.maximum(next_halt, next_cont)))
        new_carry = dict(carry, **{k: v.detach() for k, v in latents.items()}, steps=steps, halted=halted)
        return new_carry, out

    # --- evaluation: a fixed number of steps from fresh latents, no halting -----------------------

    def predict_step(self, latents, x, labels=None):
        """One evaluation supervision step: the next latents, the predictions [B, seq_len], q_halt [B] and
        whether each row halts there [B] (halts); given labels, also each row's loss [B] (its tokens' mean,
        the training's lm loss)."""
        latents = self.recursion(latents, x)
        logits, q_halt, q_continue = self.heads(latents)
        pred = logits.argmax(-1).to(torch.int32)
        halt = halts(q_halt, q_continue, self.config)
        if labels is None:
            return latents, pred, q_halt, halt
        n_valid = (labels != IGNORE_LABEL_ID).sum(-1).clamp_min(1)
        loss = token_losses(logits, labels, self.config.loss_type, self.config.loss_dtype).sum(-1) / n_valid
        return latents, pred, q_halt, halt, loss.float()

    def predict_start(self, inputs, puzzle_identifiers):
        """An evaluation batch's fresh latents and its input embedding: (latents, x)."""
        return (self.init_latents(inputs.shape[0], inputs.device),
                self.input_embeddings(inputs, self.puzzle_rows(puzzle_identifiers)))

    @torch.no_grad()
    def predict(self, batch, n_steps, step=None, start=None, loss_at=None, should_stop=None, chunk=1,
                on_step=None):
        """Run n_steps supervision steps on a fresh batch (all rows start together, so no ACT carry is
        needed). Returns per-step predictions [n_steps, B, seq_len], q_halt and halts [n_steps, B], and with
        loss_at (a step's index) that step's loss of each row [B] against batch['labels'].
        step, start: what runs one step and the start (default self.predict_step and self.predict_start;
        compiled_predict passes compiled ones). should_stop: asked after every `chunk` steps while steps
        remain (a verdict every rank reaches at the same step); when it says stop, None: the batch is
        abandoned. on_step(i, pred, q_halt, halt): called after step i (a watchdog's heartbeat, solve.py's view of
        each step); when it returns True the batch ends there, with the steps done so far."""
        step, start = step or self.predict_step, start or self.predict_start
        latents, x = start(batch['inputs'], batch['puzzle_identifiers'])
        preds, q_halts, halted, loss = [], [], [], None
        for i in range(n_steps):
            if should_stop is not None and i and i % chunk == 0 and should_stop():
                return None
            if i == loss_at:  # a graph of its own, with the loss: the other steps' stay as they are
                latents, pred, q_halt, halt, loss = step(latents, x, batch['labels'])
            else:
                latents, pred, q_halt, halt = step(latents, x)
            preds.append(pred)
            q_halts.append(q_halt)
            halted.append(halt)
            if on_step is not None and on_step(i, pred, q_halt, halt):
                break
        return (torch.stack(preds), torch.stack(q_halts), torch.stack(halted)) + (() if loss_at is None else (loss,))

    # --- bookkeeping ------------------------------------------------------------------------------

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def flops_per_example(self, train=True):
        """Model FLOPs for one supervision step of one example: every net call of the recursion,
        no-grad passes included, plus heads; for the calls that carry grad, the backward: the activations'
        gradients (1x forward) and the gradients of the weights that train (1x their forward: none with
        frozen weights, whose backward only carries the gradient down to the puzzle rows).
        With train=False: forward only (one evaluation step)."""
        cfg, D, S = self.config, self.config.hidden_size, self.config.total_len
        net = net_trained = 0
        for name, p in self.net.named_parameters():
            # a [out, in] weight costs 2*out*in per vector it is applied to: S (positions) vectors for
            # channel layers, D vectors for the sequence-mixing mlp_t
            cost = 2 * p.numel() * (D if '.mlp_t.' in name else S)
            net += cost
            net_trained += cost * p.requires_grad
        if not cfg.mlp_t:  # QK^T and AV: both factors are activations, so both gradients are the activations'
            net += cfg.L_layers * 4 * S * S * D
            net_trained += cfg.L_layers * 4 * S * S * D
        # the lm_head runs on every position, the puzzle rows' too, before their logits are dropped
        lm_head, q_head = 2 * D * cfg.vocab_size * S, 2 * D * 2
        heads = lm_head + q_head
        heads_trained = lm_head * self.lm_head.weight.requires_grad + q_head * self.q_head.weight.requires_grad
        calls, grad_calls = cfg.net_calls()
        fwd = calls * net + heads
        if not train:
            return fwd
        bootstrap = (calls * net + heads) if not cfg.no_ACT_continue else 0
        return fwd + grad_calls * (net + net_trained) + heads + heads_trained + bootstrap


def halts(q_halt, q_continue, cfg: TRMConfig):
    """Whether each row stops, by the rule its halting head learned: q_halt > 0, or, where q_continue learned
    the value of going on (no_ACT_continue False), q_halt > q_continue. Training halts by it; evaluation's
    and solve.py's early stop follow it (the reference-defined q_halt accuracy and ARC's confidences read
    q_halt alone)."""
    return (q_halt > 0) if cfg.no_ACT_continue else (q_halt > q_continue)


def halt_rule(cfg: TRMConfig):
    """halts' rule in words, for what solve.py prints."""
    return 'q_halt > 0' if cfg.no_ACT_continue else 'q_halt > q_continue'


# -----------------------------------------------------------------------------
# loss: stablemax cross-entropy (the paper's default) or softmax, plus the ACT halting losses

def log_stablemax(x, dim=-1):
    # the negative branch clamped: where it is unused (x >= 0) its gradient would be 1 / (1 - x)^2, which
    # overflows float32 at x = 1 (a common bfloat16 logit) and turns the masked-out 0 into NaN
    s = torch.where(x < 0, 1 / (1 - x.clamp(max=0) + 1e-30), x + 1)
    return torch.log(s / s.sum(dim=dim, keepdim=True))


def token_losses(logits, labels, loss_type, loss_dtype):
    """Per-token cross-entropy [B, seq_len], zero where labels are IGNORE_LABEL_ID."""
    valid = labels != IGNORE_LABEL_ID
    safe = torch.where(valid, labels, torch.zeros_like(labels)).long()
    if loss_type == 'stablemax':
        logp = log_stablemax(logits.to(getattr(torch, loss_dtype)))
    else:
        logp = torch.log_softmax(logits.float(), dim=-1)
    nll = -torch.gather(logp, -1, safe.unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, nll, torch.zeros_like(nll))


def act_loss(carry, out, cfg: TRMConfig):
    """Loss summed over the batch (the trainer divides by the global batch size) and metric sums
    over the rows that halted this step. All device tensors: nothing here reads a value on the host."""
    labels = carry['labels']
    logits = out['logits']
    valid = labels != IGNORE_LABEL_ID
    n_valid = valid.sum(-1)
    divisor = n_valid.clamp_min(1).float()
    is_correct = valid & (logits.argmax(-1) == labels)
    seq_correct = is_correct.sum(-1) == n_valid

    lm_loss = (token_losses(logits, labels, cfg.loss_type, cfg.loss_dtype).sum(-1) / divisor).float().sum()
    q_halt_loss = F.binary_cross_entropy_with_logits(out['q_halt'], seq_correct.float(), reduction='sum')
    q_continue_loss = torch.zeros_like(q_halt_loss)
    if 'target_q_continue' in out:
        q_continue_loss = F.binary_cross_entropy_with_logits(out['q_continue'], out['target_q_continue'],
                                                             reduction='sum')
    loss = lm_loss + 0.5 * (q_halt_loss + q_continue_loss)

    counted = carry['halted'] & (n_valid > 0)
    f = counted.float()
    metrics = dict(
        count=f.sum(),
        accuracy=(f * is_correct.sum(-1).float() / divisor).sum(),
        exact_accuracy=(f * seq_correct.float()).sum(),
        q_halt_accuracy=(f * ((out['q_halt'] >= 0) == seq_correct).float()).sum(),
        steps=(f * carry['steps'].float()).sum(),
        lm_loss=lm_loss.detach(), q_halt_loss=q_halt_loss.detach(), q_continue_loss=q_continue_loss.detach(),
    )
    return loss, metrics


# -----------------------------------------------------------------------------
# reference checkpoints: its state_dict keys are '_orig_mod.model.inner.*' (torch.compile + loss wrapper)

def from_reference_state_dict(sd):
    """Map a state_dict saved by the reference implementation (keys '_orig_mod.model.inner.*', with or
    without the prefix) onto this model's names."""
    out = {}
    for k, v in sd.items():
        for prefix in ('_orig_mod.', 'model.', 'inner.'):
            if k.startswith(prefix):
                k = k[len(prefix):]
        if k.startswith('L_level.'):
            k = 'net.' + k[len('L_level.'):]
        if k == 'puzzle_emb.weights':
            k = 'puzzle_emb'
        out[k] = v
    return out


def to_reference_state_dict(sd):
    """The inverse of from_reference_state_dict, with the reference's full prefix."""
    out = {}
    for k, v in sd.items():
        if k.startswith('net.'):
            k = 'L_level.' + k[len('net.'):]
        if k == 'puzzle_emb':
            k = 'puzzle_emb.weights'
        out['_orig_mod.model.inner.' + k] = v
    return out
