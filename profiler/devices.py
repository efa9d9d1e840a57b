"""Every difference between CUDA and the CPU, in one place. Every CUDA call here names the cell's device: a cell on
cuda:1 never reads device 0's events, allocator or NVML handle.

- `resolve("auto")` picks the device; `get(name)` returns a `Cpu` or `Cuda` with the same methods: a guard that
  makes the device current, synchronize, an interval timer, allocator peaks (None on the CPU, where the profiler's
  allocation timeline measures memory), the profiler's settings, and what the device is (`identity`).
- NVML is matched to a CUDA device by UUID (then PCI bus id) from torch's device properties, never by ordinal:
  ordinals differ under CUDA_VISIBLE_DEVICES, PCI ordering and MIG. Nothing here creates a CUDA context except
  running work on the device: properties, NVML and free memory do not.
- `oom_message` turns every allocation failure (torch.OutOfMemoryError, or the RuntimeError text of cuBLAS, cuDNN
  and extensions) into one line with the size asked for.
"""
from __future__ import annotations

import contextlib
import functools
import os
import platform
import re
import resource
import socket
import sys
import time
from pathlib import Path

import torch

from .spec import InputError, parse_batch, parse_dtype, parse_size

_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def parse(value, where: str) -> str:
    """A device name as typed (auto, cpu, cuda, cuda:N), checked for form only."""
    if not isinstance(value, str) or not _DEVICE.fullmatch(value):
        raise InputError(f"{where}: device {value!r} is not auto, cpu, cuda or cuda:N")
    return value


def resolve(device: str) -> str:
    """auto -> cuda where CUDA is visible, else cpu; a CUDA device that is not there is bad input."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise InputError(f"device {device!r}: no CUDA device is visible here: use device cpu or auto "
                             "(--device on the command line, device: in a sweep config)")
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            raise InputError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s): "
                             f"use cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return device


def get(device: str | torch.device) -> "Cpu | Cuda":
    dev = torch.device(device)
    return Cuda(dev) if dev.type == "cuda" else Cpu(dev)


class HostInterval:
    """Elapsed milliseconds by a host clock (CPU ops are synchronous)."""

    def __init__(self, clock=time.perf_counter):
        self.clock, self.t0, self.elapsed = clock, 0.0, float("nan")

    def start(self) -> None:
        self.t0 = self.clock()

    def stop(self) -> None:
        self.elapsed = (self.clock() - self.t0) * 1e3

    def ms(self) -> float:
        return self.elapsed


class EventInterval:
    """Elapsed milliseconds between two CUDA events on the device's current stream; read after a synchronize.
    external: events that a CUDA graph being captured records as nodes of its own (torch.cuda.Event's external), so
    that each replay records them anew: in a replay no host sits between a call's kernels."""

    def __init__(self, device: torch.device, external: bool = False):
        self.stream = torch.cuda.current_stream(device)
        kind = {"enable_timing": True, **({"external": True} if external else {})}
        self.begin, self.end = torch.cuda.Event(**kind), torch.cuda.Event(**kind)

    def start(self) -> None:
        self.begin.record(self.stream)

    def stop(self) -> None:
        self.end.record(self.stream)

    def ms(self) -> float:
        return self.begin.elapsed_time(self.end)


_KEPT: bool | None = None


def keep_memory() -> bool:
    """Tell glibc's malloc, once per process, to map no allocation anew (M_MMAP_MAX 0) and to give no freed memory
    back to the kernel (M_TRIM_THRESHOLD at its most); False where the C library is not glibc. Called by every
    process of ours that times cells on the CPU (a sweep's worker, replay, make bench), never in a user's
    own process (profile, record): measure the user's generation as it runs without us. Kept, every cell is timed in
    the one steady state a long-lived process reaches after its warm-up forwards, as on a GPU; left as it is, a
    cell's time depended on the cells before it in its worker, and a user's generation is not a heap warming up:
    docs/timing.md gives the figures of both."""
    global _KEPT
    if _KEPT is None:
        import ctypes

        try:
            libc = ctypes.CDLL("libc.so.6")
            # M_MMAP_MAX 0; M_TRIM_THRESHOLD -1, which glibc reads as a size_t: the largest, never trimmed
            _KEPT = bool(libc.mallopt(-4, 0)) and bool(libc.mallopt(-1, -1))
        except (OSError, AttributeError):
            _KEPT = False
    return _KEPT


class Cpu:
    """The CPU: host clocks; memory comes from the profiler's allocation timeline (measure.trace_windows)."""

    allocator = False  # no allocator statistics: per-call memory comes from the profiler trace
    profile_memory = True  # the profiler's allocation timeline is the CPU's memory probe
    matmul_max = 4096  # the device limits' largest square matmul (measure/limits.py)
    copy_bytes = 256 * 2**20  # and the buffer its bandwidth copy moves (a large memcpy)
    memory_snapshot = False  # no allocator history to dump: --trace writes the profiler trace only
    kernel_clock = False  # a call's time and a forward's are the host clock's, in the same hooked forwards

    def __init__(self, device: torch.device):
        self.torch = device

    @property
    def memory_kept(self) -> bool:
        """Whether this process keeps its memory (keep_memory: a process of ours that times cells)."""
        return _KEPT is True

    @property
    def fresh_min_bytes(self) -> int | None:
        """Where the memory is not kept (a user's own process, or no glibc), glibc's largest mmap threshold on 64-bit
        (DEFAULT_MMAP_THRESHOLD_MAX): an allocation this large gets new pages from the kernel, each touched page a
        fault, which the time model (planner/timing.py) prices."""
        return None if self.memory_kept else 32 * 2**20

    def cache_bytes(self) -> int | None:
        """The last-level cache (sysfs: the highest cache index of cpu0), or None where the kernel does not say."""
        caches = sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"))
        sizes = [_sysfs_bytes(p) for p in caches]
        return max((s for s in sizes if s), default=None)

    def guard(self):
        return contextlib.nullcontext()

    def synchronize(self) -> None:
        pass

    def interval(self, clock=time.perf_counter, external: bool = False) -> HostInterval:
        return HostInterval(clock)

    def begin_cell(self) -> None:
        pass

    def reset_peak(self) -> None:
        pass

    def allocated(self) -> int | None:
        return None

    def peak_allocated(self) -> int | None:
        return None

    def reserved_max(self) -> int | None:
        return None

    def allocated_max(self) -> int | None:
        return None

    def release(self) -> None:
        pass

    def replay_ms(self, fn, times: int, rounds: int = 5, clock=time.perf_counter) -> list[float]:
        """Milliseconds per run of fn, fn run `times` times back to back in each of `rounds` intervals of the host
        clock (CPU ops are synchronous: the clock is the device's), after `times` runs to warm it (as Cuda.capture's
        runs before its capture). Cuda.replay_ms is its twin from a CUDA graph."""
        for _ in range(times):
            fn()
        out = []
        for _ in range(rounds):
            t0 = clock()
            for _ in range(times):
                fn()
            out.append((clock() - t0) * 1e3 / times)
        return out

    def faulted_bytes(self) -> int | None:
        """The bytes of the new pages this process has touched so far: its minor page faults (every thread's) times
        the page size. A call's difference is what its allocations cost the kernel, whichever of glibc's thresholds
        gave them new pages (planner/timing.py prices them at B_new)."""
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt * resource.getpagesize()

    def profiler_activities(self) -> list:
        return [torch.profiler.ProfilerActivity.CPU]

    def memory_history(self, path: Path | None):
        return contextlib.nullcontext()

    def identity(self) -> dict:
        return {"host": socket.gethostname(), "device_name": cpu_name(), "device_uuid": None, "pci_bus_id": None}


class Cuda:
    """One CUDA device. The allocator's peak is reset at every call or forward; `reserved_max` and `allocated_max`
    are the cell's highest reserved and allocated memory, folded in before each reset so that no reset loses them."""

    allocator = True
    profile_memory = False  # the allocator measures; the trace is only for kernel names
    matmul_max = 8192
    copy_bytes = 2**30  # a device-to-device copy
    memory_snapshot = True  # the caching allocator's history, for PyTorch's memory_viz
    kernel_clock = True  # a call's time is its kernels' (CUPTI), a forward's a plain one's; graphs capture
    fresh_min_bytes = None  # the caching allocator keeps its blocks: no call pays for new pages after the first

    def __init__(self, device: torch.device):
        self.torch = torch.device("cuda", device.index if device.index is not None else 0)
        self._reserved = self._allocated = 0

    def cache_bytes(self) -> int | None:
        """The L2 cache, from the device's properties (no context made)."""
        return getattr(torch.cuda.get_device_properties(self.torch), "L2_cache_size", None) or None

    def guard(self):
        return torch.cuda.device(self.torch)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.torch)

    def interval(self, clock=None, external: bool = False) -> EventInterval:
        return EventInterval(self.torch, external)

    def begin_cell(self) -> None:
        self._reserved = self._allocated = 0
        torch.cuda.reset_peak_memory_stats(self.torch)

    def reset_peak(self) -> None:
        self._reserved = max(self._reserved, torch.cuda.max_memory_reserved(self.torch))
        self._allocated = max(self._allocated, torch.cuda.max_memory_allocated(self.torch))
        torch.cuda.reset_peak_memory_stats(self.torch)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.torch)

    def peak_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.torch)

    def reserved_max(self) -> int:
        return max(self._reserved, torch.cuda.max_memory_reserved(self.torch))

    def allocated_max(self) -> int:
        return max(self._allocated, torch.cuda.max_memory_allocated(self.torch))

    def capture(self, fn) -> "torch.cuda.CUDAGraph":
        """fn captured into one CUDA graph, after three runs on a side stream (as torch.cuda.graphs asks): replay()
        runs its kernels with one launch. fn must be capturable: fixed shapes, no synchronize, no host read of a
        device value. Raises what the capture raised where it is not."""
        with torch.cuda.device(self.torch):  # torch.cuda.graph captures on the current device's stream: the cell's
            stream = torch.cuda.Stream(self.torch)
            stream.wait_stream(torch.cuda.current_stream(self.torch))
            with torch.cuda.stream(stream):
                for _ in range(3):
                    fn()
            torch.cuda.current_stream(self.torch).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            graph.replay()  # the first replay uploads the graph
        self.synchronize()
        return graph

    def replay_ms(self, fn, times: int, rounds: int = 5, clock=None) -> list[float]:
        """Milliseconds per run of fn on the GPU alone: fn captured `times` times into one CUDA graph (capture), the
        graph replayed in each of `rounds` intervals of CUDA events. A replay launches once, so no host time is in the
        figure (events around one call of a host-bound op time the host)."""
        graph = self.capture(lambda: [fn() for _ in range(times)])
        out = []
        for _ in range(rounds):
            interval = self.interval()
            self.synchronize()
            interval.start()
            graph.replay()
            interval.stop()
            self.synchronize()
            out.append(interval.ms() / times)
        del graph
        return out

    def faulted_bytes(self) -> None:
        """None: the caching allocator keeps its blocks, and a host page fault is not the device's."""
        return None

    def release(self) -> None:
        """After a cell (and after an OOM): give cached blocks back so that the next cell starts clean."""
        self.synchronize()
        torch.cuda.empty_cache()

    def profiler_activities(self) -> list:
        return [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]

    @contextlib.contextmanager
    def memory_history(self, path: Path | None):
        """With a path: the allocator's history (every alloc and free, with stacks) recorded on this device over
        the block and dumped there as a snapshot that PyTorch's memory_viz reads (pytorch.org/memory_viz)."""
        if path is None:
            yield
            return
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, device=self.torch)
        try:
            yield
            torch.cuda.memory._dump_snapshot(str(path))
        finally:
            torch.cuda.memory._record_memory_history(enabled=None, device=self.torch)

    def identity(self) -> dict:
        return {"host": socket.gethostname(), **describe_cuda(self.torch.index)}


def _sysfs_bytes(path: Path) -> int | None:
    """'32768K' -> 33554432; None where unreadable."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    return int(text[:-1]) * units[text[-1]] if text and text[-1] in units else int(text) if text.isdigit() else None


# ---- NVTX ranges, for Nsight Systems

NVTX_ENV = "ATTNPROF_NVTX"  # "1": ranges on, here and in the processes started from here (workers, record's script)
# range_push(name), range_pop(), range(fmt, name): a CUDA build's (its ranges mark host code, a CPU cell's too); a CPU
# build has none (its calls raise). The seam of every range: the tests swap it for a fake that records the calls
NVTX = torch.cuda.nvtx if hasattr(torch._C, "_nvtx") else None


def nvtx():
    """NVTX where its ranges are on, else None: no range made, no call (a CPU build under nsys too). On: ATTNPROF_NVTX=1
    (--nvtx: nvtx_ranges), or a process Nsight Systems profiles (nsys sets NSYS_PROFILING_SESSION_ID in it)."""
    return NVTX if os.environ.get(NVTX_ENV) == "1" or "NSYS_PROFILING_SESSION_ID" in os.environ else None


@contextlib.contextmanager
def nvtx_ranges():
    """--nvtx: ranges on for the block, here and in the processes it starts (ATTNPROF_NVTX=1, put back after); bad
    input on a torch without NVTX."""
    if NVTX is None:
        raise InputError(f"--nvtx: this torch ({torch.__version__}) has no NVTX, a CPU build: install a CUDA build "
                         "of torch for Nsight Systems' ranges, or leave --nvtx out")
    old = os.environ.get(NVTX_ENV)
    os.environ[NVTX_ENV] = "1"
    try:
        yield
    finally:
        os.environ.pop(NVTX_ENV) if old is None else os.environ.update({NVTX_ENV: old})


def nvtx_range(name: str):
    """One NVTX range around a block where ranges are on (nvtx()), else none."""
    calls = nvtx()
    return calls.range("{}", name) if calls else contextlib.nullcontext()  # the name as it is, braces and all


# ---- what a CUDA device is, and its NVML handle (no CUDA context is made)

def pci_bus_id(props) -> str | None:
    """NVML's form of the PCI address, e.g. 00000000:3B:00.0, from torch's device properties."""
    if not hasattr(props, "pci_bus_id"):
        return None
    return f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"


def nvml_uuids(uuid: str | None) -> list[str]:
    """NVML's names for a CUDA UUID: torch prints it bare; NVML wants GPU-... (or MIG-... for a MIG instance)."""
    if not uuid:
        return []
    uuid = str(uuid)
    return [uuid] if uuid.startswith(("GPU-", "MIG-")) else [f"GPU-{uuid}", f"MIG-{uuid}"]


def nvml_handle(nvml, index: int, props=None):
    """The NVML handle of CUDA device `index` (as this process numbers it), found by UUID, then PCI bus id."""
    props = props if props is not None else torch.cuda.get_device_properties(index)
    tried = []
    for uuid in nvml_uuids(getattr(props, "uuid", None)):
        try:
            return nvml.nvmlDeviceGetHandleByUUID(uuid)
        except nvml.NVMLError as e:
            tried.append(f"UUID {uuid}: {e}")
    bus = pci_bus_id(props)
    if bus:
        try:
            return nvml.nvmlDeviceGetHandleByPciBusId(bus)
        except nvml.NVMLError as e:
            tried.append(f"PCI {bus}: {e}")
    raise LookupError(f"NVML has no device matching cuda:{index} ({'; '.join(tried) or 'no UUID or PCI id'})")


def nvml_module():
    """pynvml (package nvidia-ml-py), initialised; raises ImportError / NVMLError / OSError where there is none."""
    import pynvml

    pynvml.nvmlInit()
    return pynvml


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def describe_cuda(index: int) -> dict:
    """Name, architecture (compute capability), UUID, PCI bus id, total memory and driver of a CUDA device, from
    torch's properties and NVML."""
    props = torch.cuda.get_device_properties(index)
    out = {"device_name": props.name, "device_arch": f"sm{props.major}{props.minor}",
           "device_uuid": str(getattr(props, "uuid", "")) or None, "pci_bus_id": pci_bus_id(props),
           "total_memory_bytes": props.total_memory, "driver": None}
    try:
        nvml = nvml_module()
        nvml_handle(nvml, index, props)
        out["driver"] = _text(nvml.nvmlSystemGetDriverVersion())
    except Exception as e:  # ImportError, OSError, NVMLError or LookupError: say why instead of failing
        out["driver"] = f"unavailable: {type(e).__name__}: {e}"
    return out


@functools.lru_cache(maxsize=1)
def _libcuda():
    """The CUDA driver library, initialised (cuInit makes no context), or None where there is none."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    return cuda if cuda.cuInit(0) == 0 else None


def primary_context_active(index: int = 0) -> bool | None:
    """Whether this process holds the CUDA primary context of device `index`, asked of the driver itself
    (cuDevicePrimaryCtxGetState: torch's is_initialized() turns true on reading device properties, which makes no
    context). None without libcuda or where the driver cannot answer."""
    import ctypes

    cuda = _libcuda()
    if cuda is None:
        return None
    dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    if cuda.cuDeviceGet(ctypes.byref(dev), index) or \
            cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)):
        return None
    return bool(active.value)


def free_memory_bytes(device: str) -> int:
    """What the device has free now. CUDA: NVML's free memory, which needs no CUDA context in this process (torch's
    mem_get_info makes one, so it is only the fallback). CPU: MemAvailable."""
    dev = torch.device(device)
    if dev.type == "cuda":
        index = dev.index or 0
        try:
            nvml = nvml_module()
            return int(nvml.nvmlDeviceGetMemoryInfo(nvml_handle(nvml, index)).free)
        except Exception:  # no NVML: ask the CUDA runtime (this makes a context here)
            return torch.cuda.mem_get_info(dev)[0]
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ---- allocation failures

_OOM_TEXT = re.compile(r"out of memory|ALLOC_FAILED|CUBLAS_STATUS_ALLOC|cudaErrorMemoryAllocation", re.IGNORECASE)
_ASKED = re.compile(r"[Tt]ried to allocate ([\d.]+ ?[KMGT]?i?B)")


def oom_message(exc: BaseException) -> str | None:
    """One line for an allocation failure (with the size asked for where the message gives it), else None.
    torch raises OutOfMemoryError; cuBLAS, cuDNN, xformers and flash-attn raise RuntimeError with the text."""
    text = str(exc).strip()
    if not isinstance(exc, torch.OutOfMemoryError) and not (isinstance(exc, RuntimeError) and _OOM_TEXT.search(text)):
        return None
    first = (text.splitlines() or [type(exc).__name__])[0][:300]
    asked = _ASKED.search(text)
    if asked and asked.group(1) not in first:
        first += f" (tried to allocate {asked.group(1)})"
    return f"{type(exc).__name__}: {first}"


@contextlib.contextmanager
def full_fp32():
    """float32 as float32 for the block: TF32 off for cuBLAS matmuls and cuDNN convolutions (both may be on by
    default on a GPU: torch.backends.cudnn.allow_tf32 is True), restored after. The fp32 reference runs so, or it
    would compare fp16 against TF32 precision."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def _on_cpu(device: str) -> bool:
    """Whether a device as typed is the CPU (auto resolved here; a CUDA name is not checked: a plan targets one)."""
    return (resolve(device) if device == "auto" else device) == "cpu"


def default_dtype(device: str) -> str:
    """The dtype a cell runs in where none is given: float32 on the CPU (it has no fast float16 path), float16 on
    CUDA ('auto' is resolved first)."""
    return "float32" if _on_cpu(device) else "float16"


def given_dtype(dtype: str | None, device: str, say: bool = False) -> str:
    """--dtype, or without it the device's default (float32 on the CPU, float16 on CUDA); with say, float16 on the
    CPU is said (once: here) to be emulated."""
    dtype = parse_dtype(dtype) if dtype else default_dtype(device)
    note = dtype_note(device, [dtype]) if say else None
    if note:
        print(f"attnprof: {note}", file=sys.stderr, flush=True)
    return dtype


def given_shape(size, batch, dtype, device: str, say: bool = False) -> tuple:
    """--size (repeatable; default 512x512), --batch and --dtype as a command takes them: (sizes, batch, dtype)."""
    return [parse_size(s) for s in (size or ["512x512"])], parse_batch(batch), given_dtype(dtype, device, say)


def dtype_note(device: str, dtypes) -> str | None:
    """What to say once where a command runs (or plans) float16 on the CPU, else None."""
    if not _on_cpu(device) or "float16" not in set(dtypes):
        return None
    return ("note: float16 on the CPU is emulated (no fast float16 kernels there): its times are several times "
            "float32's, the CPU's default dtype")
