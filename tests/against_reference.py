"""
The published layout checked with the reference implementation's own code, in both directions (docs/published.md
shows a run of it). Not part of the suite: it needs the reference's source and a few of its requirements, which
this repository does not hold. On the CPU, tiny widths, float32 and bfloat16:
    git --git-dir=REFERENCE_MIRROR archive e7b6871 | tar x -C /tmp/trm_ref    # the reference's files
    python -m venv /tmp/refvenv && /tmp/refvenv/bin/pip install einops coolname argdantic omegaconf hydra-core
    (plus this project's requirements in that venv, or a .pth file pointing at them)
    /tmp/refvenv/bin/python tests/against_reference.py --reference=/tmp/trm_ref --work=/tmp/refcheck
1. ours -> reference: train.py trains a few steps, publish.py writes step_<N>, all_config.yaml and the train state;
   the reference's PretrainConfig parses all_config.yaml, its model is built from it (as its create_model does, on
   the CPU), its pretrain.load_checkpoint loads step_<N> (strict, assign=True), and its forward on a test batch of
   its own PuzzleDataset is compared step by step with this trainer's model holding the checkpoint's EMA weights.
   The train state's optimizer dicts load into the reference's sign-SGD and into a torch.optim optimizer over its
   parameters (the reference's AdamATan2 is CUDA-only; its state has the same keys), each moment on the parameter
   of the same name.
2. reference -> ours: the reference's model, built from its own Hydra config files (with tiny overrides) and
   initialised by its own code, its puzzle table filled with random rows; torch.save(model.state_dict()) as its
   save_train_state does, and all_config.yaml (with copies of trm.py and losses.py) written by its own
   save_code_and_config. This trainer reads that folder through its --init_from path with no model key given
   (train.py --eval_only prints the start-up line), and its outputs are compared with the reference's.
3. training steps side by side: for the reference's default variants that run unpatched (attention with RoPE and
   mlp_t; stablemax loss, no_ACT_continue=True, float32), the reference's model and loss head (ACTLossHead) with the
   optimizers its create_model makes and its own pretrain.train_batch (forward in training mode, backward, its
   compute_lr warm-up and cosine, its sign-SGD CastedSparseEmbeddingSignSGD_Distributed as is) beside this
   trainer's step.train_step (Eager form: our AdamATan2, sign_sgd_update_ and lr_at), 12 steps (LR warm-up over 3,
   then cosine down to 0.1 x at step 12), each started from the same state: before every step the reference's
   weights, puzzle table, AdamATan2 moments and step count, ACT carry and step number are copied into ours, and
   both draw the same exploration numbers (one seed). Hard settings: halt_exploration_prob 0.5, a q_head that
   halts some rows before halt_max_steps, a random puzzle table, 16 rows over 5 puzzle identifiers (repeats in
   every batch), a quarter of the labels ignored (-100) and one row with every label ignored. Checked after each
   step: halted, steps, the carried batch rows and the integer metrics (count, exact_accuracy, q_halt_accuracy,
   steps) equal; q_continue_loss 0 in ours and absent in the reference; the carried latents, the loss, lm_loss,
   q_halt_loss, accuracy, both learning rates, every parameter, the AdamATan2 step count and moments, and the whole
   puzzle table equal within float32 rounding: |ours - theirs| <= 8 float32 epsilons of the value's size (|value|;
   for a parameter or table row |value| + the update's size, lr / (1 - beta1^t) or the puzzle LR; for a moment the
   tensor's largest |value|). Each step prints a line; each variant the largest difference of each quantity, in
   absolute terms and in those epsilons. EMA is not compared here (ema=False, its default; check 5). Not run: the
   variants that crash in the reference's code (no_ACT_continue=False, softmax_cross_entropy), and bfloat16.
4. evaluation metrics side by side: the reference's own pretrain.evaluate (its ACTLossHead's metrics, on the CPU)
   and this trainer's evaluate.evaluate on the same weights and test split (padding, ignored labels, rows without
   labels, rows right and wrong, q_halt on both sides of 0), for check 3's variants in float32 and bfloat16.
5. the EMA: train_step's, after its warm-up, beside the reference's EMAHelper, with gradient accumulation too.
The reference's adam_atan2 import (a CUDA extension: its kernel only runs on an NVIDIA GPU) is replaced by a stub
module whose AdamATan2 is AdamATan2Formula below: the adam-atan2 package's (0.0.3, the latest; the reference's
requirements.txt names it unpinned) Python step and its CUDA kernel's arithmetic (csrc/adam_atan2.cu) written in
PyTorch, so that check 3 compares this trainer's optimizer with the package's formula, not with itself. Checks 1
and 2 do not step it.
"""
import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import types

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {  # train.py's keys; the reference's arch names are the same
    'attention+rope': dict(mlp_t=False, pos_encodings='rope'),
    'mlp_t (no positions)': dict(mlp_t=True, pos_encodings='none'),
    'attention+learned': dict(mlp_t=False, pos_encodings='learned'),
    'mlp_t, no puzzle table': dict(mlp_t=True, pos_encodings='none', puzzle_emb_ndim=0),  # the quick start's
}
TINY = dict(hidden_size=32, num_heads=2, expansion=2.0, H_cycles=2, L_cycles=2, L_layers=2, halt_max_steps=4,
            puzzle_emb_ndim=32, puzzle_emb_len=2)


TRAIN_VARIANTS = ('attention+rope', 'mlp_t (no positions)')  # check 3: the reference's defaults that run unpatched
TRAIN = dict(lr=1e-2, puzzle_emb_lr=1e-1, weight_decay=0.1, puzzle_emb_weight_decay=0.1, beta1=0.9, beta2=0.95,
             lr_warmup_steps=3, lr_min_ratio=0.1, total_steps=12, steps=12, batch=16, ids=5)


class AdamATan2Formula(torch.optim.Optimizer):
    """What stands in for the reference's AdamATan2 (check 3). The adam-atan2 package (0.0.3) is a Python
    Optimizer around a CUDA kernel: its step() makes each parameter's state at its first gradient (step: a float32
    0-d tensor, exp_avg and exp_avg_sq: zeros), adds 1 to the step, then its kernel (csrc/adam_atan2.cu) computes
    per element, in float32 for float32 parameters, with its scalars worked out in float64 and rounded to float32:
        p = p * (1 - lr * weight_decay)
        m = lerp(m, g, 1 - beta1);  v = lerp(v, g * g, 1 - beta2)     lerp(a, b, w) = fma(w, b, fma(-w, a, a))
        p = p - lr / (1 - beta1^step) * atan2(m, sqrt(v) / sqrt(1 - beta2^step))
    Written here with the kernel's order of operations; each fused multiply-add (the lerp's explicit fma, and the
    last line, which nvcc contracts into one by default) is computed in float64 and rounded once to float32. Not the
    kernel's bits (a GPU's sqrt, division and atan2 may round differently from the CPU's), but the same formula
    rounded in float32, which is what this trainer's AdamATan2 is compared with (it computes v as v*beta2 +
    (1-beta2)*g*g and its LR and bias corrections in float32 on the device, so the two differ by float32 rounding)."""
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), weight_decay=1e-2):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        def fma(a, b, c):  # float32 in, float32 out: a*b of two float32 values is exact in float64
            return (a.double() * b.double() + c.double()).float()

        def f32(x):  # a scalar worked out in float64, rounded to float32
            return torch.tensor(x, dtype=torch.float64).float()

        for group in self.param_groups:
            lr, (beta1, beta2), wd = group['lr'], group['betas'], group['weight_decay']
            for p in group['params']:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(step=torch.zeros((), dtype=torch.float32), exp_avg=torch.zeros_like(p),
                                 exp_avg_sq=torch.zeros_like(p))
                state['step'] += 1
                t = float(state['step'])
                step_size, wd_alpha = f32(lr / (1 - beta1 ** t)), f32(1 - lr * wd)
                bc2_sqrt, mb1, mb2 = f32((1 - beta2 ** t) ** 0.5), f32(1 - beta1), f32(1 - beta2)
                g, m, v = p.grad, state['exp_avg'], state['exp_avg_sq']
                param = p * wd_alpha
                m.copy_(fma(mb1, g, fma(-mb1, m, m)))
                v.copy_(fma(mb2, g * g, fma(-mb2, v, v)))
                p.copy_(fma(-step_size, torch.atan2(m, torch.sqrt(v) / bc2_sqrt), param))



def slug(variant, dtype):
    return re.sub(r'[^a-z0-9]+', '_', f'{variant} {dtype}')


def write_dataset(root, n=240, ids=12, L=12, seed=0):
    """The reverse task with `ids` puzzle identifiers (so the table matters), in the shared dataset layout."""
    sys.path.insert(0, ROOT)
    from data import write_split
    rng = np.random.default_rng(seed)
    for split in ('train', 'test'):
        x = rng.integers(2, 6, (n, L))
        write_split(root, split, x, x[:, ::-1], rng.integers(1, ids, n), np.arange(n + 1), np.arange(n + 1),
                    vocab_size=6, num_puzzle_identifiers=ids)
    return root


def reference_batch(data, batch_size=16):
    """The first test batch of the reference's own PuzzleDataset (labels mapped to -100 as it maps them)."""
    from puzzle_dataset import PuzzleDataset, PuzzleDatasetConfig
    ds = PuzzleDataset(PuzzleDatasetConfig(seed=0, dataset_paths=[data], rank=0, num_replicas=1,
                                           test_set_mode=True, epochs_per_iter=1, global_batch_size=batch_size),
                       split='test')
    _, batch, _ = next(iter(ds))
    return {k: v.clone() for k, v in batch.items()}, ds.metadata


def reference_model(config, meta, batch_size):
    """The reference's model as its create_model builds it (loss head, torch.compile's wrapper), on the CPU."""
    from utils.functions import load_model_class
    model_cfg = dict(**config.arch.__pydantic_extra__, batch_size=batch_size, vocab_size=meta.vocab_size,
                     seq_len=meta.seq_len, num_puzzle_identifiers=meta.num_puzzle_identifiers, causal=False)
    model = load_model_class(config.arch.name)(model_cfg)
    model = load_model_class(config.arch.loss.name)(model, **config.arch.loss.__pydantic_extra__)
    return torch.compile(model)  # only the wrapper (its state dict names): the forward runs _orig_mod, eagerly


def reference_outputs(model, batch):
    """Every supervision step's logits and q_halt of the reference's evaluation loop (pretrain.evaluate)."""
    model = model._orig_mod.eval()
    logits, q_halt = [], []
    with torch.inference_mode():
        carry = model.initial_carry(batch)
        while True:
            carry, _, _, out, done = model(carry=carry, batch=batch, return_keys=['logits', 'q_halt_logits'])
            logits.append(out['logits'].float())
            q_halt.append(out['q_halt_logits'].float())
            if done:
                return torch.stack(logits), torch.stack(q_halt)


def our_outputs(model, batch, steps):
    """The same from this trainer's model: its evaluation's steps (predict_start, recursion, heads)."""
    model.eval()
    logits, q_halt = [], []
    with torch.no_grad():
        latents, x = model.predict_start(batch['inputs'], batch['puzzle_identifiers'])
        for _ in range(steps):
            latents = model.recursion(latents, x)
            lg, qh, _ = model.heads(latents)
            logits.append(lg.float())
            q_halt.append(qh.float())
    return torch.stack(logits), torch.stack(q_halt)


def compare(name, ours, theirs):
    (lo, qo), (lt, qt) = ours, theirs
    same_pred = bool((lo.argmax(-1) == lt.argmax(-1)).all())
    line = (f"{name}: {lo.shape[0]} steps x {lo.shape[1]} rows: logits max |diff| {(lo - lt).abs().max():.3g} "
            f"(largest |logit| {lt.abs().max():.3g}), q_halt max |diff| {(qo - qt).abs().max():.3g}, "
            f"predictions {'all equal' if same_pred else 'DIFFER'}")
    print(line)
    return same_pred


def ours_to_reference(args, data, variant, keys, dtype):
    """1: a run of train.py, published, loaded and run by the reference's code."""
    import yaml
    from pretrain import PretrainConfig, load_checkpoint
    from models.sparse_embedding import CastedSparseEmbeddingSignSGD_Distributed
    from runkeep.checkpoint import load_checkpoint as load_ours
    from model import TRM, TRMConfig
    out = os.path.join(args.work, 'ours', slug(variant, dtype))
    flags = [f'--{k}={v}' for k, v in dict(TINY, **keys).items()]
    subprocess.run([sys.executable, 'train.py', f'--data_path={data}', f'--out_dir={out}', '--device=cpu',
                    '--max_steps=6', '--global_batch_size=24', '--epochs=50', '--eval_every_epochs=1000',
                    f'--forward_dtype={dtype}', '--xla_cache_dir=', '--overwrite=True',
                    '--lr_warmup_steps=2', '--lr=1e-2', '--puzzle_emb_lr=1e-1'] + flags,
                   cwd=ROOT, check=True, capture_output=True)
    ckpt_path = os.path.join(out, 'ckpt_00000006.pt')
    pub = subprocess.run([sys.executable, 'publish.py', f'--init_from={ckpt_path}', '--train_state=True'],
                         cwd=ROOT, check=True, capture_output=True, text=True)
    folder = os.path.join(out, 'published')
    config = PretrainConfig(**yaml.safe_load(open(os.path.join(folder, 'all_config.yaml'))))
    config.load_checkpoint = os.path.join(folder, 'step_6')
    batch, meta = reference_batch(data)
    model = reference_model(config, meta, batch_size=16)
    if config.arch.puzzle_emb_ndim:
        load_checkpoint(model, config)  # the reference's loader: strict, assign=True
    else:  # its loader reads the table's shape first, which a model without one lacks: its load call alone
        model.load_state_dict(torch.load(config.load_checkpoint, map_location='cpu'), assign=True)
    theirs = reference_outputs(model, batch)
    ckpt = load_ours(ckpt_path)
    cfg = {k: ckpt['config'][k] for k in TRMConfig.__dataclass_fields__ if k in ckpt['config']}
    ours_model = TRM(TRMConfig.for_data(json.load(open(os.path.join(data, 'train', 'dataset.json'))),
                                        **dict(cfg, forward_dtype=dtype, loss_dtype='float64')))
    ours_model.load_state_dict(ckpt['ema'])
    same = compare(f"ours -> reference, {variant}, {dtype}", our_outputs(ours_model, batch, len(theirs[0])),
                   theirs)
    # the train state: the optimizers' dicts into optimizers over the reference model's own parameters
    state = torch.load(os.path.join(folder, 'step_6_train_state.pt'), weights_only=True)
    inner = model._orig_mod.model
    params = dict(inner.named_parameters())
    names = [n for n in params]
    assert names == [n.replace('_orig_mod.model.', '') for n in state['param_names']], (names, state['param_names'])
    if config.arch.puzzle_emb_ndim:
        sign = CastedSparseEmbeddingSignSGD_Distributed(inner.puzzle_emb.buffers(), world_size=1, lr=0.0)
        sign.load_state_dict(state['optimizers'][0])
    adam = torch.optim.Adam(inner.parameters(), lr=0.0, betas=(0.9, 0.95))
    adam.load_state_dict(state['optimizers'][-1])
    ours_opt = ckpt['optimizer']['state']
    moments = all(torch.equal(adam.state[params[n]]['exp_avg'], ours_opt[i]['exp_avg'])
                  and torch.equal(adam.state[params[n]]['exp_avg_sq'], ours_opt[i]['exp_avg_sq'])
                  for i, n in enumerate(names))
    raw = all(torch.equal(state['weights']['_orig_mod.model.' + n], ckpt['model'][o])
              for n, o in zip(names, [k for k in ckpt['model'] if k not in ('puzzle_emb', 'H_init', 'L_init')]))
    print(f"  train state: {len(names)} AdamATan2 moments on the reference's parameters of the same names: "
          f"{'equal' if moments else 'DIFFER'}; raw weights {'equal' if raw else 'DIFFER'}; step {state['step']}")
    return same and moments and raw, pub.stdout


def reference_to_ours(args, data, variant, keys, dtype):
    """2: the reference's model and all_config.yaml, read here with no model key given."""
    import hydra
    import pretrain
    from pretrain import PretrainConfig, save_code_and_config
    from runkeep.checkpoint import load_weights
    from model import TRM, TRMConfig
    from runkeep.hub import model_keys, read_all_config
    folder = os.path.join(args.work, 'reference', slug(variant, dtype))
    arch = dict(TINY, **keys, forward_dtype=dtype)
    if arch['puzzle_emb_ndim']:
        arch.pop('puzzle_emb_ndim')  # the reference's trm.yaml: ${.hidden_size}, resolved when dumped
    else:
        arch['puzzle_emb_len'] = 0  # no table, no prefix: the only way the reference runs without a table
    overrides = [f'arch.{k}={v}' for k, v in arch.items()] + [f'data_paths=[{data}]', f'+checkpoint_path={folder}',
                                                             'global_batch_size=16', 'ema=True']
    with hydra.initialize_config_dir(config_dir=os.path.join(args.reference, 'config'), version_base=None):
        config = PretrainConfig(**hydra.compose(config_name='cfg_pretrain', overrides=overrides))
    batch, meta = reference_batch(data)
    torch.manual_seed(1)
    model = reference_model(config, meta, batch_size=16)
    if config.arch.puzzle_emb_ndim:
        with torch.no_grad():  # a trained table, not its zero initialisation
            table = model._orig_mod.model.inner.puzzle_emb.weights
            table.copy_(torch.randn_like(table) * 0.5)
    os.makedirs(folder, exist_ok=True)
    torch.save(model.state_dict(), os.path.join(folder, 'step_7'))  # save_train_state's line
    pretrain.wandb.run = types.SimpleNamespace(log_code=lambda path: None)  # its config is written only under W&B
    save_code_and_config(config)
    theirs = reference_outputs(model, batch)
    run = subprocess.run([sys.executable, 'train.py', f'--data_path={data}', f'--out_dir={folder}/eval',
                          f'--init_from={folder}/step_7', '--eval_only=True', '--device=cpu', '--xla_cache_dir='],
                         cwd=ROOT, capture_output=True, text=True)
    said = [l for l in run.stdout.splitlines() if l.startswith(('init_from=', 'loaded', 'eval on'))]
    yaml_path = os.path.join(folder, 'all_config.yaml')
    found = model_keys(read_all_config(yaml_path), yaml_path)
    ours_model = TRM(TRMConfig.for_data(json.load(open(os.path.join(data, 'train', 'dataset.json'))), **found))
    load_weights(os.path.join(folder, 'step_7'), ours_model, ours_model,
                 json.load(open(os.path.join(data, 'train', 'dataset.json'))), data, adapt=False)  # as --eval_only
    same = compare(f"reference -> ours, {variant}, {dtype}", our_outputs(ours_model, batch, len(theirs[0])),
                   theirs)
    return same and run.returncode == 0, '\n'.join(said) if run.returncode == 0 else run.stdout[-2000:] + run.stderr[-2000:]


def training_steps(args, data, variant, keys):
    """3: the reference's train_batch and this trainer's train_step, each step from the reference's state."""
    import hydra
    import pretrain
    from pretrain import PretrainConfig, TrainState
    from models.sparse_embedding import CastedSparseEmbeddingSignSGD_Distributed
    from model import TRM, TRMConfig, from_reference_state_dict
    from step import AdamATan2, StepConfig, train_step, Eager
    T = TRAIN
    arch = dict(TINY, **keys, forward_dtype='float32', halt_exploration_prob=0.5)
    arch.pop('puzzle_emb_ndim')  # the reference's trm.yaml: ${.hidden_size}
    top = {k: T[k] for k in ('lr', 'puzzle_emb_lr', 'weight_decay', 'puzzle_emb_weight_decay', 'beta1', 'beta2',
                             'lr_warmup_steps', 'lr_min_ratio')}
    overrides = ([f'arch.{k}={v}' for k, v in arch.items()] + [f'{k}={v}' for k, v in top.items()]
                 + [f'data_paths=[{data}]', f'global_batch_size={T["batch"]}'])
    with hydra.initialize_config_dir(config_dir=os.path.join(args.reference, 'config'), version_base=None):
        config = PretrainConfig(**hydra.compose(config_name='cfg_pretrain', overrides=overrides))
    assert config.arch.loss.loss_type == 'stablemax_cross_entropy' and config.arch.no_ACT_continue
    _, meta = reference_batch(data)
    torch.manual_seed(2)
    head = reference_model(config, meta, T['batch'])._orig_mod  # create_model's model with DISABLE_COMPILE set
    inner = head.model.inner
    with torch.no_grad():
        inner.puzzle_emb.weights.copy_(torch.randn_like(inner.puzzle_emb.weights) * 0.5)  # a trained table
        inner.q_head.weight.normal_(0, 0.3)  # a q_head that halts some rows before halt_max_steps
        inner.q_head.bias.fill_(4.0)
    optimizers = [  # as create_model makes them (a puzzle table, weights not frozen)
        CastedSparseEmbeddingSignSGD_Distributed(head.model.puzzle_emb.buffers(), lr=0,
                                                 weight_decay=config.puzzle_emb_weight_decay, world_size=1),
        pretrain.AdamATan2(head.parameters(), lr=0, weight_decay=config.weight_decay,
                           betas=(config.beta1, config.beta2))]
    state = TrainState(model=head, optimizers=optimizers, optimizer_lrs=[config.puzzle_emb_lr, config.lr],
                       carry=None, step=0, total_steps=T['total_steps'])
    seen = {}
    head.register_forward_hook(lambda module, inputs, out: seen.update(loss=out[1].detach(), metrics=out[2]))
    ours = TRM(TRMConfig.for_data(json.load(open(os.path.join(data, 'train', 'dataset.json'))),
                                  **dict(TINY, **keys, forward_dtype='float32', halt_exploration_prob=0.5,
                                         loss_type='stablemax', loss_dtype='float64', no_ACT_continue=True)))
    opt = AdamATan2(ours.parameters(), lr=T['lr'], betas=(T['beta1'], T['beta2']), weight_decay=T['weight_decay'])
    sc = StepConfig(lr=T['lr'], puzzle_emb_lr=T['puzzle_emb_lr'], puzzle_emb_weight_decay=T['puzzle_emb_weight_decay'],
                    warmup_steps=T['lr_warmup_steps'], total_steps=T['total_steps'], min_ratio=T['lr_min_ratio'],
                    global_batch_size=T['batch'])
    names = [n for n, _ in ours.named_parameters()]
    ref_params = {from_reference_state_dict({n: None}).popitem()[0]: p for n, p in head.model.named_parameters()}
    assert sorted(ref_params) == sorted(names), (sorted(ref_params), names)
    ours.train()
    head.train()
    B, L, V = T['batch'], meta.seq_len, meta.vocab_size
    gen = torch.Generator().manual_seed(3)
    eps = torch.finfo(torch.float32).eps
    worst = {}  # quantity -> (largest |diff|, largest |diff| in float32 epsilons of the value's size)
    ok = True

    def close(name, a, b, scale=None):
        """|a - b| <= 8 float32 epsilons of `scale` (elementwise; default |b|), recorded under `name`."""
        a, b = (torch.as_tensor(x).detach().double() for x in (a, b))
        scale = b.abs() if scale is None else torch.as_tensor(scale).detach().double()
        diff = (a - b).abs()
        ratio = float((diff / (eps * scale)).nan_to_num(0.0, posinf=float('inf')).max()) if diff.numel() else 0.0
        d = float(diff.max()) if diff.numel() else 0.0
        w = worst.get(name, (0.0, 0.0))
        worst[name] = (max(w[0], d), max(w[1], ratio))
        return ratio <= 8

    for t in range(1, T['steps'] + 1):
        batch = dict(inputs=torch.randint(2, V, (B, L), generator=gen, dtype=torch.int32),
                     labels=torch.randint(2, V, (B, L), generator=gen, dtype=torch.int32),
                     puzzle_identifiers=torch.randint(1, 1 + T['ids'], (B,), generator=gen, dtype=torch.int32))
        batch['labels'][torch.rand(B, L, generator=gen) < 0.25] = -100
        batch['labels'][t % B] = -100  # a row with nothing to score
        if state.carry is None:
            state.carry = head.initial_carry(batch)  # train_batch's first lines, without its torch.device("cuda")
        # the same state: the reference's weights, table, moments, step count and carry into ours
        ours.load_state_dict(from_reference_state_dict(head.model.state_dict()))
        adam = optimizers[1]
        for i, n in enumerate(names):
            st = adam.state.get(ref_params[n])
            opt.state[i] = None if not st else dict(t=st['step'].clone(), exp_avg=st['exp_avg'].clone(),
                                                    exp_avg_sq=st['exp_avg_sq'].clone())
        rc = state.carry
        carry = dict(y=rc.inner_carry.z_H.clone(), z=rc.inner_carry.z_L.clone(), steps=rc.steps.clone(),
                     halted=rc.halted.clone(), **{k: v.clone() for k, v in rc.current_data.items()})
        step_t = torch.full((), float(state.step))
        # the reference's step: its batch's .cuda() leaves the tensors on the CPU
        torch.manual_seed(100 + t)
        pretrain.train_batch(config, state, {k: types.SimpleNamespace(cuda=lambda v=v: v)
                                        for k, v in batch.items()},
                             global_batch_size=B, rank=0, world_size=1)
        torch.manual_seed(100 + t)  # the same exploration draws
        carry, loss, sums = train_step(ours, opt, [], carry, batch, step_t, sc, form=Eager())
        rc, theirs = state.carry, seen['metrics']
        good = (torch.equal(carry['halted'], rc.halted) and torch.equal(carry['steps'], rc.steps)
                and all(torch.equal(carry[k], v) for k, v in rc.current_data.items()))
        good &= close('latents', torch.stack([carry['y'], carry['z']]),
                      torch.stack([rc.inner_carry.z_H, rc.inner_carry.z_L]))
        good &= close('loss', loss, seen['loss'])
        for k in ('lm_loss', 'q_halt_loss', 'accuracy'):
            good &= close(k, sums[k], theirs[k])
        good &= 'q_continue_loss' not in theirs and float(sums['q_continue_loss']) == 0.0
        good &= all(float(sums[k]) == float(theirs[k])
                    for k in ('count', 'exact_accuracy', 'q_halt_accuracy', 'steps'))
        lrs = [float(sc.lr_at(t - 1, sc.puzzle_emb_lr)), float(sc.lr_at(t - 1, sc.lr))]
        good &= close('learning rates', lrs, [o.param_groups[0]['lr'] for o in optimizers])  # compute_lr's
        lr = optimizers[1].param_groups[0]['lr']
        for i, n in enumerate(names):  # a parameter's size: |p| plus its update's, lr / (1 - beta1^t)
            theirs_p = ref_params[n]
            good &= close('parameters', dict(ours.named_parameters())[n], theirs_p,
                          theirs_p.abs() + lr / (1 - T['beta1'] ** t))
            st = adam.state[theirs_p]
            good &= float(opt.state[i]['t']) == float(st['step'])
            good &= close('exp_avg', opt.state[i]['exp_avg'], st['exp_avg'], st['exp_avg'].abs().max())
            good &= close('exp_avg_sq', opt.state[i]['exp_avg_sq'], st['exp_avg_sq'], st['exp_avg_sq'].abs().max())
        table = inner.puzzle_emb.weights
        good &= close('puzzle table', ours.puzzle_emb, table, table.abs() + lrs[0])
        good &= torch.equal(ours.H_init, inner.H_init) and torch.equal(ours.L_init, inner.L_init)
        ok &= bool(good)
        ids = batch['puzzle_identifiers']
        halted_at = ','.join(str(int(n)) for n in rc.steps[rc.halted].sort().values) or 'no'
        print(f"training steps, {variant}, float32, step {t} (lr {lrs[1]:.3g}, puzzle lr {lrs[0]:.3g}): "
              f"{int(rc.halted.sum())}/{B} rows halted (after {halted_at} steps), {int(theirs['count'])} counted, "
              f"{B - len(ids.unique())} repeated ids, loss {float(seen['loss']):.6g}: {'equal' if good else 'DIFFER'}")
    print(f"  largest |ours - theirs| over {T['steps']} steps (in float32 epsilons of the value's size): "
          + ', '.join(f"{k} {d:.3g} ({r:.2g})" for k, (d, r) in worst.items()))
    return ok, worst


def evaluation_metrics(args, variant, keys, dtype):
    """4: the reference's pretrain.evaluate (its ACTLossHead's metrics) and evaluate.evaluate on the same weights
    and test split: 37 rows, half of them labelled with the model's own answer (right), a fifth of the labels
    ignored; in batches of 16 (the last padded) with two rows that have no label, and in one batch with a label
    in every row. Returns whether they agree: accuracy, exact_accuracy, q_halt_accuracy, steps and lm_loss
    always; q_halt_loss in the one batch only (the reference sums it over the padded and label-less rows too,
    then divides by the labelled rows' count)."""
    import hydra
    import pretrain
    from pretrain import PretrainConfig
    from puzzle_dataset import PuzzleDataset, PuzzleDatasetConfig
    from data import EvalLoader, write_split
    from device import Device
    from evaluate import evaluate
    from model import TRM, TRMConfig, from_reference_state_dict
    B, N, L, V = 16, 37, 12, 6
    folder = os.path.join(args.work, 'evaluation', slug(variant, dtype))
    data = os.path.join(folder, 'data')
    rng = np.random.default_rng(0)
    x, ids = rng.integers(2, V, (N, L)), rng.integers(1, 12, N)

    def write(labels):
        for split in ('train', 'test'):
            write_split(data, split, x, labels, ids, np.arange(N + 1), np.arange(N + 1), vocab_size=V,
                        num_puzzle_identifiers=12)
    write(x[:, ::-1])
    arch = dict(TINY, **keys, forward_dtype=dtype)
    arch.pop('puzzle_emb_ndim')
    overrides = [f'arch.{k}={v}' for k, v in arch.items()] + [f'data_paths=[{data}]', f'global_batch_size={B}',
                                                             f'+checkpoint_path={folder}/ck', '+eval_save_outputs=[]']
    with hydra.initialize_config_dir(config_dir=os.path.join(args.reference, 'config'), version_base=None):
        config = PretrainConfig(**hydra.compose(config_name='cfg_pretrain', overrides=overrides))
    _, meta = reference_batch(data, B)
    torch.manual_seed(1)
    model = reference_model(config, meta, B)
    inner = model._orig_mod.model.inner
    with torch.no_grad():  # a trained table, and a q_head whose q_halt falls on both sides of 0
        inner.puzzle_emb.weights.copy_(torch.randn_like(inner.puzzle_emb.weights) * 0.5)
        inner.q_head.weight.normal_(0, 0.3)
        inner.q_head.bias.zero_()
    rows = dict(inputs=torch.tensor(x, dtype=torch.int32), puzzle_identifiers=torch.tensor(ids, dtype=torch.int32),
                labels=torch.zeros(N, L, dtype=torch.int32))
    logits, _ = reference_outputs(model, rows)
    labels = x[:, ::-1].copy()
    labels[:N // 2] = logits[-1].argmax(-1).numpy()[:N // 2]
    labels[rng.random((N, L)) < 0.2] = 0  # the dataset's ignore_label_id
    results = {}
    for case, batch, empty in (('padded, two rows without labels', B, [5, N - 1]), ('one batch', N, [])):
        lab = labels.copy()
        lab[empty] = 0
        write(lab)
        ds = PuzzleDataset(PuzzleDatasetConfig(seed=0, dataset_paths=[data], rank=0, num_replicas=1,
                                               test_set_mode=True, epochs_per_iter=1, global_batch_size=batch), 'test')
        state = types.SimpleNamespace(model=model._orig_mod.eval(), step=0)
        # its evaluate moves the batches .cuda() and makes its carry and sums on "cuda": the CPU stands in
        cpu = types.SimpleNamespace(**dict(vars(torch), device=lambda *a, **k: torch.device('cpu'),
                                           zeros=lambda *a, device=None, **k: torch.zeros(*a, **k)))
        real_torch, real_cuda = pretrain.torch, torch.Tensor.cuda
        pretrain.torch, torch.Tensor.cuda = cpu, lambda t, *a, **k: t
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                theirs = pretrain.evaluate(config, state, torch.utils.data.DataLoader(ds, batch_size=None),
                                           ds.metadata, [], rank=0, world_size=1, cpu_group=None)['all']
        finally:
            pretrain.torch, torch.Tensor.cuda = real_torch, real_cuda
        ours = TRM(TRMConfig.for_data(json.load(open(os.path.join(data, 'train', 'dataset.json'))),
                                      **dict(TINY, **keys, forward_dtype=dtype, loss_dtype='float64')))
        ours.load_state_dict(from_reference_state_dict(model._orig_mod.model.state_dict()))
        steps = TINY['halt_max_steps']
        res, _ = evaluate(ours, EvalLoader(data, batch), Device('cpu'), steps, steps)
        pairs = dict(accuracy=res['token_accuracy'], exact_accuracy=res['exact_accuracy'],
                     q_halt_accuracy=res['q_halt_accuracy'], steps=res['steps'], lm_loss=res['lm_loss'],
                     q_halt_loss=2 * (res['loss'] - res['lm_loss']))
        for k, v in pairs.items():
            t = float(theirs[k])
            same = abs(v - t) <= 1e-5 * max(1.0, abs(t))
            results[k] = results.get(k, True) and (same or (k == 'q_halt_loss' and bool(empty)))
            print(f"evaluation, {variant}, {dtype}, {case}: {k} reference {t:.7f} ours {v:.7f} "
                  f"{'equal' if same else 'differ' + (' (as expected)' if k == 'q_halt_loss' and empty else '')}")
    return all(results.values())


def ema_against_helper(args):
    """5: the EMA of train_step (one update per optimizer step, with gradient accumulation too) against the
    reference's EMAHelper, which updates its shadow with a constant rate: ours warms its decay up,
    min(ema_rate, (1 + step) / (10 + step)), so the two are compared once the decay has reached the rate, the
    helper registered from our EMA there. Returns whether they agree."""
    import copy
    from models.ema import EMAHelper
    from model import TRM, TRMConfig
    from step import AdamATan2, StepConfig, train_step, Eager
    rate, ok = 0.5, True
    for accum in (1, 2):
        torch.manual_seed(0)
        cfg = dict(TINY, vocab_size=6, seq_len=8, num_puzzle_identifiers=3, forward_dtype='float32',
                   loss_dtype='float32', halt_exploration_prob=0.0)
        model = TRM(TRMConfig(**cfg))
        ema_model = copy.deepcopy(model, {id(model.puzzle_emb): model.puzzle_emb})
        opt = AdamATan2(model.parameters(), lr=1e-2, weight_decay=0.1)
        sc = StepConfig(lr=1e-2, puzzle_emb_lr=1e-2, puzzle_emb_weight_decay=0.1, warmup_steps=1, total_steps=100,
                        min_ratio=1.0, global_batch_size=8, ema_rate=rate, gradient_accumulation_steps=accum)
        gen = torch.Generator().manual_seed(1)
        batch = lambda: dict(inputs=torch.randint(2, 6, (8, 8), generator=gen, dtype=torch.int32),
                             labels=torch.randint(2, 6, (8, 8), generator=gen, dtype=torch.int32),
                             puzzle_identifiers=torch.randint(1, 3, (8,), generator=gen, dtype=torch.int32))
        carry, step_t, helper, worst = model.initial_carry(batch()), torch.zeros(()), None, 0.0
        for s in range(14):
            carry, _, _ = train_step(model, opt, list(ema_model.parameters()), carry, batch(), step_t, sc, Eager())
            if helper is not None:
                helper.update(model)
                worst = max(worst, max(float((helper.shadow[n] - p.detach()).abs().max())
                                       for n, p in ema_model.named_parameters()))
            elif min(rate, (1 + s) / (10 + s)) == rate:
                helper = EMAHelper(mu=rate)
                helper.register(ema_model)
        ok &= worst < 1e-6 and float(step_t) == 14
        print(f"EMA, gradient_accumulation_steps {accum}: {14 - 8} steps at the full rate beside the reference's "
              f"EMAHelper: largest |ours - theirs| {worst:.3g}: {'equal' if worst < 1e-6 else 'DIFFER'}")
    return ok


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[1])
    p.add_argument('--reference', required=True, help="the reference's files (an export of its commit e7b6871)")
    p.add_argument('--work', default='/tmp/refcheck', help='where the datasets, runs and files go')
    args = p.parse_args()
    stub = types.ModuleType('adam_atan2')
    stub.AdamATan2 = AdamATan2Formula  # its CUDA kernel's formula in PyTorch (check 3 steps it)
    sys.modules['adam_atan2'] = stub
    sys.path[:0] = [args.reference, ROOT]
    import pretrain
    real_load = torch.load  # its load_checkpoint maps to "cuda"; the CPU stands in
    pretrain.torch.load = lambda f, **kw: real_load(f, **dict(kw, map_location='cpu'))
    data = write_dataset(os.path.join(args.work, 'data'))
    ok, notes = True, []
    for dtype in ('float32', 'bfloat16'):
        for variant, keys in VARIANTS.items():
            good, out = ours_to_reference(args, data, variant, keys, dtype)
            ok &= good
            good, said = reference_to_ours(args, data, variant, keys, dtype)
            ok &= good
            notes.append(said)
    for variant in TRAIN_VARIANTS:
        good, _ = training_steps(args, data, variant, VARIANTS[variant])
        ok &= good
    for variant in TRAIN_VARIANTS:
        for dtype in ('float32', 'bfloat16'):
            ok &= evaluation_metrics(args, variant, VARIANTS[variant], dtype)
    ok &= ema_against_helper(args)
    print("train.py --eval_only on the reference's files, no model key given (the last case's lines):")
    print(notes[-1])
    print(f"publish.py (the last case's lines):\n{out.strip()}")
    print('ALL EQUAL' if ok else 'SOME DIFFER')
    return 0 if ok else 1


if __name__ == '__main__':
    raise SystemExit(main())
