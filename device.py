"""
Everything that depends on the device: which one to use, ranks and collectives (torchrun on GPUs or CPU
processes, torch_xla on TPUs, or TorchTPU on TPUs: the device type 'tpu', whose calls live in backends/torchtpu.py), the
number format the hardware runs fast, batch transfer, RNG state, and what bench.py measures (waiting for the
device, peak memory, XLA compilations and CPU fallbacks). train.py, bench.py and solve.py share it, so the
training step itself has no device-specific line.

The rule that keeps a TPU pod from hanging: every rank executes the same graphs with the same collectives
in the same order. So a device value is only ever read through `Device.read`, which every rank calls at
the same point (it syncs, then transfers); rank-0-only code does host work alone (files, prints, W&B).
"""
import contextlib
import os
import resource
import signal
import socket
import sys
import threading
import time

import numpy as np

from configurator import KERNELS as KERNEL_CHOICES, import_torch

torch = import_torch()  # where an address-space limit leaves it no room: one line

from backends import torchtpu  # noqa: E402
# the 'tpu' device type's runtime; TorchTPU.on_cpu(n) runs its code on CPU processes
from backends.torchtpu import TorchTPU  # noqa: E402


def usable_cores():
    """The CPU cores this process may run on (its affinity), in order."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') \
        else list(range(os.cpu_count() or 1))


def resolve_device(name):
    """'auto' -> 'xla' when PJRT_DEVICE is set (TPU), else 'cuda' when a GPU is visible, else 'cpu'. A machine
    with TPU chips and no PJRT_DEVICE stops here with one line: its host CPU would train in their place, and
    the launch command of every worker should say what it uses (PJRT_DEVICE=TPU, or --device=cpu).
    'tpu' (TorchTPU) is chosen only by name; where TorchTPU or a chip is missing it stops here, before any
    work, with one line naming requirements-torchtpu.txt; so does 'cuda' where torch sees no CUDA GPU, and 'xla'
    where torch_xla cannot be imported (xla_problem) or PJRT_DEVICE names what it cannot start here (pjrt_problem)."""
    if name == 'auto':
        if os.environ.get('PJRT_DEVICE'):
            return resolve_device('xla')
        chips = tpu_chips()
        if chips:
            raise SystemExit(f"config error: device='auto' on a machine with {chips} TPU chip(s) and no "
                             f"PJRT_DEVICE: rerun with PJRT_DEVICE=TPU to train on them (or --device=tpu for "
                             f"TorchTPU, or --device=cpu to train on the host CPU)")
        return 'cuda' if torch.cuda.is_available() else 'cpu'
    if name not in ('cpu', 'cuda', 'xla', 'tpu'):
        raise SystemExit(f"config error: device={name!r}; allowed 'auto', 'cpu', 'cuda', 'xla', 'tpu'")
    if name == 'tpu':
        torchtpu.require()
    if name == 'xla' and (problem := xla_problem() or pjrt_problem(os.environ.get('PJRT_DEVICE'))):
        raise SystemExit(f"config error: {problem}")
    if name == 'cuda' and not torch.cuda.is_available():
        why = 'this torch is a CPU-only build' if torch.version.cuda is None else 'torch sees no CUDA GPU here'
        raise SystemExit(f"config error: device='cuda', but {why}: use --device=cpu, or --device=auto (a GPU "
                         "where there is one)")
    return name


def under_torchrun():
    """True in a process that torchrun (or torchtpu.launch) started: it has its rank already."""
    return 'LOCAL_RANK' in os.environ


def launch_tpu(script_args, tpu=None):
    """The parent of a TorchTPU run: TorchTPU's launch variables, then one process per TPU device of this host,
    each running script_args (a script and its arguments; it builds its Device under torchrun). Returns the
    exit code. tpu: a TorchTPU (default: the real one; TorchTPU.on_cpu(n): n CPU processes with gloo). The
    signals are the processes' to act on (torchrun's agent passes them on): this one reads none itself."""
    signal.set_wakeup_fd(-1)
    return torchtpu.launch(tpu or TorchTPU(), script_args)


def launch_xla(worker):
    """The parent of a torch_xla run: one worker process per local chip, each running worker(index); every host of
    a pod runs the same. A worker that ends abruptly (the watchdog, a kill) raises BrokenProcessPool here."""
    import torch_xla
    torch_xla.launch(worker)


# TPU chips on the PCI bus, counted as torch_xla counts them (Google's vendor id and a TPU device id), without
# importing torch_xla or touching a device. TRM_PCI_DEVICES names another sysfs folder (tests: a fake tree).
GOOGLE_PCI_VENDOR = '0x1ae0'
TPU_PCI_DEVICES = {'0x0027': 'v2/v3', '0x005e': 'v4', '0x0063': 'v5e', '0x0062': 'v5p', '0x006f': 'v6e',
                   '0x0076': '7x', '0x0056': 'test'}


def tpu_chips():
    """The number of TPU chips attached to this machine (0 off a TPU VM)."""
    root, chips = os.environ.get('TRM_PCI_DEVICES', '/sys/bus/pci/devices'), 0
    try:
        slots = os.listdir(root)
    except OSError:
        return 0
    for slot in slots:
        try:
            with open(os.path.join(root, slot, 'vendor')) as v, open(os.path.join(root, slot, 'device')) as d:
                chips += v.read().strip() == GOOGLE_PCI_VENDOR and d.read().strip() in TPU_PCI_DEVICES
        except OSError:  # a slot without both files is no TPU chip
            pass
    return chips


def xla_problem():
    """Why torch_xla cannot be imported here (None: it can); its launcher's traceback otherwise."""
    try:
        import torch_xla  # noqa: F401
    except Exception as e:  # not installed (macOS, TorchTPU's environment), or installed for another torch
        why = ' '.join(str(e).split()) or 'no message'
        return (f"device='xla' needs torch_xla, which cannot be imported here ({type(e).__name__}: {why}): pip install "
                f"-r requirements.txt on Linux (TorchTPU's environment cannot hold it; device='tpu' uses that one)")
    return None


def pjrt_problem(pjrt):
    """Why torch_xla cannot start under PJRT_DEVICE=pjrt on this machine (None: it can, or torch_xla picks).
    Its own answers are a traceback from its launcher: a KeyError for a name it does not know (they are
    upper-case), no worker process at all for TPU without a chip."""
    if not pjrt:
        return None
    try:
        from torch_xla.experimental import plugins
        known = ['CPU', *getattr(plugins, '_plugin_registry', {})]
    except ImportError:
        return None
    if len(known) > 1 and pjrt not in known:
        return f"PJRT_DEVICE={pjrt!r} is not a device torch_xla knows (allowed: {' | '.join(map(repr, known))})"
    if pjrt == 'TPU' and not tpu_chips():
        return ("PJRT_DEVICE=TPU, but this machine has no TPU chip on its PCI bus: run the command on a TPU VM, "
                "or set PJRT_DEVICE=CPU for torch_xla on the host CPU (or --device=cpu)")
    return None


def tpu_host_index():
    """This host's index among the TPU slice's hosts (worker 0 first), from the TPU VM's metadata server, as
    torch_xla asks it; no device is touched."""
    from torch_xla._internal import tpu
    return tpu.worker_id()


def tpu_hosts():
    """The TPU slice's hosts (1: a TPU VM of its own), from the metadata server likewise."""
    from torch_xla._internal import tpu
    return tpu.num_tpu_workers()


def tpu_host_alone_env():
    """The environment that makes a pod host's chips a TPU VM of their own (no process on another host is
    waited for; None: unset): torch_xla's topology from variables instead of the metadata server, one host of
    this host's chip bounds. Read from the metadata server, as torch_xla reads it."""
    from torch_xla._internal import tpu
    meta = tpu.get_tpu_env()
    bounds = meta.get('TPU_CHIPS_PER_PROCESS_BOUNDS') or meta.get('CHIPS_PER_HOST_BOUNDS')
    return dict(TPU_SKIP_MDS_QUERY='1', TPU_ACCELERATOR_TYPE=meta['ACCELERATOR_TYPE'], TPU_WORKER_ID='0',
                TPU_WORKER_HOSTNAMES='localhost', TPU_HOST_BOUNDS='1,1,1', TPU_CHIPS_PER_HOST_BOUNDS=bounds,
                CLOUD_TPU_TASK_ID=None, TPU_PROCESS_BOUNDS=None)


# -----------------------------------------------------------------------------
# the number format: bfloat16 only where the hardware runs it natively

def cpu_features():
    """(CPU model, the vector extensions that matter for training speed) from /proc/cpuinfo (Linux)."""
    model, flags = 'unknown CPU', set()
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                if line.startswith('model name') and model == 'unknown CPU':
                    model = line.split(':', 1)[1].strip()
                elif line.startswith(('flags', 'Features')) and not flags:
                    flags = set(line.split(':', 1)[1].split())
    except OSError:
        import platform
        model = platform.processor() or platform.machine()
    names = [('avx2', 'AVX2'), ('avx512f', 'AVX-512'), ('avx512_bf16', 'AVX512_BF16'),
             ('amx_bf16', 'AMX-BF16'),
             ('asimd', 'NEON'), ('bf16', 'ARM-BF16'), ('sve', 'SVE')]
    return model, [label for flag, label in names if flag in flags]


# the levels of torch's own kernels (ATEN_CPU_CAPABILITY) and of oneDNN's (ONEDNN_MAX_CPU_ISA) without bfloat16
# instructions: torch held to one of them emulates bf16, as on a CPU without it
ATEN_WITHOUT_BF16 = ('DEFAULT', 'AVX2')
ONEDNN_WITHOUT_BF16 = ('SSE41', 'AVX', 'AVX2', 'AVX2_VNNI', 'AVX2_VNNI_2', 'AVX512_CORE', 'AVX512_CORE_VNNI')


def cpu_bf16_capped():
    """The variable that holds torch below bfloat16 instructions, as 'NAME=value' ('' where none does):
    ATEN_CPU_CAPABILITY=avx2 or default (torch's own kernels: the norms, the elementwise ops) or
    ONEDNN_MAX_CPU_ISA below oneDNN's bf16 sets (the matmuls). So a machine with native bf16 chooses what an
    AVX2 machine chooses: `ONEDNN_MAX_CPU_ISA=AVX2 python -m pytest ...` (ATEN_CPU_CAPABILITY=avx2 would do for
    the trainer, but torch.compile's CPU kernels under it are built for AVX2 with the whole machine's
    instructions enabled, and some come out wrong)."""
    for name, levels in (('ATEN_CPU_CAPABILITY', ATEN_WITHOUT_BF16), ('ONEDNN_MAX_CPU_ISA', ONEDNN_WITHOUT_BF16),
                         ('DNNL_MAX_CPU_ISA', ONEDNN_WITHOUT_BF16)):
        if os.environ.get(name, '').upper() in levels:
            return f"{name}={os.environ[name]}"
    return ''


def cpu_has_native_bf16():
    """True where the CPU computes bfloat16 matmuls in hardware (AVX512_BF16, AMX, Arm BF16) and torch may use
    them (cpu_bf16_capped); elsewhere torch emulates bf16 and a step runs many times slower than float32."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()) and any(
            x in cpu_features()[1] for x in ('AVX512_BF16', 'AMX-BF16', 'ARM-BF16')) and not cpu_bf16_capped()
    except Exception:
        return False


def resolve_loss_dtype(requested, device_type):
    """'auto': float64 stablemax as the reference, float32 on TPUs (XLA or TorchTPU: no fast float64)."""
    return ('float32' if device_type in ('xla', 'tpu') else 'float64') if requested == 'auto' else requested


def choose_dtype(requested, device_type, cuda_capability=None, native_cpu_bf16=None):
    """(forward dtype, why, warning). 'auto': bfloat16 on TPU and on GPUs of compute capability 8.0 or newer,
    and on CPUs with native bf16; float32 elsewhere. An explicit choice is obeyed; where it is bf16 on hardware
    that emulates it, `warning` is a line of its own to print ('' elsewhere): `why` goes inside the device line."""
    if (device_type == 'xla' and os.environ.get('PJRT_DEVICE', 'TPU') != 'CPU') or device_type == 'tpu':
        native, hw = True, 'TPU'
    elif device_type == 'cuda':
        cap = cuda_capability or torch.cuda.get_device_capability()
        native, hw = tuple(cap) >= (8, 0), f"GPU of compute capability {cap[0]}.{cap[1]}"
    else:
        native = cpu_has_native_bf16() if native_cpu_bf16 is None else native_cpu_bf16
        capped = cpu_bf16_capped()
        hw = 'CPU ' + ('with' if native else 'without') + ' native bf16' + (f" under {capped}"
                                                                          if capped and not native else '')
    if requested == 'auto':
        return ('bfloat16', f"auto: bfloat16 ({hw})", '') if native else ('float32', f"auto: float32 ({hw})", '')
    if requested == 'bfloat16' and not native:
        return requested, "bfloat16 (as configured, emulated: see the warning above)", (
            f"warning: forward_dtype=bfloat16 on a {hw}: it is emulated and runs many times slower than float32 "
            "(--forward_dtype=auto picks float32 here)")
    return requested, f"{requested} (as configured)", ''


# -----------------------------------------------------------------------------
# the kernels: backends/kernels.py's fused blocks only where they are known to pay


def choose_kernels(requested, device_type, dtype, mlp_t=True, cuda_capability=None, have_triton=None,
                   have_quack=None):
    """(kernels, why): 'mlp_t' (backends/kernels.py's fused mlp_t, forward and backward, the rest plain),
    'cudnn' (an attention model's attention through cuDNN's fused attention, SDPA's cuDNN backend first: GPUs of
    compute capability 8.0 or newer), 'gated' (the mlp_t forward, and the SwiGLUs in their GEMMs' epilogues: both
    under grad, the channel one without; attention models too), 'quack' ('gated' with the optional quack-kernels
    package's GEMMs: CUDA GPUs of compute capability 9.x and 10.x, 16-bit), 'triton' (every fused kernel, for
    experiments) or 'off' (model.py's plain path), for a model that mixes the sequence with mlp_t (mlp_t=True) or
    attention. 'auto': 'mlp_t' for an mlp_t model on a Hopper GPU (compute capability 9.x) in bfloat16 with
    triton installed, the one kernel measured faster than the compiled plain path there; off everywhere else
    (attention models, other GPUs, other dtypes), so CPU, XLA and TorchTPU runs keep the plain path. A forced
    value where it cannot run falls back to the plain path, `why` starting with 'warning:'. Triton's interpreter
    (TRITON_INTERPRET=1) runs a forced value but 'quack' on the CPU, slowly, in float32 only: that is how the tests
    check the kernels."""
    if requested == 'off':
        return 'off', 'off (as configured)'
    if have_triton is None:
        import importlib.util
        have_triton = importlib.util.find_spec('triton') is not None
    interpreter = device_type == 'cpu' and os.environ.get('TRITON_INTERPRET') == '1'
    if requested != 'auto':
        if not have_triton:
            return 'off', f"warning: kernels='{requested}' needs the triton package, which is not installed: " \
                          "plain path"
        # what the model is comes first: no device or dtype would make the value fit it
        if requested == 'mlp_t' and not mlp_t:
            return 'off', "warning: kernels='mlp_t' fuses mlp_t, and this model mixes with attention: plain path"
        if requested == 'cudnn' and mlp_t:
            return 'off', "warning: kernels='cudnn' runs attention through cuDNN, and this model mixes with mlp_t: " \
                          "plain path"
        why_not = _why_not_quack(device_type, dtype, cuda_capability, have_quack) if requested == 'quack' else ''
        if why_not:
            return 'off', f"warning: kernels='quack' {why_not}: plain path"
        if device_type != 'cuda' and not interpreter:
            return 'off', (f"warning: kernels='{requested}' runs on CUDA GPUs (or the CPU with TRITON_INTERPRET=1), "
                           f"not on device {device_type}: plain path")
        if interpreter and requested != 'cudnn' and dtype != 'float32':  # its bfloat16 gives wrong numbers
            return 'off', (f"warning: kernels='{requested}' in Triton's interpreter runs in float32 only, not "
                           f"forward dtype {dtype}: plain path")
        if requested == 'cudnn':
            cap = cuda_capability or (torch.cuda.get_device_capability() if device_type == 'cuda' else None)
            if cap and cap[0] < 8:
                return 'off', (f"warning: kernels='cudnn' runs on GPUs of compute capability 8.0 or newer (cuDNN's "
                               f"fused attention), not {cap[0]}.{cap[1]}: plain path")
        return requested, f"{requested} (as configured" + ("; Triton's interpreter on the CPU)" if interpreter
                                                          else ")")
    if device_type != 'cuda':
        return 'off', f"auto: off (device {device_type}: the kernels are for CUDA GPUs)"
    cap = cuda_capability or torch.cuda.get_device_capability()
    hw = f"GPU of compute capability {cap[0]}.{cap[1]}"
    if not have_triton:
        return 'off', f"auto: off ({hw}, but triton is not installed)"
    if cap[0] != 9:
        return 'off', f"auto: off ({hw}: the kernels are measured on Hopper, 9.0, only; --kernels=mlp_t forces " \
                      "them)"
    if dtype != 'bfloat16':
        return 'off', f"auto: off (forward dtype {dtype}: the kernels are measured in bfloat16)"
    if not mlp_t:
        return 'off', f"auto: off ({hw}, bfloat16, attention: no fused kernel is measured faster than the plain " \
                      "path for it; --kernels=cudnn tries cuDNN's attention)"
    return 'mlp_t', (f"auto: mlp_t ({hw}, bfloat16): mlp_t's fused forward and backward, measured faster than the "
                     "compiled plain path on an H200")


def _why_not_quack(device_type, dtype, cuda_capability, have_quack):
    """'' where quack-kernels' GEMMs can run, else why not (they have no CPU or interpreter path)."""
    if device_type != 'cuda':
        return f"runs on CUDA GPUs only (quack-kernels' GEMMs), not on device {device_type}"
    if have_quack is None:
        import importlib.util
        have_quack = importlib.util.find_spec('quack') is not None
    if not have_quack:
        return "needs the quack-kernels package (pip install quack-kernels; CUDA 12.9 or newer), not installed"
    cap = cuda_capability or torch.cuda.get_device_capability()
    if cap[0] not in (9, 10):
        return f"runs on GPUs of compute capability 9.x and 10.x (Hopper, Blackwell), not {cap[0]}.{cap[1]}"
    if dtype not in ('bfloat16', 'float16'):
        return f"runs in bfloat16 or float16, not forward dtype {dtype}"
    return ''


# backends/kernels.py's tiles divide a SwiGLU's inner width: the reference's rounding (model.swiglu_inter) or a
# multiple of it
KERNEL_INNER_MULTIPLE = 256


def use_kernels(requested, device_type, dtype, model):
    """choose_kernels for this device, forward dtype and model, applied to model's blocks: backends/kernels.py's fused
    forward installed ('mlp_t', 'cudnn', 'gated', 'quack', 'triton'; a copy made afterwards, such as the EMA's,
    keeps it) or the plain forward. Returns (the kernels in effect, why; a forced value says what it fused); a
    triton or quack that fails to import means the plain path, said in `why`."""
    choice, why = choose_kernels(requested, device_type, dtype, mlp_t=hasattr(model.net.layers[0], 'mlp_t'))
    if choice != 'off' and model.config.mlp_multiple % KERNEL_INNER_MULTIPLE:
        choice, why = 'off', (f"{'warning: ' if requested != 'auto' else ''}kernels='{requested}': their tiles "
                              f"divide SwiGLU inner widths in multiples of {KERNEL_INNER_MULTIPLE}, not of "
                              f"mlp_multiple={model.config.mlp_multiple}: plain path")
    if choice != 'off':
        try:
            from backends.kernels import fuse_blocks
            fused = fuse_blocks(model, choice)
            if fused.startswith('none fused'):
                return 'off', f"{why}: {fused}: plain path"
            return choice, why if requested == 'auto' else f"{why}: {fused}"
        except Exception as e:  # a broken triton or quack install: the plain path, said in one line
            why = (f"warning: kernels='{requested}' but backends/kernels.py failed to load "
                   f"({type(e).__name__}: {e}): plain path")
    for block in model.net.layers:
        block.fused = None
    return 'off', why


# -----------------------------------------------------------------------------
# the memory this machine gives a process

GB = 1e9
# Under an address-space limit (RLIMIT_AS) a process is charged for what it maps, not for what it touches: every
# thread that allocates gets a malloc arena of its own (glibc, 64-bit: 64 MB reserved each, up to 8 per core or
# MALLOC_ARENA_MAX) and a stack (RLIMIT_STACK's size). A run's threads: its compute threads and the trainer's own
# (the signals' reader, the watchdog, the stop's bound, the batch prefetcher, uploads, the lock's renewal), of
# which about TRAINER_THREADS allocate.
ARENA_BYTES = 64 * 2 ** 20
TRAINER_THREADS = 4


def available_memory():
    """Bytes of memory this machine can still give (Linux: MemAvailable), or None where unknown."""
    try:
        with open('/proc/meminfo') as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith('MemAvailable:'))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def _read_int(path, key=None):
    """An integer file of /proc or a cgroup ('max': None), or with `key` the value of that line; None if absent."""
    try:
        with open(path) as f:
            text = f.read()
        if key is not None:
            text = next(l.split()[1] for l in text.splitlines() if l.split()[:1] == [key])
        return None if text.strip() == 'max' else int(text.split()[0])
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def cgroup_headroom():
    """(bytes, words) the memory limit of this process's cgroup leaves (v2 memory.max, v1
    memory.limit_in_bytes, less the cgroup's usage without its reclaimable file cache), or None without a
    limit. TRM_CGROUP_ROOT names another cgroup mount (tests: a fake tree)."""
    root = os.environ.get('TRM_CGROUP_ROOT', '/sys/fs/cgroup')
    try:
        with open('/proc/self/cgroup') as f:
            lines = [l.rstrip('\n').split(':', 2) for l in f]
    except OSError:
        lines = []
    paths = {c: line[2] for line in lines if len(line) == 3 for c in line[1].split(',')}  # v2's controller: ''
    v2 = [os.path.join(root, paths.get('', '/').lstrip('/')), root]
    v1 = [os.path.join(root, 'memory', paths.get('memory', '/').lstrip('/')), os.path.join(root, 'memory')]
    for folders, limit, usage, cache in ((v2, 'memory.max', 'memory.current', 'inactive_file'),
                                         (v1, 'memory.limit_in_bytes', 'memory.usage_in_bytes',
                                          'total_inactive_file')):
        for folder in folders:
            cap = _read_int(os.path.join(folder, limit))
            if cap is None or cap >= 1 << 60:  # 'max', or v1's unlimited (a page-rounded 2**63)
                continue
            used = (_read_int(os.path.join(folder, usage)) or 0) - \
                (_read_int(os.path.join(folder, 'memory.stat'), cache) or 0)
            return max(0, cap - used), (f"the cgroup's {limit} {cap / GB:.1f} GB less the {used / GB:.1f} GB "
                                        "its processes use")
    return None


def compute_threads():
    """The threads torch computes with: its own count where it is loaded, else OMP_NUM_THREADS or this
    process's cores."""
    torch = sys.modules.get('torch')
    if torch is not None and hasattr(torch, 'get_num_threads'):
        return torch.get_num_threads()
    try:
        return int(os.environ.get('OMP_NUM_THREADS', '')) or len(os.sched_getaffinity(0))
    except (ValueError, AttributeError):
        return os.cpu_count() or 1


def thread_reserve():
    """Address space a run's threads reserve beyond the bytes they use (see ARENA_BYTES): a malloc arena for each
    thread but the main one, a stack for each."""
    threads = compute_threads() + TRAINER_THREADS
    try:
        arenas = int(os.environ.get('MALLOC_ARENA_MAX', ''))
    except ValueError:
        arenas = 8 * (os.cpu_count() or 1)
    stack = resource.getrlimit(resource.RLIMIT_STACK)[0]
    stack = 8 * 2 ** 20 if stack == resource.RLIM_INFINITY else stack
    return min(threads - 1, arenas) * ARENA_BYTES + threads * stack


def memory_headroom():
    """(bytes this process may still allocate, what bounds it in words): the smallest of host_headroom's and
    address_space_headroom's; (None, '') where none is known."""
    found = [h for h in (host_headroom(), address_space_headroom()) if h[0] is not None]
    return min(found) if found else (None, '')


def host_headroom():
    """(bytes, words) the host's processes share: the smaller of the machine's MemAvailable and what its cgroup's
    memory limit leaves; (None, '') where neither is known. TRM_MEMORY_AVAILABLE (bytes) stands in for
    MemAvailable (tests: a smaller machine)."""
    found = []
    free = os.environ.get('TRM_MEMORY_AVAILABLE')
    free = int(float(free)) if free else available_memory()
    if free is not None:
        found.append((free, 'available on this machine (MemAvailable)'))
    if (cgroup := cgroup_headroom()) is not None:
        found.append((cgroup[0], f"left by {cgroup[1]}"))
    return min(found) if found else (None, '')


def address_space_headroom():
    """(bytes, words) the address space RLIMIT_AS leaves this process, each process its own: the limit less what
    it has mapped and what the run's threads will reserve (thread_reserve); (None, '') without a limit."""
    cap = resource.getrlimit(resource.RLIMIT_AS)[0]
    if cap == resource.RLIM_INFINITY:
        return None, ''
    mapped = (_read_int('/proc/self/status', 'VmSize:') or 0) * 1024
    reserve = thread_reserve()
    return (max(0, cap - mapped - reserve), f"left by this process's address-space limit (RLIMIT_AS {cap / GB:.1f} "
            f"GB, {mapped / GB:.1f} GB of it mapped, {reserve / GB:.2f} GB for its threads' malloc arenas and stacks)")


def resident_bytes():
    """This process's resident memory now (Linux), or 0."""
    return (_read_int('/proc/self/status', 'VmRSS:') or 0) * 1024


def size(n):
    """Bytes in words: '1.44 GB', '27.2 MB', '231 kB'."""
    for unit, scale in (('GB', GB), ('MB', 1e6), ('kB', 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


# -----------------------------------------------------------------------------
# one process's device, rank and collectives

# peak dense bf16 TFLOP/s of one process's GPU or TPU device (datasheets), for MFU; the first name in the
# device's wins. A v7 chip (2307) shows its two TensorCores as two devices, one process each: half per device
PEAK_TFLOPS = [('H100 PCIe', 756), ('H100 NVL', 835), ('H100', 989), ('H200 NVL', 835), ('H200', 989), ('A100', 312),
               ('L40S', 362),
               ('v6e', 918), ('v6 lite', 918), ('v5e', 197), ('v5 lite', 197), ('v5litepod', 197),
               ('v5p', 459), ('TPU v5', 459), ('v4', 275), ('TPU v7', 1153.5)]


def peak_tflops_of(name):
    """PEAK_TFLOPS's figure for a device name ('NVIDIA H100 80GB HBM3', 'TorchTPU TPU v6e', ...), or None."""
    return next((peak for key, peak in PEAK_TFLOPS if key.lower() in name.lower()), None)


# a torchrun spanning hosts: a rank that ends before joining the others (a config error on its host's command line
# or in its files, a package missing there) leaves its last line in torchrun's store, and the ranks joining read it
# there instead of waiting for it until the process group's timeout (30 minutes). Under this key prefix, with the
# restart count, as torch's own worker keys.
JOIN_KEYS = 'trm_join'
JOIN_SAY_EVERY_S = 60  # a rank still waiting for others to join says for whom, this often


def rendezvous_store(timeout_s):
    """torchrun's store (its agent's, through which the ranks join) as a client where the run spans hosts, with
    its key prefix; (None, '') elsewhere: one host's torchrun ends its other ranks itself when one ends early."""
    env = os.environ
    if env.get('TORCHELASTIC_USE_AGENT_STORE') != 'True' or \
            int(env.get('WORLD_SIZE', 1)) <= int(env.get('LOCAL_WORLD_SIZE', 1)):
        return None, ''
    import datetime
    from torch.distributed import TCPStore
    store = TCPStore(env['MASTER_ADDR'], int(env['MASTER_PORT']), is_master=False,
                     timeout=datetime.timedelta(seconds=timeout_s))
    return store, f"{JOIN_KEYS}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def leave_join_note(line):
    """A rank ending before it joined the others: its last line (why it ends) into torchrun's store."""
    store, keys = rendezvous_store(timeout_s=10)
    if store is None:
        return
    rank = os.environ['RANK']
    store.set(f"{keys}/ended/{rank}", f"rank {rank} (host {socket.gethostname()}) ended before joining the others: "
                                      + (line or 'its output there says why'))
    store.add(f"{keys}/ended", 1)


def watch_join(rank, world_size, local_rank, joined):
    """A thread's loop while this rank joins the process group (until `joined`, an Event, is set): a note of a
    rank that ended before joining ends this process at once, in one line; a rank still waiting says every
    JOIN_SAY_EVERY_S which ranks it waits for (a slow host, still fetching its data, joins late and is waited
    for)."""
    try:
        store, keys = rendezvous_store(timeout_s=60)
        if store is None:
            return
        store.set(f"{keys}/joining/{rank}", socket.gethostname())
        start = said = time.time()
        while not joined.wait(0.5):
            if store.add(f"{keys}/ended", 0):
                ended = next(r for r in range(world_size) if store.check([f"{keys}/ended/{r}"]))
                sys.stderr.write(f"{store.get(f'{keys}/ended/{ended}').decode()}; rank {rank} ends too, not "
                                 "waiting for it until the process group's timeout\n")
                sys.stderr.flush()
                sys.stdout.flush()
                os._exit(1)
            if local_rank == 0 and time.time() - said >= JOIN_SAY_EVERY_S:
                said = time.time()
                missing = [r for r in range(world_size) if not store.check([f"{keys}/joining/{r}"])]
                print(f"rank {rank}: waiting {said - start:.0f} s so far for rank(s) {missing} to join (still "
                      "starting on their hosts, or ended there: their output says why)", flush=True)
    except Exception:  # the store gone: its host's torchrun ended, and this host's ends this rank
        return


class Device:
    """One process's device, rank and collectives. device_type: 'cpu', 'cuda', 'xla' (torch_xla) or 'tpu'
    (TorchTPU, through `tpu`: a TorchTPU, by default the real one). Under torchrun (WORLD_SIZE > 1) the
    process joins the others: nccl on GPUs, gloo on CPUs, the TorchTPU's backend ('tpu_dist') on TPUs."""
    def __init__(self, device_type, xla_cache_dir='', tpu=None):
        self.type = device_type
        self.rank, self.world_size, self.local_rank, self.hosts = 0, 1, 0, 1
        self.tpu = (tpu or TorchTPU()) if device_type == 'tpu' else None
        self.compile_backend = self.tpu.compiler if self.tpu else None  # torch.compile's backend (None: default)
        if device_type == 'xla':
            import torch_xla
            import torch_xla.runtime as xr
            if xla_cache_dir and os.environ.get('PJRT_DEVICE') != 'CPU':  # the CPU client cannot reload
                                                                          # executables
                # one writable cache per local process: every host of a pod fills its own
                xr.initialize_cache(os.path.join(os.path.expanduser(xla_cache_dir), str(xr.local_ordinal())),
                                    readonly=False)
            self.device = torch_xla.device()
            self.rank, self.world_size = xr.global_ordinal(), xr.world_size()
            self.local_rank = xr.local_ordinal()
            self.hosts = max(1, self.world_size // max(1, xr.local_device_count()))
        else:
            if int(os.environ.get('WORLD_SIZE', 1)) > 1:  # torchrun
                import torch.distributed as dist
                self.rank, self.world_size = int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])
                self.local_rank = int(os.environ.get('LOCAL_RANK', 0))
                self.hosts = self.world_size // int(os.environ.get('LOCAL_WORLD_SIZE', self.world_size))
                joined = threading.Event()
                threading.Thread(target=watch_join, args=(self.rank, self.world_size, self.local_rank, joined),
                                 daemon=True, name='join').start()
                try:
                    dist.init_process_group(backend='nccl' if device_type == 'cuda' else self.tpu.backend
                                            if self.tpu else 'gloo')
                finally:
                    joined.set()
            if device_type == 'cuda':
                torch.cuda.set_device(self.local_rank)
                torch.backends.cuda.matmul.allow_tf32 = True
                torch.backends.cudnn.allow_tf32 = True
            self.device = torch.device(device_type, self.local_rank) if device_type == 'cuda' else \
                self.tpu.device() if device_type == 'tpu' else torch.device('cpu')
        self.master = self.rank == 0

    # --- collectives (every rank calls them at the same point) ---------------------------------------

    def all_reduce_(self, tensors, op='sum'):
        """In place over all ranks: 'sum', 'max' or 'min'."""
        if self.world_size == 1:
            return
        if self.type == 'xla':
            import torch_xla.core.xla_model as xm
            xm.all_reduce({'sum': xm.REDUCE_SUM, 'max': xm.REDUCE_MAX, 'min': xm.REDUCE_MIN}[op], tensors)
        else:
            import torch.distributed as dist
            flat = torch.cat([t.reshape(-1) for t in tensors])  # one collective, not one per tensor
            dist.all_reduce(flat, op={'sum': dist.ReduceOp.SUM, 'max': dist.ReduceOp.MAX,
                                      'min': dist.ReduceOp.MIN}[op])
            torch._foreach_copy_(tensors, [f.view_as(t) for f, t in
                                           zip(flat.split([t.numel() for t in tensors]), tensors)])

    def all_reduce_sum_(self, tensors):
        self.all_reduce_(tensors, 'sum')

    def all_gather(self, t):
        if self.world_size == 1:
            return t
        if t.dtype == torch.bool:  # not every backend gathers bools
            return self.all_gather(t.to(torch.int32)).bool()
        if self.type == 'xla':
            import torch_xla.core.xla_model as xm
            return xm.all_gather(t, dim=0)
        import torch.distributed as dist
        out = torch.empty((self.world_size * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype,
                          device=t.device)
        dist.all_gather_into_tensor(out, t.contiguous())
        return out

    def read(self, tensors):
        """Device tensors -> numpy arrays, on every rank. XLA: the pending graph (collectives included) is
        cut and run first, so each rank executes it once and in the same order; then plain transfers."""
        self.sync()
        host = [t.detach().cpu() for t in tensors]
        return [t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy() for t in host]  # no numpy bf16

    def agree(self, values, op='sum'):
        """Host numbers reduced over all ranks (a verdict, a flag, a fingerprint): float64 numpy on every
        rank."""
        t = torch.tensor(np.asarray(values, dtype=np.float64).reshape(-1),
                         dtype=torch.float32 if self.type in ('xla', 'tpu')
                         else torch.float64, device=self.device)
        self.all_reduce_([t], op)
        return self.read([t])[0].astype(np.float64)

    def sync(self):
        """End of a step: XLA cuts and dispatches the graph here; elsewhere a no-op."""
        if self.type == 'xla':
            import torch_xla
            torch_xla.sync()

    def barrier(self):
        if self.world_size == 1:
            return
        if self.type == 'xla':
            import torch_xla.core.xla_model as xm
            self.sync()
            xm.rendezvous('barrier')
        else:
            import torch.distributed as dist
            dist.barrier()

    def shutdown(self):
        """Every rank leaves together, at a point all of them reach: rank 0 hosts torchrun's rendezvous store,
        and a rank still holding the process group when rank 0 exits can abort at exit (SIGABRT)."""
        if self.world_size == 1:
            return
        self.barrier()
        if self.type != 'xla':
            import torch.distributed as dist
            dist.destroy_process_group()

    # --- data and RNG ------------------------------------------------------------------------------

    def to_device(self, batch):
        pin = self.type == 'cuda'
        return {k: (torch.from_numpy(v).pin_memory() if pin else torch.from_numpy(v)).to(
                    self.device, non_blocking=pin)
                for k, v in batch.items()}

    def manual_seed(self, s):
        torch.manual_seed(s)
        if self.type == 'xla':  # the device draws ACT exploration from its own generator
            import torch_xla.core.xla_model as xm
            xm.set_rng_state(s)
        if self.type == 'tpu':
            self.tpu.manual_seed(s)

    def seed_step(self, seed, step):
        """XLA: the device generator (ACT exploration's draws) set from (seed, rank, step) before a training step.
        torch_xla advances it at every graph cut, and evaluations, log reads and saves cut graphs too: a resumed run
        cuts other graphs than the run that went on, and would draw other rows from then on. Elsewhere the
        generator moves with the draws alone, and a checkpoint carries its state."""
        if self.type == 'xla':
            import torch_xla.core.xla_model as xm
            xm.set_rng_state(int(np.random.SeedSequence([seed, self.rank, step]).generate_state(1, np.uint64)[0]))

    def rng_state(self):
        state = dict(cpu=torch.get_rng_state())
        if self.type == 'cuda':
            state['cuda'] = torch.cuda.get_rng_state(self.device)
        if self.type == 'xla':
            import torch_xla.core.xla_model as xm
            state['xla'] = str(xm.get_rng_state())  # an unsigned 64-bit seed
        if self.type == 'tpu' and (tpu := self.tpu.get_rng_state()) is not None:
            state['tpu'] = tpu
        return state

    def rng_states(self):
        """Every rank's rng_state(), in rank order, on every rank (a collective: every rank calls it); None where
        the ranks' streams are not gathered (XLA, TorchTPU: a resume reseeds the ranks after the first)."""
        if self.world_size == 1:
            return [self.rng_state()]
        if self.type not in ('cpu', 'cuda'):
            return None
        import torch.distributed as dist
        states = [None] * self.world_size
        dist.all_gather_object(states, self.rng_state())
        return states

    def set_rng_state(self, state):
        torch.set_rng_state(state['cpu'])
        if self.type == 'cuda' and 'cuda' in state:
            torch.cuda.set_rng_state(state['cuda'], self.device)
        if self.type == 'xla' and 'xla' in state:
            import torch_xla.core.xla_model as xm
            xm.set_rng_state(int(state['xla']))
        if self.type == 'tpu' and 'tpu' in state:
            self.tpu.set_rng_state(state['tpu'])

    # --- measuring (bench.py, logs) ----------------------------------------------------------------

    def wait(self):
        """Block until the device has finished everything queued, so the clock can be read."""
        if self.type == 'cuda':
            torch.cuda.synchronize(self.device)
        elif self.type == 'xla':
            import torch_xla.core.xla_model as xm
            xm.wait_device_ops()
        elif self.type == 'tpu':
            self.tpu.synchronize()

    def xla_report(self):
        """(graph compilations so far, {aten op: count} that fell back to the CPU); (0, {}) off XLA. With
        static shapes the compilations stop growing after warm-up and nothing falls back."""
        if self.type != 'xla':
            return 0, {}
        import torch_xla.debug.metrics as met
        compiles = met.metric_data('CompileTime')
        return (compiles[0] if compiles else 0), {n: met.counter_value(n) for n in sorted(met.counter_names())
                                                  if n.startswith('aten::')}

    def execute_seconds(self):
        """XLA: seconds the device has spent executing graphs so far (torch_xla's ExecuteTime metric, which
        counts lazy and compiled graphs alike); 0.0 elsewhere. Its growth per step is the device's share of a
        step."""
        if self.type != 'xla':
            return 0.0
        import torch_xla.debug.metrics as met
        data = met.metric_data('ExecuteTime')
        return data[1] / 1e9 if data else 0.0

    def execution_mark(self):
        """XLA: (now, graphs executed so far), where busy_fraction() starts counting; None elsewhere."""
        if self.type != 'xla':
            return None
        import torch_xla.debug.metrics as met
        data = met.metric_data('ExecuteTime')
        return time.time(), (data[0] if data else 0)

    def busy_fraction(self, mark):
        """XLA: the share of the time since `mark` (execution_mark's) in which the device was executing; None
        elsewhere. Each ExecuteTime sample (its end as wall time, its nanoseconds) runs from a graph's dispatch to
        its end, so a graph queued behind others counts their time too: where the host runs ahead, the samples'
        sum is several times the wall time, their union is not. The metric keeps only its newest samples: where
        it dropped some since `mark`, the share is over the time the kept ones cover."""
        if self.type != 'xla':
            return None
        import torch_xla.debug.metrics as met
        since, count = mark
        now, data = time.time(), met.metric_data('ExecuteTime')
        spans = sorted((max(end - ns / 1e9, since), end) for end, ns in (data[2] if data else []) if end > since)
        if len(spans) < (data[0] if data else 0) - count:
            since = spans[0][0] if spans else now
        busy, reach = 0.0, since
        for start, end in spans:
            busy += max(0.0, end - max(start, reach))
            reach = max(reach, end)
        return busy / max(now - since, 1e-9)

    def free_memory(self):
        """(bytes, where in words) the device itself has free: a CUDA GPU's, a runtime query; None elsewhere (a
        CPU's: memory_headroom)."""
        if self.type != 'cuda':
            return None
        give, total = torch.cuda.mem_get_info(self.device)
        return give, f"free on its GPU ({torch.cuda.get_device_name(self.device)}, {size(total)})"

    def peak_memory(self):
        """(bytes, what was measured)."""
        if self.type == 'cuda':
            return torch.cuda.max_memory_allocated(self.device), 'peak allocated'
        if self.type == 'xla':
            try:
                import torch_xla.core.xla_model as xm
                info = xm.get_memory_info(self.device)
                return int(info.get('peak_bytes_used', info['bytes_used'])), 'device peak'
            except Exception:
                pass  # the XLA CPU client has no allocator statistics
        if self.type == 'tpu' and (mem := self.tpu.memory(self.device)):
            return mem[1], 'device peak allocated'
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, 'process max RSS'  # Linux: KiB

    def memory_in_use(self):
        """(bytes, what was measured) now, for a log line: a runtime query, no device value is read. TPU:
        the chip's memory in use; CUDA: allocated by tensors; elsewhere (the CPU, XLA's CPU client, which
        keeps no allocator statistics) the process's resident memory."""
        if self.type == 'cuda':
            return torch.cuda.memory_allocated(self.device), 'cuda allocated'
        if self.type == 'xla':
            try:
                import torch_xla.core.xla_model as xm
                return int(xm.get_memory_info(self.device)['bytes_used']), 'device in use'
            except Exception:
                pass
        if self.type == 'tpu' and (mem := self.tpu.memory(self.device)):
            return mem[0], 'device allocated'
        try:
            with open('/proc/self/statm') as f:
                return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE'), 'process RSS'
        except (OSError, ValueError, IndexError):
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, 'process max RSS'

    def xla_counters(self):
        """XLA: torch_xla's counters so far (host-side numbers, no device read): graph compilations and their
        seconds, seconds of graph execution, and host-device transfers. TorchTPU: the graphs torch.compile
        compiled and their seconds (it reports no execution or transfer figures: 0). {} elsewhere."""
        if self.type == 'tpu':
            compiles, compile_s = self.tpu.compiles()
            return dict(compiles=compiles, compile_s=compile_s, execute_s=0.0, transfers=0)
        if self.type != 'xla':
            return {}
        import torch_xla.debug.metrics as met

        def metric(name):
            data = met.metric_data(name)
            return (data[0], data[1] / 1e9) if data else (0, 0.0)
        compiles, compile_s = metric('CompileTime')
        return dict(compiles=compiles, compile_s=compile_s, execute_s=metric('ExecuteTime')[1],
                    transfers=metric('TransferToDeviceTime')[0] + metric('TransferFromDeviceTime')[0])

    def name(self):
        """What a reported figure was measured on: GPU name and compute capability, TPU type, or the CPU
        model with its vector extensions and thread count."""
        if self.type == 'cuda':
            cap = torch.cuda.get_device_capability(self.device)
            return f"{torch.cuda.get_device_name(self.device)} (compute capability {cap[0]}.{cap[1]})"
        if self.type == 'xla':
            import torch_xla
            import torch_xla.core.xla_model as xm
            name = xm.xla_device_kind(self.device)  # e.g. 'TPU v4', 'TPU v5 lite', 'cpu'
            accel = os.environ.get('TPU_ACCELERATOR_TYPE', '')  # e.g. 'v5litepod-8'
            if not accel and xm.xla_device_hw(self.device) == 'TPU':
                try:
                    accel = torch_xla.tpu.get_tpu_type()  # asks the TPU VM's metadata server
                except Exception:
                    pass
            if name.lower() == 'cpu':
                return f"XLA on the CPU: {cpu_name()}"
            return f"XLA {name} {accel}".strip()
        if self.type == 'tpu':
            accel = os.environ.get('TPU_ACCELERATOR_TYPE', '')  # e.g. 'v6e-8', where the VM sets it
            return (f"TorchTPU {self.tpu.device_name()} {accel}".strip() if self.tpu.native
                    else f"TorchTPU's code on the CPU ({self.tpu.backend}): {cpu_name()}")
        return cpu_name()

    def peak_tflops(self):
        """The chip's peak dense bf16 TFLOP/s, for MFU: None on a CPU (no meaningful figure) or a chip not
        in PEAK_TFLOPS."""
        name = self.name()
        if self.type == 'cpu' or name.startswith('XLA on the CPU') or (self.tpu and not self.tpu.native):
            return None
        return peak_tflops_of(name)


def stops_every_step(dev):
    """Whether a stop check may come after every step (a supervision step, a training step): on a single process
    off XLA (and TorchTPU) it reads the process's own flag, with no rank to agree with and no graph to cut."""
    return dev.world_size == 1 and dev.type not in ('xla', 'tpu')


def cpu_name():
    model, ext = cpu_features()
    return f"{model} [{' '.join(ext) or 'no AVX2'}], {torch.get_num_threads()} threads"


def to_cpu(obj, _copies=None):
    """A host copy of nested dicts / lists / tuples of tensors (what a checkpoint holds). A tensor met twice
    (the puzzle embedding the EMA model shares) is copied once, so torch.save writes it once."""
    copies = {} if _copies is None else _copies
    if torch.is_tensor(obj):
        if id(obj) not in copies:
            copies[id(obj)] = obj.detach().cpu()
        return copies[id(obj)]
    if isinstance(obj, dict):
        return {k: to_cpu(v, copies) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v, copies) for v in obj)
    return obj


class Prefetcher:
    """Keeps the next batch on its way to the device while the current step runs, and remembers the
    loader position of the batches actually consumed (what a checkpoint must store)."""
    def __init__(self, loader, dev):
        self.loader, self.dev = loader, dev
        self.consumed_state = loader.state_dict()
        self.upcoming = dev.to_device(loader.next_batch())

    def next(self):
        batch = self.upcoming
        self.consumed_state = self.loader.state_dict()
        self.upcoming = self.dev.to_device(self.loader.next_batch())
        return batch


# -----------------------------------------------------------------------------
# a profile on demand: a trace of a range of training steps

def parse_steps(text):
    """'START:END' -> (START, END) with 0 <= START < END, or None when text is not such a range."""
    parts = text.split(':')
    if len(parts) != 2 or not all(p.strip().isascii() and p.strip().isdigit() for p in parts):
        return None
    start, end = int(parts[0]), int(parts[1])
    return (start, end) if start < end else None


class Profiler:
    """A trace of the training steps after step `start` up to step `end` (the log's step numbers) into
    `folder`: torch_xla's profiler on XLA (folder/plugins/profile/<time>/<host>.xplane.pb, which TensorBoard's
    profile plugin opens), torch.profiler elsewhere (folder/trace_<start>_<end>.json, a Chrome trace that
    Perfetto and chrome://tracing open; TorchTPU adds its device trace, <host>_<rank>.xplane.pb, to the
    folder). Host-side only: the graphs the steps run are the same with and without it. phase(name) names a
    part of a step in the trace while one is being taken."""

    def __init__(self, dev, folder, start, end):
        self.dev, self.folder, self.start, self.end = dev, folder, start, end
        self.active, self.done, self.prof = False, False, None

    @classmethod
    def for_run(cls, dev, folder, profile_steps, step, run_steps):
        """Rank 0's Profiler of the span profile_steps ('START:END'; '': none) of a run at `step` of
        `run_steps`, or None; a span that holds none of the steps left is said, and profiles nothing."""
        span = parse_steps(profile_steps) if profile_steps else None
        if not (span and dev.master):
            return None
        if not (span[0] < run_steps and span[1] > step):
            print(f"warning: profile_steps={profile_steps} holds none of this run's steps (after step {step} up "
                  f"to step {run_steps}): no profile is taken")
        return cls(dev, folder, *span)

    def begin(self, step):
        """Before the step after `step` (steps done so far): the trace starts at the range's first step."""
        if self.done or self.active or not self.start <= step < self.end:
            return
        os.makedirs(self.folder, exist_ok=True)
        if self.dev.type == 'xla':
            import torch_xla.debug.profiler as xp
            xp.start_trace(self.folder)
        else:
            from torch.profiler import ProfilerActivity, profile
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.dev.type == 'cuda' else [])
            self.prof = profile(**(self.dev.tpu.profiler_options(self.folder, self.dev.rank) if self.dev.tpu
                                   else dict(activities=acts)))
            self.prof.start()
        self.active, self.first = True, step

    def phase(self, name):
        if not self.active:
            return contextlib.nullcontext()
        if self.dev.type == 'xla':
            import torch_xla.debug.profiler as xp
            return xp.Trace(name)
        return torch.profiler.record_function(name)

    def finish(self, step, last=False):
        """After a step: at the range's end (or at the loop's last step, `last`: a stop request) the trace is
        written. Returns its path (the folder on XLA), or None."""
        if not self.active or (step < self.end and not last):
            return None
        self.dev.wait()  # the traced steps' device work belongs in the trace
        self.active, self.done = False, True
        if self.dev.type == 'xla':
            import torch_xla.debug.profiler as xp
            xp.stop_trace()
            path = self.folder
        else:
            self.prof.stop()
            path = os.path.join(self.folder, f'trace_{self.first}_{step}.json')
            try:  # the writer may warn and return on a full disk, leaving a part of the file or none
                self.prof.export_chrome_trace(path)
                problem = None if os.path.exists(path) else 'the writer left no file (a full disk?)'
            except OSError as e:
                problem = f"{e.strerror or e}"
            self.prof = None
            if problem:
                for p in (path, path + '.tmp'):
                    with contextlib.suppress(OSError):
                        os.remove(p)
                print(f"warning: the profile of steps {self.first + 1}-{step} was not written to {path}: {problem}; "
                      "the run goes on", flush=True)
                return None
        print(f"profile of steps {self.first + 1}-{step} written to {path}")
        return path
