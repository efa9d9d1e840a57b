"""The machine's state, read between forwards and never by a thread while anything is timed: what the host pays a
launch, how fast the device runs a fixed GEMM, the GPU's clocks, the host's steal time and clock. A cell's state is
read before and after it; a cell where the host or the GPU moved over UNSTEADY_SHARE is `unsteady` and not ranked
(report/findings.py), since its backends' differences may be the machine's.

- launch_us(dev): host microseconds per launch of a tiny op (LAUNCH_OPS in-place adds to a one-element tensor, the
  device synchronized before and after, outside the clock), the median of LAUNCH_ROUNDS rounds: on CUDA what the host
  pays to dispatch and launch one op (the GPU runs each in a few microseconds, so the host sets the pace); on the CPU
  what it pays to dispatch and run one. The host's own speed, which moved 1.4-2x within minutes on the H200's VM.
- gemm_ref_ms(dev): a fixed GEMM on the device (CUDA: 4096 x 4096 fp16, GEMM_REPLAYS products replayed from one CUDA
  graph, timed by events around the replay: no host in the figure; the CPU: 128 x 128 fp32 by the host clock), the
  median of GEMM_ROUNDS rounds per product: the device's own speed.
"""
from __future__ import annotations

import statistics
import time

import torch

from .. import devices

LAUNCH_OPS = 1000
LAUNCH_ROUNDS = 5
GEMM_REPLAYS = 20
GEMM_ROUNDS = 5
UNSTEADY_SHARE = 0.05  # a figure read before and after a cell that moved more than this: the cell is unsteady


def launch_us(device, ops: int = LAUNCH_OPS, rounds: int = LAUNCH_ROUNDS, clock=time.perf_counter) -> float:
    """Host microseconds per launch of a tiny op on the device (module docstring)."""
    dev = devices.get(device) if isinstance(device, (str, torch.device)) else device
    with dev.guard(), torch.no_grad():
        x = torch.zeros(1, device=dev.torch)
        for _ in range(ops // 10):  # warm: the op's first dispatch, the device's first launch
            x.add_(1.0)
        samples = []
        for _ in range(rounds):
            dev.synchronize()
            t0 = clock()
            for _ in range(ops):
                x.add_(1.0)
            samples.append((clock() - t0) / ops * 1e6)
            dev.synchronize()
    return statistics.median(samples)


def gemm_ref_ms(device, rounds: int = GEMM_ROUNDS) -> float:
    """Milliseconds per product of a fixed GEMM on the device (module docstring): the device's own speed, replayed
    from a CUDA graph on a GPU (devices.Cuda.replay_ms), by the host clock on the CPU."""
    dev = devices.get(device) if isinstance(device, (str, torch.device)) else device
    cuda = dev.torch.type == "cuda"
    n, dtype = (4096, torch.float16) if cuda else (128, torch.float32)
    with dev.guard(), torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        a, b = (torch.randn(n, n, generator=gen).to(device=dev.torch, dtype=dtype) for _ in range(2))
        out = torch.empty(n, n, device=dev.torch, dtype=dtype)
        samples = dev.replay_ms(lambda: torch.mm(a, b, out=out), GEMM_REPLAYS, rounds)
    return statistics.median(samples)


# NVML's clock-event reasons (nvmlClocksEventReason*): the hardware's own slowdowns make a cell unsteady
CLOCK_REASONS = {0x1: "gpu idle", 0x2: "applications clocks setting", 0x4: "sw power cap", 0x8: "hw slowdown",
                 0x10: "sync boost", 0x20: "sw thermal slowdown", 0x40: "hw thermal slowdown",
                 0x80: "hw power brake slowdown", 0x100: "display clock setting"}
HW_SLOWDOWN = 0x8 | 0x40 | 0x80
SM_CLOCK_SHARE = 0.9  # the SM clock's median over a cell against its highest reading there, at least


def proc_stat(path: str = "/proc/stat") -> tuple[int, int] | None:
    """(steal jiffies, all jiffies) of the host's CPUs so far, or None where the kernel does not say."""
    try:
        fields = [int(x) for x in open(path).readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (fields[7] if len(fields) > 7 else 0), sum(fields)


def cpu_mhz(path: str = "/proc/cpuinfo") -> float | None:
    """The host CPUs' mean clock now (MHz), or None where the kernel does not say."""
    try:
        mhz = [float(line.split(":")[1]) for line in open(path) if line.startswith("cpu MHz")]
    except (OSError, ValueError, IndexError):
        return None
    return sum(mhz) / len(mhz) if mhz else None


class Watch:
    """The machine's state over a cell (or a shape's cells timed together): the launch probe and the fixed GEMM
    before and after, and between forwards the GPU's SM clock and clock-event reasons (NVML; CUDA only), the host's
    CPU clock; the host's steal time over the whole. Nothing is read by a thread, nothing while a forward is timed.
    result(): the columns a cell row carries, and `unsteady` (why, or None) where the device judges steadiness."""

    def __init__(self, dev, nvml=None):
        self.dev, self.clocks, self.reasons, self.mhz = dev, [], 0, []
        self.handle = self.nvml = None
        if dev.torch.type == "cuda":
            try:
                self.nvml = nvml or devices.nvml_module()
                self.handle = devices.nvml_handle(self.nvml, dev.torch.index or 0)
            except Exception:  # ImportError, OSError, NVMLError, LookupError: no clocks, said by their absence
                self.nvml = None

    def before(self) -> None:
        self.stat = proc_stat()
        self.launch = [launch_us(self.dev)]
        self.gemm = [gemm_ref_ms(self.dev)]
        self.between()

    def between(self) -> None:
        """A reading between forwards: the SM clock and the reasons it is held back, the host's CPU clock."""
        if self.nvml is not None:
            try:
                self.clocks.append(self.nvml.nvmlDeviceGetClockInfo(self.handle, self.nvml.NVML_CLOCK_SM))
                reasons = getattr(self.nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
                    self.nvml.nvmlDeviceGetCurrentClocksThrottleReasons
                self.reasons |= int(reasons(self.handle))
            except Exception:  # an NVML error mid-cell: the clocks read so far stand
                self.nvml = None
        mhz = cpu_mhz()
        if mhz:
            self.mhz.append(mhz)

    def after(self) -> None:
        self.between()
        self.launch.append(launch_us(self.dev))
        self.gemm.append(gemm_ref_ms(self.dev))
        end = proc_stat()
        self.steal = None if not (self.stat and end) or end[1] == self.stat[1] else \
            100 * (end[0] - self.stat[0]) / (end[1] - self.stat[1])

    def result(self) -> dict:
        named = [name for bit, name in CLOCK_REASONS.items() if self.reasons & bit]
        out = {"host_launch_us_before": self.launch[0], "host_launch_us_after": self.launch[-1],
               "gpu_ref_ms_before": self.gemm[0], "gpu_ref_ms_after": self.gemm[-1],
               "sm_clock_mhz_median": statistics.median(self.clocks) if self.clocks else None,
               "sm_clock_mhz_max": max(self.clocks) if self.clocks else None,
               "clock_reasons": ", ".join(named) or None, "host_steal_pct": getattr(self, "steal", None),
               "host_cpu_mhz": statistics.median(self.mhz) if self.mhz else None}
        judged = verdict(out, self.reasons) if self.dev.kernel_clock else {"unsteady": None, "unsteady_gpu": None}
        return {**out, **judged}


def verdict(state: dict, reasons: int = 0) -> dict:
    """Whether the machine held still over a cell: `unsteady`, why it did not (None where it did), and
    `unsteady_gpu`, whether the GPU itself moved (its GEMM, its SM clock, a hardware slowdown): a host that moved
    leaves kernel times standing (they are the GPU's) but not a host-bound forward's time."""
    host, gpu = [], []
    for what, before, after, where in (("the host's launch cost", state["host_launch_us_before"],
                                        state["host_launch_us_after"], host),
                                       ("the GPU's fixed GEMM", state["gpu_ref_ms_before"], state["gpu_ref_ms_after"],
                                        gpu)):
        if before and after and abs(after / before - 1) > UNSTEADY_SHARE:
            where.append(f"{what} moved {100 * (after / before - 1):+.0f}% ({before:.3g} -> {after:.3g})")
    median, top = state.get("sm_clock_mhz_median"), state.get("sm_clock_mhz_max")
    if median and top and median / top < SM_CLOCK_SHARE:
        gpu.append(f"the SM clock's median {median:.0f} MHz is {100 * median / top:.0f}% of its highest {top:.0f} MHz")
    if reasons & HW_SLOWDOWN:
        gpu.append(f"NVML saw {state['clock_reasons']}")
    why = host + gpu
    return {"unsteady": "; ".join(why) or None, "unsteady_gpu": bool(gpu)}
