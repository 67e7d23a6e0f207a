"""
Run keeping: what keeps a training run alive on rented machines, apart from the science at the root. Start-up
checks, locks, resume, atomic checkpoints, records and uploads, the watchdog, signals and bounded stops, memory and
time budgets, published checkpoints, GCS, TorchTPU and the pre-flight.

The front, all that train.py uses: Run (one run's verbs), launch (its process or processes) and start_worker (a
torch_xla worker's signals). The other scripts take the module they need: gcs (the builders' gs:// output),
checkpoint, hub and adapt (solve.py, publish.py), memory (study.py, solve.py).
"""
FRONT = ('Run', 'launch', 'start_worker')


def __getattr__(name):  # the front loads run.py (and torch) when it is asked for: `from runkeep import gcs` does not
    if name in FRONT:
        from . import run
        return getattr(run, name)
    raise AttributeError(f"module 'runkeep' has no attribute {name!r}")
