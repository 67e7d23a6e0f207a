"""
Run keeping: what keeps a training run alive on rented machines, apart from the science at the root. Start-up
checks, locks, resume, atomic checkpoints, records and uploads, the watchdog, signals and bounded stops, memory and
time budgets, published checkpoints, GCS, TorchTPU and the pre-flight.

The front, all that train.py uses: tell_other_hosts_if_ending_early (a torchrun spanning hosts: a rank ending
before it joined the others leaves them why), resolve_init_from (an hf:// checkpoint fetched, the model keys of the
run a checkpoint comes from; before the config checks), Run (one run's verbs), launch (its process or processes) and
start_worker (a torch_xla worker's signals). The other scripts take the module they need: gcs (the builders' gs://
output), checkpoint, hub and adapt (solve.py, publish.py), memory (study.py, solve.py, bench.py), locks, startup
and signals (study.py).
"""
import importlib

FRONT = dict(resolve_init_from='hub', Run='run', launch='run', start_worker='run',
             tell_other_hosts_if_ending_early='signals')  # name -> its module


def __getattr__(name):  # a name of the front loads its module when asked for: `from runkeep import gcs` loads gcs
    if name in FRONT:
        return getattr(importlib.import_module(f'.{FRONT[name]}', __name__), name)
    raise AttributeError(f"module 'runkeep' has no attribute {name!r}")
