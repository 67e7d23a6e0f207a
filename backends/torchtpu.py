"""
TorchTPU (the `torch_tpu` package, PyTorch's native `tpu` device): every call this trainer makes to it, in one
place, because its API still moves between releases. device.py is the only file that imports this one, and no
other file imports torch_tpu; train.py and step.py see a Device of kind 'tpu' like any other.

What TorchTPU is to this trainer: a device 'tpu' (tpu:0 in each process, one process per TPU device of the
host), collectives through torch.distributed with the backend 'tpu_dist', torch.compile with the backend 'tpu',
and a few device queries under torch.tpu (synchronize, RNG, name). It needs torch >= 2.11 and cannot share an
environment with torch_xla 2.9 (torch 2.9 exactly): requirements-torchtpu.txt, in an environment of its own.

TorchTPU runs only where it finds TPU chips. Everything else the 'tpu' kind does is plain torch.distributed
and torch.compile, so the same code also runs as CPU processes with gloo (TorchTPU.on_cpu), which is how it is
tested on machines without a TPU.
"""
import importlib.metadata
import os
import time

import torch

REQUIREMENTS = 'requirements-torchtpu.txt'


def require():
    """Import TorchTPU and make sure it registered its device; otherwise stop with one line that says how to
    get it. Cheap when it is loaded already (a plain `import torch` loads it where it is installed)."""
    try:
        import torch_tpu  # noqa: F401
        if not _device_registered():
            # TORCH_DEVICE_BACKEND_AUTOLOAD=0 turns off what `import torch` does where TorchTPU is installed: the
            # entry point it declares for torch's autoload registers the device (when it finds a chip)
            for ep in importlib.metadata.entry_points(group='torch.backends'):
                if ep.name == 'torch_tpu':
                    ep.load()()
    except ImportError as e:
        raise SystemExit(f"config error: device='tpu' needs TorchTPU, which cannot be imported here ({e}): on a "
                         f"TPU VM, in a fresh virtual environment, pip install -r {REQUIREMENTS} (torch_xla's "
                         f"environment cannot hold it; device='xla' uses that one)")
    except Exception as e:  # installed, but broken: a libtpu or a torch of another version than it was built for
        why = ' '.join(str(e).split()) or 'no message'
        raise SystemExit(f"config error: device='tpu': TorchTPU is installed but cannot be imported here "
                         f"({type(e).__name__}: {why}): its libtpu or torch is not the version it was built for; "
                         f"in a fresh virtual environment, pip install -r {REQUIREMENTS}")
    if not _device_registered():
        raise SystemExit(f"config error: device='tpu': TorchTPU is installed but found no TPU chip on this "
                         f"machine, so it registered no 'tpu' device; run on a TPU VM ({REQUIREMENTS} in a fresh "
                         f"virtual environment there), or choose --device=cpu")


def _device_registered():
    try:
        torch.device('tpu')
        return True
    except RuntimeError:  # "Expected one of cpu, cuda, ...": no backend took the name
        return False


class TorchTPU:
    """One process's TorchTPU. `backend` (torch.distributed), `device_type` and `compiler` (torch.compile's
    backend) are TorchTPU's by default; TorchTPU.on_cpu(...) gives gloo, the CPU and a CPU compiler instead,
    so the 'tpu' kind's code (ranks, collectives, the compiled step, checkpoints) runs as CPU processes: there
    the device queries below are the CPU's (no torch.tpu call is made)."""

    def __init__(self, backend='tpu_dist', device_type='tpu', compiler='tpu', devices=None):
        self.backend, self.device_type, self.compiler = backend, device_type, compiler
        self.native = device_type == 'tpu'
        if self.native:
            require()
        self._devices = devices

    @classmethod
    def on_cpu(cls, devices, compiler='aot_eager'):
        """The 'tpu' kind as `devices` CPU processes per host with gloo; `compiler` is torch.compile's backend
        ('aot_eager' traces through AOTAutograd as TorchTPU's backend does, then runs the graphs eagerly)."""
        return cls(backend='gloo', device_type='cpu', compiler=compiler, devices=devices)

    # --- launch: in the parent process, before any worker starts ----------------------------------------

    def devices_per_host(self):
        """Processes to start on this host: one per TPU device TorchTPU counts (its count reads the PCI bus
        and initialises no runtime; a v7 chip exposes its two TensorCores as two devices)."""
        if self._devices is not None:
            return self._devices
        return torch.tpu.device_count()

    def set_launch_env(self, processes):
        """The variables every rank must agree on (the TPU topology, one runtime address per rank, the
        profiler's session; on a multi-host slice also NNODES, NODE_RANK, MASTER_ADDR and MASTER_PORT, from
        TPU_WORKER_HOSTNAMES): set in the parent, before spawning, as TorchTPU requires. A variable already
        set is kept, so an operator can pin any of them."""
        if self.native:
            torch.tpu.distributed.set_tpu_launch_env(nproc_per_node=processes)

    # --- one process ---------------------------------------------------------------------------------------

    def device(self):
        """Each process owns one TPU device, which it sees as tpu:0."""
        return torch.device('tpu', 0) if self.native else torch.device(self.device_type)

    def synchronize(self):
        if self.native:
            torch.tpu.synchronize()

    def manual_seed(self, seed):
        if self.native:
            torch.tpu.manual_seed(seed)

    def get_rng_state(self):
        """The device generator's state (a CPU tensor), or None off a TPU."""
        return torch.tpu.get_rng_state() if self.native else None

    def set_rng_state(self, state):
        if self.native:
            torch.tpu.set_rng_state(state)

    def memory(self, device):
        """(bytes allocated now, peak bytes allocated) on the device through torch.accelerator's allocator
        statistics, or None where the backend keeps none (off a TPU, or a TorchTPU release without them)."""
        if not self.native:
            return None
        try:
            return (int(torch.accelerator.memory_allocated(device)),
                    int(torch.accelerator.max_memory_allocated(device)))
        except (RuntimeError, AttributeError, NotImplementedError):
            return None

    def device_name(self):
        """'TPU v6e' and the like (read from the PCI bus), or None off a TPU."""
        return torch.tpu.get_device_name() if self.native else None

    def profiler_options(self, folder, rank):
        """torch.profiler.profile's arguments: host and TPU activity, TorchTPU's trace (XPlane) into
        `folder`, named by rank; off a TPU the host alone."""
        from torch.profiler import ProfilerActivity
        if not self.native:
            return dict(activities=[ProfilerActivity.CPU])
        return dict(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1],
                    experimental_config=torch.tpu.profiler.TpuProfilerConfig(run_dir=folder,
                                                                              worker_rank=str(rank)))

    @staticmethod
    def compiles():
        """(graphs compiled by torch.compile so far in this process, their seconds): dynamo's counters, the
        same for TorchTPU's backend and the CPU's. With static shapes the count stops growing after warm-up;
        a graph compiled later is a recompilation (a guard failed: a shape or a Python value changed)."""
        from torch._dynamo.utils import compilation_time_metrics, counters
        seconds = sum(compilation_time_metrics.get('_compile.compile_inner', []))
        seconds += sum(compilation_time_metrics.get('backward._backward_impl', []))  # a lazy backward compile
        return counters['stats']['unique_graphs'], seconds


def launch(tpu, script_args):
    """`python train.py ... --device=tpu` on a host: TorchTPU's launch variables set here, in the parent, then
    one process per TPU device through torchrun's launcher (the same launcher as CUDA's torchrun path), each
    running `script_args` (this script and its arguments) with RANK, LOCAL_RANK and WORLD_SIZE set. On a
    multi-host slice every host runs the same command; set_launch_env names the hosts and this host's rank.
    Returns the exit code: 0, or the first failed process's. A SIGTERM or Ctrl-C here reaches the processes
    (each in a session of its own) once, through the launcher: they save and stop, and after 30 s the launcher
    kills what is left."""
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    processes = tpu.devices_per_host()
    tpu.set_launch_env(processes)
    hosts = os.environ.get('NNODES', '1')
    if not hosts.strip().isdigit() or int(hosts) < 1:
        raise SystemExit(f"config error: NNODES={hosts!r} is not a number of hosts (allowed: an integer >= 1)")
    hosts = int(hosts)
    # where TorchTPU found no slice's hosts (TPU_WORKER_HOSTNAMES) and the command set none of these, torchrun
    # would have no host to meet the others at
    if hosts > 1 and (missing := [k for k in ('NODE_RANK', 'MASTER_ADDR', 'MASTER_PORT') if not os.environ.get(k)]):
        raise SystemExit(f"config error: device='tpu' on NNODES={hosts} hosts, but {', '.join(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} not set: export them in the command on every "
                         "host (NODE_RANK: this host's index, worker 0 first; docs/tpu.md's TorchTPU section)")
    where = ['--standalone'] if hosts == 1 else [
        f'--nnodes={hosts}', f"--node_rank={os.environ['NODE_RANK']}",
        f"--master_addr={os.environ['MASTER_ADDR']}", f"--master_port={os.environ['MASTER_PORT']}"]
    t = time.time()
    try:
        run.main(where + [f'--nproc_per_node={processes}'] + list(script_args))
    except ChildFailedError as e:
        first = min(e.failures.items())[1] if e.failures else None
        rc = first.exitcode if first and first.exitcode and first.exitcode > 0 else 1
        print(f"a training process exited with code {rc} after {time.time() - t:.0f} s (its output above says "
              f"why); every process of this host was stopped", flush=True)
        return rc
    except SignalException as e:
        print(f"got {e.sigval.name}: the training processes were asked to save and stop (their output above "
              f"says where they stopped); the same command with --init_from=resume continues", flush=True)
        return 128 + int(e.sigval)
    return 0
