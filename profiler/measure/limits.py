"""The device's measured limits, and each attention call against them (a roofline).

- `device_limits(device, dtypes)`: the device's dense matmul throughput per dtype (FLOP/s) and its memory bandwidth
  (bytes/s), measured once per device, torch (and CUDA) version and torch thread count, then read from a JSON cache:
  $ATTNPROF_CACHE/device-limits.json, else $XDG_CACHE_HOME/attnprof/..., else ~/.cache/attnprof/device-limits.json.
  The device is warmed first (the products run for WARM_MS: an idle GPU sits at a low clock and would read low), then
  every figure times at least TARGET_MS of work: the operation repeated back to back inside one interval, the best
  of ROUNDS such intervals. Matmul: square n x n products (2 n^3 FLOPs), n doubled from 512 until one product takes
  a tenth of TARGET_MS or n reaches the device's cap (devices.py: 4096 on the CPU, 8192 on CUDA). Bandwidth: a copy
  of a large buffer (256 MiB on the CPU, 1 GiB device to device on CUDA) counted as read once and written once (2x
  its size); the same for a buffer of an eighth of the last-level cache (the CPU's L3 from sysfs, a GPU's L2), the
  bandwidth of a working set that stays in it. On the CPU, what new pages cost (an allocation of at least
  fresh_min_bytes gets them from the kernel every time: devices.py). Softmax: elements per second over a table in the
  cache (the exponentials a materialised or fused score table costs beyond its traffic). Timed by the device's own interval (CUDA events on the device's stream, a host clock on the CPU),
  after a synchronize. About 2 s per dtype on a 2-core CPU, a few seconds on a GPU.
  The small figures (the cache's bandwidth, softmax's rate, the score GEMMs' rate: each run of a few microseconds on a
  GPU) are rates only where no launch is in them: they are timed from `devices.replay_ms`, runs back to back per
  interval (on CUDA one CUDA graph of at least LAUNCHES of them replayed under events, so the host's launches are
  not in the figure; on the CPU a host-clock loop of TARGET_MS of work, as the other figures). Looped one launch
  after another inside one interval on the H200, they read the host's cost per launch (a cache bandwidth of 1.35e12 B/s, below the memory's
  4.24e12; softmax 3.7e11 elements/s). The host's cost per launch is stored apart (`launch_us`:
  measure/state.launch_us). A cache bandwidth below the memory's is refused (not a rate: every op is then priced
  at the memory's), with a line saying so in `refused`.
- `place(flops, bytes_moved, ms, peak_flops, peak_bytes_per_s)`: the achieved FLOP/s, the arithmetic intensity
  (FLOPs per byte moved), the roofline bound that applies (memory where intensity x bandwidth is below the compute
  peak, else compute) and the percent of that bound achieved.
"""
from __future__ import annotations

import datetime as dt
import json
import math
import platform
from pathlib import Path

import torch

from .. import devices
from ..env import cache_dir
from ..spec import torch_dtype

CACHE_FILE = "device-limits.json"
TARGET_MS = 100.0  # each figure times at least this much work in one interval
WARM_MS = 500.0  # of products before the first figure, so that the device runs at its working clock
ROUNDS = 3
LAUNCHES = 200  # the small figures: at least this many runs per interval (one CUDA graph of them on a GPU)
MAX_LAUNCHES = 10000  # and at most this many (a CUDA graph's nodes)
SCORE_HEAD_DIM = 8  # the score GEMMs' inner dimension: small, where a score element's cost is not its FLOPs
METHOD = (f"warmed for {WARM_MS:g} ms; matmul: square n x n (n doubled from 512 until one takes {TARGET_MS / 10:g} ms "
          f"or n reaches the device's cap), repeated to at least {TARGET_MS:g} ms per interval, best of {ROUNDS}; "
          f"bandwidth: a large buffer copied (read + written), repeated so, best of {ROUNDS}; the same for a buffer of "
          "an eighth of the last-level cache; new pages: a 4 x fresh_min_bytes buffer allocated and filled against "
          "a kept one's fill; softmax: rows of 1024 in an eighth of the cache; score GEMMs: (1024 x "
          f"{SCORE_HEAD_DIM}) @ ({SCORE_HEAD_DIM} x 1024) into a kept table and that table @ (1024 x "
          f"{SCORE_HEAD_DIM}), per score element; the cache's copy, softmax and the score GEMMs through "
          f"devices.replay_ms (on a GPU one CUDA graph of at least {LAUNCHES} runs replayed); the host's cost per "
          "launch apart (launch_us)")
LIMIT_KEYS = ("device_peak_flops", "device_peak_bytes_per_s", "device_limits", "device_memory",
              "device_softmax_per_s", "device_score_gemm_per_s", "device_launch_us")  # what a manifest holds


def cache_path() -> Path:
    return cache_dir() / CACHE_FILE


def _key(dev, kept: bool | None = None) -> str:
    """What the limits depend on: the device, the library versions, and (on the CPU) torch's threads and whether the
    process's memory is kept (devices.keep_memory: ours that time cells keep it, a user's own does not; the two are
    two machines to the time model). kept: this process's, unless given."""
    ident = dev.identity()
    if kept is None:
        kept = getattr(dev, "memory_kept", False)
    else:  # where glibc is not, no process keeps it (devices.keep_memory)
        kept = kept and dev.torch.type == "cpu" and platform.libc_ver()[0] == "glibc"
    return " | ".join(filter(None, (ident["device_name"], ident.get("device_uuid"), f"torch {torch.__version__}",
                                    f"cuda {torch.version.cuda}", f"threads {torch.get_num_threads()}",
                                    "memory kept" if kept else None)))


def machine_key(key: str) -> str:
    """A limits key less whether its process kept its memory: one machine to the time model's fit, which takes the
    runs of ours (memory kept) and a user's recorded generations (not kept) alike, each sample priced on its own
    run's limits (its new pages or none: planner/timing.py, B_new)."""
    return " | ".join(part for part in key.split(" | ") if part != "memory kept")


def device_key(device: str, kept: bool | None = None) -> str:
    """The key of this machine's device in the limits' cache (and in the time model's calibration file): of a
    process that keeps its memory (kept=True: one of ours that times cells), of one that does not (kept=False: a
    user's own, whose generations attnprof record stores), or (None) of this process as it is."""
    dev = devices.get(device)
    with dev.guard():
        return _key(dev, kept)


def device_limits(device: str, dtypes) -> dict:
    """{"device_peak_flops": {dtype: FLOP/s}, "device_peak_bytes_per_s": bytes/s, "device_memory": {cache_bytes,
    cache_bytes_per_s, fresh_bytes_per_s, fresh_min_bytes}, "device_softmax_per_s": {dtype: elements/s},
    "device_score_gemm_per_s": {dtype: score elements/s}, "device_launch_us": the host's microseconds per launch,
    "device_limits": {key, cache, measured_at, method, refused}}: from the cache, measuring what it lacks (a dtype
    not yet measured, a figure an older version did not measure) and adding it."""
    from ..store import add_to_cache, cache_lock, read_cache

    dev = devices.get(device)
    path = cache_path()
    with dev.guard(), cache_lock(path):  # another process measuring: wait, then read what it stored
        key = _key(dev)
        entry = dict(read_cache(path).get(key) or {})
        before = json.dumps(entry, sort_keys=True)
        with torch.no_grad():
            _measure_missing(dev, entry, dtypes)
        dev.release()
        if json.dumps(entry, sort_keys=True) != before:
            entry["measured_at"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
            add_to_cache(path, key, entry)  # one that cannot be written is measured again next time
    memory = {k: entry.get(k) for k in ("cache_bytes", "cache_bytes_per_s", "fresh_bytes_per_s")}
    return {"device_peak_flops": {d: entry["flops"][d] for d in dtypes}, "device_peak_bytes_per_s": entry["bytes_per_s"],
            "device_memory": {**memory, "fresh_min_bytes": dev.fresh_min_bytes},
            "device_softmax_per_s": {d: entry["softmax_per_s"][d] for d in dtypes},
            "device_score_gemm_per_s": {d: entry["score_gemm_per_s"][d] for d in dtypes},
            "device_launch_us": entry.get("launch_us"),
            "device_limits": {"key": key, "cache": str(path), "measured_at": entry["measured_at"], "method": METHOD,
                              "device": dev.torch.type, "refused": refused_lines(entry)}}


def refused_lines(entry: dict) -> list[str]:
    """Why a measured figure is not used (planner/timing.Device.of leaves it out): a cache bandwidth below the
    memory's is a cost per launch, not a rate (a cache entry's own names, bytes_per_s and cache_bytes_per_s)."""
    cache, memory = entry.get("cache_bytes_per_s"), entry.get("bytes_per_s")
    if cache and memory and cache < memory:
        return [f"the cache's bandwidth ({cache:.3g} B/s) came out below the memory's ({memory:.3g} B/s): a cost per "
                "launch, not a rate; refused, every op priced at the memory's bandwidth"]
    return []


SMALL = ("softmax_per_s", "score_gemm_per_s", "cache_bytes_per_s")  # the figures timed from replays (LAUNCHES)


def _measure_missing(dev, entry: dict, dtypes) -> None:
    """Each figure the cache entry lacks, measured into it. On CUDA, an entry whose small figures were looped one
    launch after another (before they were replayed: no "replayed" mark) has them measured anew."""
    if dev.torch.type == "cuda" and not entry.get("replayed"):
        for figure in SMALL:
            entry.pop(figure, None)
        entry.pop("cache_bytes", None)
    for figure, measure in (("flops", matmul_flops_per_s), ("softmax_per_s", softmax_per_s),
                            ("score_gemm_per_s", score_gemm_per_s)):
        have = entry.get(figure) or {}
        entry[figure] = {**have, **{d: measure(dev, d) for d in dtypes if d not in have}}
    if not entry.get("bytes_per_s"):
        entry["bytes_per_s"] = copy_bytes_per_s(dev)
    if "cache_bytes" not in entry:
        entry["cache_bytes"] = dev.cache_bytes()
        entry["cache_bytes_per_s"] = copy_bytes_per_s(dev, entry["cache_bytes"] // 8, replayed=True) \
            if entry["cache_bytes"] else None
    if "fresh_bytes_per_s" not in entry:
        entry["fresh_bytes_per_s"] = fresh_bytes_per_s(dev) if dev.fresh_min_bytes else None
    if "launch_us" not in entry:
        from .state import launch_us

        entry["launch_us"] = launch_us(dev)
    entry["replayed"] = True


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


def _replayed_ms(dev, fn, rounds: int = ROUNDS) -> float:
    """The best time of one run of fn (a small one: microseconds on a GPU), on a warm device, from `rounds` intervals
    of devices.replay_ms, each of enough runs for TARGET_MS of work (at most MAX_LAUNCHES): on CUDA the runs of one
    CUDA graph replayed, so that no launch is in the figure, and at least LAUNCHES of them; a host-clock loop on the
    CPU, which has no launch to spread: there a slow run (float16's score GEMMs, emulated: 22 ms) is timed over
    TARGET_MS, not LAUNCHES runs (4.4 s an interval: 18.2 s of CPU, 1.1 s so, the same rate)."""
    _warm(dev, fn)
    least = LAUNCHES if dev.kernel_clock else 1
    times = max(least, min(MAX_LAUNCHES, math.ceil(TARGET_MS / max(_interval_ms(dev, fn, 1), 1e-6))))
    return min(dev.replay_ms(fn, times, rounds))


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


def copy_bytes_per_s(dev, nbytes: int | None = None, replayed: bool = False) -> float:
    """The memory bandwidth: a buffer copied, its bytes read once and written once, on a warm device. By default a
    large one (from memory); given nbytes, that size (small enough, from the cache), replayed: timed as a small
    figure (_replayed_ms)."""
    src = torch.ones((nbytes or dev.copy_bytes) // 4, device=dev.torch)  # written first, so that its pages exist
    dst = torch.zeros_like(src)
    copy = lambda: dst.copy_(src)  # noqa: E731
    return 2 * src.nbytes / ((_replayed_ms if replayed else _best_ms)(dev, copy) / 1e3)


def fresh_bytes_per_s(dev) -> float:
    """What new pages cost beyond writing them: a buffer of 4x the size that always gets new pages (the device's
    fresh_min_bytes) allocated and filled, against the same fill of a kept buffer; its bytes over the difference."""
    n = 4 * dev.fresh_min_bytes // 4
    kept = torch.empty(n, device=dev.torch)
    new = lambda: torch.empty(n, device=dev.torch).fill_(1.0)  # noqa: E731
    reuse = lambda: kept.fill_(1.0)  # noqa: E731
    extra = _best_ms(dev, new) - _best_ms(dev, reuse)
    return 4 * n / (max(extra, 1e-6) / 1e3)


def softmax_per_s(dev, dtype: str) -> float:
    """Softmax throughput in elements per second over rows of 1024 that stay in the cache (an eighth of it, or 4 MiB
    where the device does not say): its exponentials, the work that a call's score table costs beyond moving it."""
    tdt = torch_dtype(dtype)
    elements = max(1024, ((dev.cache_bytes() or 2**25) // 8) // tdt.itemsize // 1024 * 1024)
    x = torch.randn(elements // 1024, 1024, device=dev.torch, dtype=tdt)
    out = torch.empty_like(x)
    return elements / (_replayed_ms(dev, lambda: torch.softmax(x, -1, out=out)) / 1e3)


def score_gemm_per_s(dev, dtype: str) -> float:
    """Score elements per second through an attention's two GEMMs at a small head dim (SCORE_HEAD_DIM), in the cache:
    q (1024 x d) @ k^T into a kept 1024 x 1024 table, then the table @ v (1024 x d). Where a call's score GEMMs are
    bound by neither their FLOPs nor their bytes, this is what a score element costs (planner/timing.py's third
    roof)."""
    n, d, tdt = 1024, SCORE_HEAD_DIM, torch_dtype(dtype)
    q, k, v = (torch.randn(n, d, device=dev.torch, dtype=tdt) for _ in range(3))
    table, out = torch.empty(n, n, device=dev.torch, dtype=tdt), torch.empty(n, d, device=dev.torch, dtype=tdt)
    kt = k.t()

    def gemms():
        torch.mm(q, kt, out=table)
        torch.mm(table, v, out=out)

    return n * n / (_replayed_ms(dev, gemms) / 1e3)


CACHE_SHARE = 0.5  # a working set of at most this share of the last-level cache moves at the cache's bandwidth


def cell_peaks(limits: dict, dtype: str) -> dict:
    """The limits that apply to a cell of this dtype, as the cell row stores them: the compute peak, the memory
    bandwidth, and where measured the last-level cache's size and bandwidth, softmax's rate and the host's cost per
    launch."""
    memory = limits.get("device_memory") or {}
    return {"device_peak_flops_per_s": (limits.get("device_peak_flops") or {}).get(dtype),
            "device_peak_bytes_per_s": limits.get("device_peak_bytes_per_s"),
            "device_cache_bytes": memory.get("cache_bytes"),
            "device_cache_bytes_per_s": memory.get("cache_bytes_per_s"),
            "device_softmax_per_s": (limits.get("device_softmax_per_s") or {}).get(dtype),
            "device_launch_us": limits.get("device_launch_us")}


def roof_of(extra: dict) -> tuple:
    """The roof place() takes, from a cell's limits (cell_peaks)."""
    return tuple(extra.get(k) for k in ("device_peak_flops_per_s", "device_peak_bytes_per_s", "device_cache_bytes",
                                        "device_cache_bytes_per_s"))


def place(flops: float, bytes_moved: float, ms: float, peak_flops: float | None = None,
          peak_bytes_per_s: float | None = None, cache_bytes: float | None = None,
          cache_bytes_per_s: float | None = None, working: float | None = None) -> dict:
    """One call (or a cell's calls summed) on the roofline: achieved FLOP/s, FLOPs per byte, and where the peaks
    are known the bound that applies ('compute' or 'memory') and the percent of it achieved. A call whose working
    set (working: the tables alive at once) fits the cache's share moves at the cache's bandwidth where measured: its
    memory roof is that one (sliced's small tables ran at 119-156% of the DRAM roof)."""
    if working is not None and cache_bytes and cache_bytes_per_s and working <= CACHE_SHARE * cache_bytes:
        peak_bytes_per_s = max(peak_bytes_per_s or 0.0, cache_bytes_per_s)
    achieved = flops / (ms / 1e3) if ms and ms > 0 else float("nan")
    intensity = flops / bytes_moved if bytes_moved else float("nan")
    out = {"achieved_flops_per_s": achieved, "arithmetic_intensity": intensity, "roofline_bound": None,
           "pct_of_peak": None}
    if peak_flops and peak_bytes_per_s and intensity == intensity:
        memory_roof = intensity * peak_bytes_per_s
        out["roofline_bound"] = "memory" if memory_roof < peak_flops else "compute"
        out["pct_of_peak"] = 100 * achieved / min(peak_flops, memory_roof)
    return out
