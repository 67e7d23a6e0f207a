"""
What happens in one optimizer step, on every device (CPU, CUDA, XLA): AdamATan2 for the weights, sign-SGD
for the puzzle embedding, the warmup + cosine LR schedule, the EMA, the training step (forward, loss,
backward, gradient all-reduce, update) and its compiled forms, with the compiled form of the evaluation's
predict (all of torch.compile's use in one place). train.py, bench.py and solve.py share it, so each measures
and runs the same step; the evaluation pass is in evaluate.py.

Everything inside a step follows the rules that keep XLA (TPU) from recompiling: static shapes, torch.where
instead of boolean indexing, no host reads of tensor values, the step count and LR on the device.
"""
import functools
import math
from dataclasses import dataclass

import torch

from model import act_loss

# -----------------------------------------------------------------------------
# optimisation: AdamATan2 for the weights, sign-SGD for the puzzle embedding, warmup + cosine LR

class AdamATan2:
    """Adam with atan2 in place of m / (sqrt(v) + eps): no epsilon, bounded updates. Pure PyTorch
    (foreach), so it runs on CPU, CUDA and XLA. The learning rate may be a device tensor, and the step
    count lives on the device, so a changing LR or bias correction never recompiles an XLA graph.
    A plain class rather than a torch.optim.Optimizer: that base class imports torch._dynamo on its first
    call, a start-up cost for every run that never compiles. Its state_dict has torch.optim's
    layout."""
    def __init__(self, params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0):
        self.params = list(params)
        self.lr, self.betas, self.weight_decay = lr, betas, weight_decay
        # per parameter, made at its first gradient: {'t', 'exp_avg', 'exp_avg_sq'}. A list, not a dict keyed
        # by the parameters: torch.compile would guard on those keys' gradients, which change every step
        self.state = [None] * len(self.params)

    def _grads(self, grads):
        return [p.grad for p in self.params] if grads is None else grads

    @torch.no_grad()
    def init_state(self, grads=None):
        """Create the state of every parameter that has a gradient in grads (step() does it too; a compiled
        step calls this first, eagerly, so that its graph never changes when the state appears)."""
        for i, (p, g) in enumerate(zip(self.params, self._grads(grads))):
            if g is not None and self.state[i] is None:
                self.state[i] = dict(t=torch.zeros((), dtype=torch.float32, device=p.device),
                                     exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))

    @torch.no_grad()
    def step(self, grads=None, lr=None):
        """The update, on every path: grads in the parameters' order (None for a parameter without one),
        or each parameter's .grad. XLA's one-graph step passes the gradients it computed, which never
        become .grad."""
        grads = self._grads(grads)
        self.init_state(grads)
        live = [i for i, g in enumerate(grads) if g is not None]
        if not live:
            return
        m = [self.state[i]['exp_avg'] for i in live]
        v = [self.state[i]['exp_avg_sq'] for i in live]
        t = self.state[live[0]]['t']
        adam_atan2_([self.params[i] for i in live], [grads[i] for i in live], m, v, t,
                    self.lr if lr is None else lr, self.betas, self.weight_decay)
        for i in live[1:]:
            if self.state[i]['t'] is not t:  # XLACompiled makes them one tensor
                self.state[i]['t'].copy_(t)

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def state_dict(self):
        """torch.optim's layout: the state by parameter index, one parameter group."""
        return dict(state={i: dict(st) for i, st in enumerate(self.state) if st is not None},
                    param_groups=[dict(lr=self.lr, betas=self.betas, weight_decay=self.weight_decay,
                                       params=list(range(len(self.params))))])

    def load_state_dict(self, sd):
        """The moments and step counts of a state_dict() (this class's or torch.optim's layout of one group).
        The hyperparameters stay this run's: a resume that changes weight_decay or the betas uses the new
        ones."""
        sizes = [len(g['params']) for g in sd['param_groups']]
        if sizes != [len(self.params)]:
            raise ValueError(f"optimizer state for parameter groups of {sizes} parameters; this model has "
                             f"one group of {len(self.params)}")
        state = [None] * len(self.params)
        for i, st in sd['state'].items():
            p = self.params[int(i)]
            if st['exp_avg'].shape != p.shape:
                raise ValueError(f"optimizer state of parameter {i} has shape {tuple(st['exp_avg'].shape)}; "
                                 f"the parameter {tuple(p.shape)}")
            state[int(i)] = {k: v.to(p.device) if k == 't' else v.to(p.device, p.dtype)
                             for k, v in st.items()}
        self.state = state


@torch.no_grad()
def adam_atan2_(params, grads, m, v, t, lr, betas, weight_decay):
    """AdamATan2's update of params, their moments m and v and the step count t (one 0-d tensor), in place."""
    b1, b2 = betas
    t.add_(1)
    torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_lerp_(m, grads, 1 - b1)
    torch._foreach_mul_(v, b2)
    torch._foreach_addcmul_(v, grads, grads, value=1 - b2)
    bc1 = 1 - b1 ** t
    bc2_sqrt = torch.sqrt(1 - b2 ** t)
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, bc2_sqrt)
    upd = [torch.atan2(mi, di) for mi, di in zip(m, denom)]
    torch._foreach_mul_(upd, lr / bc1)
    torch._foreach_sub_(params, upd)


@torch.no_grad()
def sign_sgd_update_(table, ids, grads, lr, weight_decay):
    """Sign-SGD on the puzzle embedding rows a batch touched: w = w*(1 - lr*wd) - lr*sign(sum of grads
    per id), each touched row decayed once, every other row unchanged. ids [N] and grads [N, dim] are the
    GLOBAL batch's. Only the batch's rows are read and written, so no temporary is table-sized (ARC-1's
    table is 876,406 rows), and every shape is static: the reference's unique() is data-dependent.
    Duplicate ids are summed through each id's first position in the batch (an [N, N] comparison, N the
    global batch): index_add_ into [N, dim] adds each id's gradients in the batch's order, as a table-sized
    index_add_ would, and a matrix product would not be exact (a TPU multiplies float32 in bfloat16 passes
    by default). The table then gets new - w at each id's first position and 0 at its repeats, added in place:
    a compiled step (inductor) fuses the row reads into that write, so a repeat may read a row already
    updated, and only a zero is safe to add from it (an index_copy_ of the new rows would decay it twice)."""
    ids = ids.long()
    n = ids.shape[0]
    pos = torch.arange(n, device=ids.device)
    first = torch.where(ids[:, None] == ids[None, :], pos[None, :], n).amin(dim=1)
    summed = torch.zeros(n, grads.shape[1], dtype=table.dtype, device=table.device).index_add_(
        0, first, grads.to(table.dtype)).index_select(0, first)
    rows = table.index_select(0, ids)
    new = rows * (1 - lr * weight_decay) - lr * torch.sign(summed)
    table.index_add_(0, ids, torch.where((first == pos)[:, None], new - rows, 0.0))


def lr_at(step, base_lr, warmup_steps, total_steps, min_ratio):
    """Linear warmup, then cosine to min_ratio * base_lr (0 from the last step on with min_ratio = 0). `step`
    (0-based, the step about to run) may be a tensor, so the schedule runs on the device. The warmup starts at
    base_lr / warmup_steps, not at 0: an XLA graph specialises on 0."""
    step = torch.as_tensor(step, dtype=torch.float32)
    warm = base_lr * (step + 1) / max(1, warmup_steps)
    progress = ((step + 1 - warmup_steps) / max(1, total_steps - warmup_steps)).clamp(0, 1)
    cos = base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + torch.cos(math.pi * progress)))
    return torch.where(step + 1 < warmup_steps, warm, cos)


def evaluation_steps(run_steps, eval_every):
    """The steps after which a run evaluates (and saves): every eval_every steps, and the last one; an
    evaluation less than half an interval before the last is skipped."""
    return [s for s in range(eval_every, run_steps, eval_every)
            if run_steps - s >= eval_every // 2] + [run_steps]


# -----------------------------------------------------------------------------
# the training step, shared by train.py and bench.py on every device

@dataclass(frozen=True)
class StepConfig:
    """What one optimizer step needs besides the model and the batch. Frozen: torch.compile treats its fields
    as constants of the compiled step."""
    lr: float                        # AdamATan2's base learning rate
    puzzle_emb_lr: float             # sign-SGD's base learning rate
    puzzle_emb_weight_decay: float
    warmup_steps: int                # linear warmup, then cosine to min_ratio * lr at total_steps
    total_steps: int
    min_ratio: float
    global_batch_size: int           # the loss is summed over the global batch, then divided by this
    ema_rate: float = None           # None: no EMA
    grad_clip: float = 0.0           # clip the global gradient norm to this (0: never, as the reference)
    gradient_accumulation_steps: int = 1  # micro-batches per step: the same update, less activation memory
    freeze_weights: bool = False     # only the puzzle embedding trains: no gradient, update or EMA of the
                                     # weights (the caller sets their requires_grad False: train.py does)

    def lr_at(self, step, base):
        return lr_at(step, base, self.warmup_steps, self.total_steps, self.min_ratio)


def forward_loss(model, carry, batch, puzzle_rows):
    """Refill halted rows, run one supervision step, compute the loss. The part worth torch.compile."""
    carry = model.refill(carry, batch)
    new_carry, out = model(carry, puzzle_rows)
    loss, metrics = act_loss(new_carry, out, model.config)
    return new_carry, loss, metrics


@torch.no_grad()
def ema_update_(ema_params, params, step_t, rate):
    """ema = decay * ema + (1 - decay) * params. The decay warms up, min(rate, (1 + step) / (10 + step)):
    early on an average over the steps so far, so short runs evaluate trained weights."""
    decay = torch.clamp((1 + step_t) / (10 + step_t), max=rate)
    torch._foreach_mul_(ema_params, decay)
    torch._foreach_add_(ema_params, torch._foreach_mul(params, 1 - decay))


@torch.no_grad()
def clip_grads_(grads, max_norm):
    """The gradients' global norm (a device tensor); with max_norm > 0 they are scaled down to it, by a factor
    of 1 below the limit, so nothing branches on a device value."""
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    if max_norm > 0:
        torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm


@torch.no_grad()
def apply_update(model, opt, ema_params, grads, ids, row_grads, step_t, sc):
    """Everything after the (all-reduced) gradients, the one update of every step form (eager, CUDA's and XLA's
    compiled ones): clipping, AdamATan2, sign-SGD on the puzzle embedding rows of the global batch (ids,
    row_grads; None without a puzzle embedding), the EMA, the step count. grads: the parameters' gradients in
    opt.params' order (None for a parameter without one). Returns the gradient's global norm before clipping
    (a device tensor; 0 with sc.freeze_weights, which updates the puzzle embedding only: the weights have no
    gradients then, and their EMA would only round them)."""
    if sc.freeze_weights:
        norm = torch.zeros((), device=step_t.device)
    else:
        norm = clip_grads_([g for g in grads if g is not None], sc.grad_clip)
        opt.step(grads, lr=sc.lr_at(step_t, sc.lr))
    if row_grads is not None:  # sign-SGD: the sign of the summed gradient, so clipping would not change it
        sign_sgd_update_(model.puzzle_emb, ids, row_grads, sc.lr_at(step_t, sc.puzzle_emb_lr),
                         sc.puzzle_emb_weight_decay)
    if sc.ema_rate is not None and not sc.freeze_weights:
        ema_update_(ema_params, list(model.parameters()), step_t, sc.ema_rate)
    step_t.add_(1)
    return norm


# --- the step's forms: what computes the gradients and what applies them, eager or compiled -----------------
# train_step below is the one training step of every device; a form supplies its parts: `grads` (the forward,
# the loss and the backward of one micro-batch) and `update` (apply_update), and `whole`, a whole step of one
# micro-batch in one process as a single compiled graph, where the device has one (XLA).

def rows_of_carry(carry, batch, rows):
    """The micro-batch `rows` = (a, b) of the carry and the batch (the whole of them when it is all rows)."""
    a, b = rows
    if a == 0 and b == batch['inputs'].shape[0]:
        return carry, batch
    return {k: v[a:b] for k, v in carry.items()}, {k: v[a:b] for k, v in batch.items()}


def with_rows(carry, rows, new):
    """The carry with its rows (a, b) replaced by the micro-batch's new carry."""
    a, b = rows
    if a == 0 and b == carry['inputs'].shape[0]:
        return new
    return {k: torch.cat([carry[k][:a], v, carry[k][b:]]) for k, v in new.items()}


def rows_at(tensors, start, m):
    """Rows start .. start + m of each tensor, `start` a 0-d device tensor: XLA's form cuts its micro-batches so,
    as one compiled graph serves them all (a Python int is a constant of the graph: one graph each)."""
    return {k: v.index_select(0, start + torch.arange(m, device=start.device)) for k, v in tensors.items()}


def put_rows_at(tensors, start, new):
    """`tensors` with their rows start .. start + m replaced by `new`'s m rows (rows_at's inverse): a gather of
    new's rows into place and a select, no scatter."""
    n, m = tensors['inputs'].shape[0], new['inputs'].shape[0]
    pos = torch.arange(n, device=start.device) - start
    inside = (pos >= 0) & (pos < m)
    at = pos.clamp(0, m - 1)
    return {k: torch.where(inside.view(-1, *[1] * (v.dim() - 1)), v.index_select(0, at), tensors[k])
            for k, v in new.items()}


class Eager:
    """The step as written: forward_loss and autograd, then apply_update (the CPU's; the base of the others)."""
    forward = staticmethod(forward_loss)
    whole = None  # a compiled whole step (forward, backward, update: one graph), where a device has one

    def grads(self, model, carry, batch, rows, sc):
        """Forward, loss and backward of the micro-batch `rows` of the carry: the parameters' .grad add up.
        Returns the whole carry with those rows' new state, their loss and metric sums, and the gradient of
        their puzzle embedding rows (None without a puzzle embedding)."""
        c, b = rows_of_carry(carry, batch, rows)
        # the puzzle embedding rows of the refilled carry, as a leaf whose gradient drives sign-SGD
        ids = torch.where(c['halted'], b['puzzle_identifiers'], c['puzzle_identifiers'])
        emb = model.puzzle_rows(ids).detach().requires_grad_(True) if model.config.puzzle_emb_ndim > 0 else None
        new_c, loss, metrics = self.forward(model, c, b, emb)
        (loss / sc.global_batch_size).backward()  # summed over all ranks' rows: a global mean; grads add up
        return with_rows(carry, rows, new_c), loss.detach(), metrics, None if emb is None else emb.grad

    def update(self, model, opt, ema_params, grads, ids, row_grads, step_t, sc):
        return apply_update(model, opt, ema_params, grads, ids, row_grads, step_t, sc)


class Compiled(Eager):
    """CUDA's and TorchTPU's form: forward_loss (the forward and, through AOTAutograd, its backward) and
    apply_update (optimizer, sign-SGD, EMA: a few fused kernels instead of dozens of small ones), each compiled
    once with static shapes, by inductor in `mode` or by the named torch.compile `backend`. The backward call
    and the gradient all-reduce stay between them."""
    def __init__(self, mode='default', backend=None):
        kw = dict(backend=backend) if backend else dict(mode=mode)
        self.forward = torch.compile(forward_loss, dynamic=False, **kw)
        self._update = torch.compile(apply_update, dynamic=False, **kw)

    def update(self, model, opt, ema_params, grads, ids, row_grads, step_t, sc):
        opt.init_state(grads)  # eagerly: the compiled graph never sees the state appear
        return self._update(model, opt, ema_params, grads, ids, row_grads, step_t, sc)


def compiled_predict(model, mode='default', backend=None):
    """model.predict with each supervision step compiled (one graph for all n_steps: the loop stays in Python,
    so the compile time is that of one step, not of n_steps unrolled). CUDA: inductor in `mode`, or the
    torch.compile `backend` named (TorchTPU's); XLA:
    xla_backend, the start (latents, embedding) compiled too: a compiled step given pending lazy inputs
    runs them first as a graph of their own, one at the first batch, another at the later ones (a
    compilation more). Built once per model and mode, then reused."""
    cache = model.__dict__.setdefault('_compiled_predict', {})
    xla = model.lm_head.weight.device.type == 'xla'
    key = 'xla' if xla else backend or mode
    if key not in cache:
        kw = dict(backend=xla_backend) if xla else dict(backend=backend) if backend else dict(mode=mode)
        start = torch.compile(model.predict_start, dynamic=False, **kw) if xla else None
        cache[key] = functools.partial(model.predict, start=start,
                                       step=torch.compile(model.predict_step, dynamic=False, **kw))
    return cache[key]


# --- XLA: the step traced once ----------------------------------------------------------------------------
# torch_xla traces a lazy step in Python at every step; TRM's has many network calls (TRMConfig.net_calls), so
# the host, not the chip, would bound a TPU's step. Compiled through dynamo, each part becomes a cached
# executable after its first call: no Python tracing, no graph hashing per step.

def xla_backend(gm, example_inputs):
    """torch.compile's backend for XLA: dynamo's graph, as captured, traced once on lazy tensors by torch_xla's
    dynamo bridge, compiled, then replayed with each call's tensors (what backend='openxla' ends in too). Unlike
    'openxla', no AOTAutograd first: a torch.func.grad in the graph runs as torch's autograd on lazy tensors,
    so the backward is the eager step's own (its formulas, its HLO), and the first call skips AOTAutograd's
    retrace and the bridge's CPU-fallback partitioner, both of which lengthen the first training step. An op
    with no XLA lowering would run on the CPU during that one trace and its result
    would be frozen into the graph as a constant: the fallback counters are read around the trace, and such a
    graph goes to the bridge's partitioning path instead, which runs those ops on the CPU at every call.
    Called under no_grad, as every compiled function here is: the replayed graph's outputs carry no autograd
    history (a torch.func.grad inside it is fine)."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met
    from torch_xla._dynamo import dynamo_bridge as bridge

    def fallbacks():
        return {n: met.counter_value(n) for n in met.counter_names() if n.startswith('aten::')}
    compiled = None

    def run(*args):
        nonlocal compiled
        if compiled is None:
            if torch.is_grad_enabled():  # the bridge's in-place updates of parameters would be recorded
                raise RuntimeError(f"xla_backend: call {gm.__class__.__name__} under torch.no_grad(): a replayed "
                                   "graph's outputs carry no autograd history")
            before, seed = fallbacks(), xm.get_rng_state()
            torch_xla.sync()
            bridge.XLAConstructorMoverPass()(gm.graph)  # tensors the graph creates: on the XLA device
            gm.recompile()
            gm.xla_args = args
            compiled = bridge.extract_internal(gm)
            if fallbacks() != before:  # the trace restored the inputs and dropped its pending IR: trace again
                compiled = bridge.extract_compiled_graph(gm, args)
            xm.set_rng_state(seed)  # the graph's draws as at a later call: the syncs above advanced the generator
        out = compiled(*args)
        return out if isinstance(out, (tuple, list)) else (out,)  # the bridge unpacks a graph's single output
    return run


def _xla_grads(model, carry, batch, global_batch_size, rows, weights=True):
    """XLACompiled's forward and backward as ONE graph: on the micro-batch `rows` of the carry and the batch (None: all
    of them; else (start, m): rows_at's, one graph for every micro-batch of m rows), the refill, the puzzle-row lookup,
    the supervision step and the loss, and the gradients of loss / global_batch_size (train_step's division: the same
    rounding) with respect to the parameters (not with weights=False: freeze_weights) and the puzzle rows
    (torch.func.grad, traced into the same graph). Nothing crosses from a forward graph to a backward one, so the
    backward uses the forward's activations where they are, as the eager step's graph does: no recomputation, no
    per-tensor bridge cost. Called under no_grad (torch.func.grad ignores it). Returns the whole carry with those rows
    replaced, the loss, the metrics, the parameters' gradients by name ({} with weights=False) and the puzzle rows'
    (None without a puzzle embedding)."""
    c, x = (carry, batch) if rows is None else (rows_at(carry, *rows), rows_at(batch, *rows))
    c = model.refill(c, x)
    emb = model.puzzle_rows(c['puzzle_identifiers'])  # the refilled rows' ids, as the eager form's

    def scaled_loss(params, emb):  # forward_loss after its refill, the parameters as arguments
        new_c, out = torch.func.functional_call(model, params, (c, emb))
        loss, metrics = act_loss(new_c, out, model.config)
        return loss / global_batch_size, (new_c, loss, metrics)
    params = dict(model.named_parameters())
    argnums = 0 if emb is None else (0, 1) if weights else 1
    grad = torch.func.grad(scaled_loss, argnums=argnums, has_aux=True)
    grads, (new_c, loss, metrics) = grad(params, emb)
    grads, row_grads = (grads, None) if emb is None else grads if weights else ({}, grads)
    return new_c if rows is None else put_rows_at(carry, rows[0], new_c), loss, metrics, grads, row_grads


def _xla_step(model, opt, ema_params, carry, batch, step_t, sc):
    """XLACompiled's whole step as ONE graph (one process, one micro-batch): _xla_grads, then apply_update
    on those gradients, with no bridge between them. The gradients never become .grad (no graph outputs, no
    host work for them). Returns the new carry, the loss and the metrics with grad_norm."""
    carry, loss, metrics, grads, row_grads = _xla_grads(model, carry, batch, sc.global_batch_size, None,
                                                        not sc.freeze_weights)
    grads = [grads.get(n) for n, _ in model.named_parameters()]  # opt.params' order (XLACompiled checks)
    norm = apply_update(model, opt, ema_params, grads, carry['puzzle_identifiers'], row_grads, step_t, sc)
    return carry, loss, dict(metrics, grad_norm=norm)


class XLACompiled(Eager):
    """train_step's form on XLA, traced once (xla_backend). One process with one micro-batch: the whole step
    (forward, loss, backward, clipping, AdamATan2, sign-SGD, EMA) is ONE graph (_xla_step), as the eager
    step's lazy graph is. Otherwise (a pod, or gradient accumulation) two: the forward + loss + backward
    (_xla_grads, once per micro-batch) and the update (apply_update), with the gradient all-reduce and gather
    between them: dynamo (torch_xla 2.9) traces neither the in-place list all-reduce that Device uses (only
    the one-tensor xm.all_reduce) nor xm.all_gather (it reads the device's ordinal while tracing), and one graph
    over k micro-batches would let XLA keep all k micro-batches' activations alive at once.
    The same computation as the eager form up to float rounding, and the same device work: the forward and
    backward graph holds the eager step's matrix products, one for one.
    What torch_xla 2.9's dynamo bridge needs, and gets here:
      - no compiled input with pending lazy IR (the bridge would run it first as a graph of its own,
        blocking): the puzzle rows are looked up inside, and a micro-batch's rows are cut inside;
      - no two mutated inputs that end with the same value (the bridge then writes outputs into the wrong
        inputs): AdamATan2's per-parameter step counts become one tensor, updated once."""
    ONE = 'one_graph (forward, backward and update one graph: torch.func.grad inside the compiled step)'
    TWO = ('grad_graph+update_graph (the forward and backward one graph through torch.func.grad, '
           'the update another)')
    variant = ONE  # the path the last step took (TWO on pods and with gradient accumulation)

    def __init__(self):
        self._whole = torch.compile(_xla_step, backend=xla_backend, dynamic=False)
        self._grads = torch.compile(_xla_grads, backend=xla_backend, dynamic=False)
        self._update = torch.compile(apply_update, backend=xla_backend, dynamic=False)
        self._starts = {}  # each micro-batch's first row, a 0-d device tensor (rows_at)

    def whole(self, model, opt, ema_params, carry, batch, step_t, sc):
        """The whole step as one graph where it can be (one process, one micro-batch), else None."""
        import torch_xla.runtime as xr
        one = sc.gradient_accumulation_steps == 1 and xr.world_size() == 1
        self.variant = self.ONE if one else self.TWO
        if not one:
            return None
        if any(st is None for st in opt.state) and not sc.freeze_weights:  # the first step: every state, eagerly
            params = list(model.parameters())
            if len(params) != len(opt.params) or any(a is not b for a, b in zip(params, opt.params)):
                raise ValueError("XLACompiled: the optimizer's parameters are not model.parameters() in order "
                                 "(_xla_step passes the gradients in that order); build "
                                 "AdamATan2(model.parameters(), ...)")
            # every parameter gets a gradient from torch.func.grad; init_state reads only its shape
            opt.init_state([p.detach() for p in params])
        self._one_step_count(opt, sc.freeze_weights)
        with torch.no_grad():
            return self._whole(model, opt, ema_params, carry, batch, step_t, sc)

    def grads(self, model, carry, batch, rows, sc):
        (a, b), B = rows, batch['inputs'].shape[0]
        if (a, b) == (0, B):
            rows = None
        else:  # the first row on the device, made once (device data: no lazy IR into the compiled graph)
            key = (a, str(batch['inputs'].device))
            rows = self._starts.setdefault(key, torch.tensor(a).to(batch['inputs'].device)), b - a
        with torch.no_grad():  # as xla_backend requires
            carry, loss, metrics, grads, row_grads = self._grads(model, carry, batch, sc.global_batch_size, rows,
                                                                 not sc.freeze_weights)
        named = dict(model.named_parameters())
        for n, g in grads.items():  # micro-batches add up lazily, as autograd's accumulation does
            named[n].grad = g if named[n].grad is None else named[n].grad + g
        return carry, loss, metrics, row_grads

    def update(self, model, opt, ema_params, grads, ids, row_grads, step_t, sc):
        opt.init_state(grads)  # eagerly: the compiled graph never sees the state appear
        self._one_step_count(opt, sc.freeze_weights)
        with torch.no_grad():  # as xla_backend requires
            return self._update(model, opt, ema_params, grads, ids, row_grads, step_t, sc)

    @staticmethod
    def _one_step_count(opt, frozen):
        if frozen:  # AdamATan2 holds no state
            return
        t = opt.state[0]['t']
        for st in opt.state[1:]:
            st['t'] = t  # one step count (equal values in any case)


def step_form(kind, compile=True, mode='default', backend=None):
    """The training step's form for a device kind: with compile=True, CUDA's and TorchTPU's Compiled
    (inductor in `mode`, or the torch.compile `backend` named), XLA's XLACompiled; otherwise, and on the CPU
    (where compiling would not pay for itself), Eager."""
    if compile and kind in ('cuda', 'tpu'):
        return Compiled(mode, backend)
    return XLACompiled() if compile and kind == 'xla' else Eager()


def train_step(model, opt, ema_params, carry, batch, step_t, sc, form=None, all_reduce_sum_=None,
               all_gather=None):
    """One optimizer step = one supervision step: forward, loss, backward (in sc.gradient_accumulation_steps
    micro-batches, each with its own rows of the ACT carry), gradient all-reduce, clipping, AdamATan2,
    sign-SGD on the puzzle embedding, EMA. No host reads, static shapes (the XLA rules above).
    sc: the StepConfig (the EMA's decay rises to its ema_rate: min(ema_rate, (1 + step) / (10 + step))).
    form: Eager (the default), Compiled or XLACompiled (step_form). Returns the new carry, the loss summed over
    this rank's rows, and the metric sums (grad_norm included)."""
    form = form or Eager()
    if form.whole is not None and (done := form.whole(model, opt, ema_params, carry, batch, step_t, sc)):
        return done
    k, B = sc.gradient_accumulation_steps, batch['inputs'].shape[0]
    losses, sums, row_grads = [], None, []
    for i in range(k):
        carry, loss, metrics, rg = form.grads(model, carry, batch, (i * B // k, (i + 1) * B // k), sc)
        losses.append(loss)
        row_grads.append(rg)
        sums = metrics if sums is None else {n: sums[n] + metrics[n] for n in sums}
    if all_reduce_sum_ is not None and not sc.freeze_weights:
        all_reduce_sum_([p.grad for p in opt.params])
    ids_all = grads_all = None
    if row_grads[0] is not None:  # the refilled carry's identifiers are the rows the gradients belong to
        gather = all_gather or (lambda t: t)
        ids_all = gather(carry['puzzle_identifiers'])
        grads_all = gather(row_grads[0] if k == 1 else torch.cat(row_grads))
    sums['grad_norm'] = form.update(model, opt, ema_params, [p.grad for p in opt.params], ids_all, grads_all,
                                    step_t, sc)
    opt.zero_grad()
    return carry, losses[0] if k == 1 else torch.stack(losses).sum(), sums


def read_sums(dev, sums, bad_step):
    """The metric sums since the last log line, summed over ranks, and the first step whose loss was not
    finite (< 0: none): one reduction, read on every rank. grad_norm is the mean over ranks, as every rank
    holds the same all-reduced gradient."""
    reduced = torch.cat([v.float().reshape(1) for v in sums.values()])
    dev.all_reduce_sum_([reduced])
    dev.all_reduce_([bad_step], 'max')
    host, bad_at = dev.read([reduced, bad_step])
    out = dict(zip(sums, host))
    if 'grad_norm' in out:
        out['grad_norm'] /= dev.world_size
    return out, bad_at[0]


def format_train(line, run_steps, compiles=None):
    """A training log line; XLA's add the host's and the device's time per step and the compilations so
    far. A line in whose steps no row halted has no accuracies or steps: n/a."""
    def halted(k, spec):
        return format(line[k], spec) if k in line else 'n/a'
    text = (f"step {line['step']}/{run_steps} | epoch {line['epoch']:.1f} | loss {line['loss']:.4f} | "
            f"acc {halted('accuracy', '.4f')} | exact {halted('exact_accuracy', '.4f')} | "
            f"steps {halted('steps', '.1f')} | grad_norm {line['grad_norm']:.3f} | lr {line['lr']:.2e} | "
            f"{line['examples_per_s']:.0f} ex/s")
    if 'host_ms' in line:  # XLA: the host's tracing and dispatch, and the device's execution, per step
        text += f" | host_ms {line['host_ms']:.1f} | device_ms {line['device_ms']:.1f}"
    return text + (f" | compiles {compiles}" if compiles is not None else '')
