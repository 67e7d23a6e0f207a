"""
Run keeping: what keeps a training run alive on rented machines, apart from the science at the root. Start-up
checks, locks, resume, atomic checkpoints, records and uploads, the watchdog, signals and bounded stops, memory and
time budgets, published checkpoints, GCS, TorchTPU and the pre-flight. train.py talks to it through Run.
"""
