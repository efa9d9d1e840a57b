"""The device's measured limits, and each attention call against them (a roofline).

- `device_limits(device, dtypes)`: the device's dense matmul throughput per dtype (FLOP/s) and its memory bandwidth
  (bytes/s), measured once per device, torch (and CUDA) version and torch thread count, then read from a JSON cache:
  $ATTNPROF_CACHE/device-limits.json, else $XDG_CACHE_HOME/attnprof/..., else ~/.cache/attnprof/device-limits.json.
  The device is warmed first (the products run for WARM_MS: an idle GPU sits at a low clock and would read low), then
  every figure times at least TARGET_MS of work: the operation repeated back to back inside one interval, the best
  of ROUNDS such intervals. Matmul: square n x n products (2 n^3 FLOPs), n doubled from 512 until one product takes
  a tenth of TARGET_MS or n reaches the device's cap (devices.py: 4096 on the CPU, 8192 on CUDA). Bandwidth: a copy
  of a large buffer (256 MiB on the CPU, 1 GiB device to device on CUDA) counted as read once and written once (2x
  its size). Timed by the device's own interval (CUDA events on the device's stream, a host clock on the CPU),
  after a synchronize. About 2 s per dtype on a 2-core CPU, a few seconds on a GPU.
- `place(flops, bytes_moved, ms, peak_flops, peak_bytes_per_s)`: the achieved FLOP/s, the arithmetic intensity
  (FLOPs per byte moved), the roofline bound that applies (memory where intensity x bandwidth is below the compute
  peak, else compute) and the percent of that bound achieved.
"""
from __future__ import annotations

import datetime as dt
import math
from pathlib import Path

import torch

from .. import devices
from ..env import cache_dir
from ..spec import torch_dtype

CACHE_FILE = "device-limits.json"
TARGET_MS = 100.0  # each figure times at least this much work in one interval
WARM_MS = 500.0  # of products before the first figure, so that the device runs at its working clock
ROUNDS = 3
METHOD = (f"warmed for {WARM_MS:g} ms; matmul: square n x n (n doubled from 512 until one takes {TARGET_MS / 10:g} ms "
          f"or n reaches the device's cap), repeated to at least {TARGET_MS:g} ms per interval, best of {ROUNDS}; "
          f"bandwidth: a large buffer copied (read + written), repeated so, best of {ROUNDS}")


def cache_path() -> Path:
    return cache_dir() / CACHE_FILE


def _key(dev) -> str:
    """What the limits depend on: the device, the library versions, and (on the CPU) torch's threads."""
    ident = dev.identity()
    return " | ".join(filter(None, (ident["device_name"], ident.get("device_uuid"), f"torch {torch.__version__}",
                                    f"cuda {torch.version.cuda}", f"threads {torch.get_num_threads()}")))


def device_key(device: str) -> str:
    """The key of this machine's device in the limits' cache (and in the time model's calibration file)."""
    dev = devices.get(device)
    with dev.guard():
        return _key(dev)


def device_limits(device: str, dtypes) -> dict:
    """{"device_peak_flops": {dtype: FLOP/s}, "device_peak_bytes_per_s": bytes/s, "device_limits": {key, cache,
    measured_at, method}}: from the cache, measuring what it lacks (a dtype not yet measured) and adding it."""
    from ..store import add_to_cache, read_cache

    dev = devices.get(device)
    path = cache_path()
    with dev.guard():
        key = _key(dev)
        entry = read_cache(path).get(key) or {}
        flops = dict(entry.get("flops") or {})
        todo = [d for d in dtypes if d not in flops]
        with torch.no_grad():
            flops.update({d: matmul_flops_per_s(dev, d) for d in todo})
            bandwidth = entry.get("bytes_per_s") or copy_bytes_per_s(dev)
        dev.release()
    if todo or not entry.get("bytes_per_s"):
        entry = {"flops": flops, "bytes_per_s": bandwidth,
                 "measured_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
        add_to_cache(path, key, entry)  # one that cannot be written is measured again next time
    return {"device_peak_flops": {d: flops[d] for d in dtypes}, "device_peak_bytes_per_s": bandwidth,
            "device_limits": {"key": key, "cache": str(path), "measured_at": entry["measured_at"], "method": METHOD}}


def _interval_ms(dev, fn, times: int) -> float:
    """Milliseconds of `times` runs of fn back to back, in one interval of the device's clock."""
    dev.synchronize()
    clock = dev.interval()
    clock.start()
    for _ in range(times):
        fn()
    clock.stop()
    dev.synchronize()
    return clock.ms()


def _warm(dev, fn) -> None:
    """Run fn for at least WARM_MS: 1, 2, 4, ... runs an interval."""
    spent, times = 0.0, 1
    while spent < WARM_MS:
        spent += _interval_ms(dev, fn, times)
        times *= 2


def _best_ms(dev, fn, rounds: int = ROUNDS) -> float:
    """The best time of one run of fn, on a warm device, each of `rounds` intervals timing enough runs back to back
    for TARGET_MS of work."""
    _warm(dev, fn)
    times = max(1, math.ceil(TARGET_MS / max(_interval_ms(dev, fn, 1), 1e-6)))
    return min(_interval_ms(dev, fn, times) / times for _ in range(rounds))


def matmul_flops_per_s(dev, dtype: str) -> float:
    """The best dense matmul throughput in this dtype: 2 n^3 FLOPs per product, on a warm device."""
    n, tdt = 512, torch_dtype(dtype)
    while True:
        a, b = (torch.randn(n, n, device=dev.torch, dtype=tdt) for _ in range(2))
        out = torch.empty(n, n, device=dev.torch, dtype=tdt)
        product = lambda: torch.mm(a, b, out=out)  # noqa: E731
        product()  # the library picks its kernel
        if n >= dev.matmul_max or _interval_ms(dev, product, 1) >= TARGET_MS / 10:
            return 2 * n**3 / (_best_ms(dev, product) / 1e3)
        n *= 2


def copy_bytes_per_s(dev) -> float:
    """The memory bandwidth: a large buffer copied, its bytes read once and written once, on a warm device."""
    src = torch.ones(dev.copy_bytes // 4, device=dev.torch)  # written first, so that its pages exist
    dst = torch.zeros_like(src)
    copy = lambda: dst.copy_(src)  # noqa: E731
    return 2 * src.nbytes / (_best_ms(dev, copy) / 1e3)


def cell_peaks(limits: dict, dtype: str) -> dict:
    """The two limits that apply to a cell of this dtype, as the cell row stores them."""
    return {"device_peak_flops_per_s": (limits.get("device_peak_flops") or {}).get(dtype),
            "device_peak_bytes_per_s": limits.get("device_peak_bytes_per_s")}


def place(flops: float, bytes_moved: float, ms: float, peak_flops: float | None = None,
          peak_bytes_per_s: float | None = None) -> dict:
    """One call (or a cell's calls summed) on the roofline: achieved FLOP/s, FLOPs per byte, and where the peaks
    are known the bound that applies ('compute' or 'memory') and the percent of it achieved."""
    achieved = flops / (ms / 1e3) if ms and ms > 0 else float("nan")
    intensity = flops / bytes_moved if bytes_moved else float("nan")
    out = {"achieved_flops_per_s": achieved, "arithmetic_intensity": intensity, "roofline_bound": None,
           "pct_of_peak": None}
    if peak_flops and peak_bytes_per_s and intensity == intensity:
        memory_roof = intensity * peak_bytes_per_s
        out["roofline_bound"] = "memory" if memory_roof < peak_flops else "compute"
        out["pct_of_peak"] = 100 * achieved / min(peak_flops, memory_roof)
    return out
