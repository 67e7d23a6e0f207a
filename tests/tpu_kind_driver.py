"""
The 'tpu' (TorchTPU) kind's code on CPU processes, for tests/test_torchtpu.py: a few training steps of the toy
task through Device, the compiled step, the collectives, a checkpoint of CPU copies and its resume, printing
every step's global loss as a JSON line (rank 0). Run as a user would run train.py:
    python tests/tpu_kind_driver.py --data=DIR --out=DIR --steps=4                      # the 'tpu' kind: it
        launches one process per device itself (TorchTPU.on_cpu(2): two CPU processes with gloo)
    torchrun --standalone --nproc_per_node=2 tests/tpu_kind_driver.py --kind=cpu ...  # the 'cpu' kind
--resume=True continues from the checkpoint the last run left in --out.
"""
import argparse
import copy
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data import TrainLoader  # noqa: E402
from device import Device, Prefetcher, TorchTPU, launch_tpu, to_cpu, under_torchrun  # noqa: E402
from model import TRM, TRMConfig  # noqa: E402
from step import AdamATan2, StepConfig, step_form, train_step  # noqa: E402

DEVICES = 2  # the stand-in host's TPU devices: processes per host
a = argparse.ArgumentParser()
a.add_argument('--kind', default='tpu')
a.add_argument('--data', required=True)
a.add_argument('--out', required=True)
a.add_argument('--steps', type=int, default=4)
a.add_argument('--resume', default='False')
args = a.parse_args()
tpu = TorchTPU.on_cpu(DEVICES) if args.kind == 'tpu' else None
if args.kind == 'tpu' and not under_torchrun():  # the parent, as train.py's: one process per device
    raise SystemExit(launch_tpu([os.path.abspath(__file__)] + sys.argv[1:], tpu=tpu))

dev = Device(args.kind, tpu=tpu)
seed, B = 0, 48
loader = TrainLoader(args.data, B, dev.rank, dev.world_size, seed)
cfg = TRMConfig.for_data(loader.meta, hidden_size=32, num_heads=2, expansion=2.0, H_cycles=2, L_cycles=2,
                         halt_max_steps=4, puzzle_emb_ndim=32, puzzle_emb_len=2, forward_dtype='float32',
                         loss_dtype='float32')
torch.manual_seed(seed)
model = TRM(cfg).to(dev.device)
opt = AdamATan2(model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1)
ema_model = copy.deepcopy(model)
dev.manual_seed(seed + dev.rank)
sc = StepConfig(lr=2e-3, puzzle_emb_lr=1e-2, puzzle_emb_weight_decay=0.1, warmup_steps=3, total_steps=100,
                min_ratio=1.0, global_batch_size=B, ema_rate=0.95)
path = os.path.join(args.out, f'rank{dev.rank}.pt')  # each rank's own state (its rows of the carry)
step, carry = 0, None
if args.resume == 'True':
    ck = torch.load(path, weights_only=False)
    model.load_state_dict(ck['model'])
    ema_model.load_state_dict(ck['ema'])
    opt.load_state_dict(ck['opt'])
    loader.load_state_dict(ck['loader'])
    dev.set_rng_state(ck['rng'])
    step, carry = ck['step'], {k: v.to(dev.device) for k, v in ck['carry'].items()}
prefetch = Prefetcher(loader, dev)
carry = carry or model.initial_carry(prefetch.upcoming)
step_t = torch.full((), float(step), device=dev.device)
form = step_form(dev.type, backend=dev.compile_backend)
ema_params = list(ema_model.parameters())
agreed = dev.agree([dev.rank], 'max')[0]  # a host verdict every rank reads: the highest rank
print(json.dumps(dict(rank=dev.rank, world=dev.world_size, device=str(dev.device), agreed=agreed,
                      name=dev.name())), flush=True)
for _ in range(args.steps):
    carry, loss, metrics = train_step(model, opt, ema_params, carry, prefetch.next(), step_t, sc, form,
                                      dev.all_reduce_sum_, dev.all_gather)
    total = loss.detach().reshape(1).clone()
    dev.all_reduce_sum_([total])
    step += 1
    host = dev.read([total, metrics['grad_norm']])
    if dev.master:
        print(json.dumps(dict(step=step, loss=float(host[0][0]) / B, grad_norm=float(host[1]),
                              compiles=dev.xla_counters().get('compiles'))), flush=True)
os.makedirs(args.out, exist_ok=True)
torch.save(to_cpu(dict(model=model.state_dict(), ema=ema_model.state_dict(), opt=opt.state_dict(), step=step,
                       loader=prefetch.consumed_state, rng=dev.rng_state(), carry=carry)), path)
dev.barrier()
dev.shutdown()
