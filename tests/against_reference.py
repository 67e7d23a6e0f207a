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
The reference's adam_atan2 import (a CUDA extension, only used to train) is replaced by a stub module.
"""
import argparse
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
                 json.load(open(os.path.join(data, 'train', 'dataset.json'))), data)
    same = compare(f"reference -> ours, {variant}, {dtype}", our_outputs(ours_model, batch, len(theirs[0])),
                   theirs)
    return same and run.returncode == 0, '\n'.join(said) if run.returncode == 0 else run.stdout[-2000:] + run.stderr[-2000:]


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[1])
    p.add_argument('--reference', required=True, help="the reference's files (an export of its commit e7b6871)")
    p.add_argument('--work', default='/tmp/refcheck', help='where the datasets, runs and files go')
    args = p.parse_args()
    stub = types.ModuleType('adam_atan2')
    stub.AdamATan2 = type('AdamATan2', (), {})  # CUDA-only, and only the reference's training uses it
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
    print("train.py --eval_only on the reference's files, no model key given (the last case's lines):")
    print(notes[-1])
    print(f"publish.py (the last case's lines):\n{out.strip()}")
    print('ALL EQUAL' if ok else 'SOME DIFFER')
    return 0 if ok else 1


if __name__ == '__main__':
    raise SystemExit(main())
