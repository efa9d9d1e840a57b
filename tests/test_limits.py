"""The device's measured limits (cached per device and library versions), each backend's model of the bytes a call
moves, and the roofline that places a call against the limits."""
import json
import math

import pytest

from profiler.attention import backends
from profiler.measure import limits
from profiler.planner import memory

# SD 1.5's finest self-attention at 512x512 in float32: batch 1, 8 heads of 40, 4096 x 4096 tokens
ROW = {"batch": 1, "heads": 8, "head_dim": 40, "tokens_q": 4096, "tokens_k": 4096, "score_elements": 8 * 4096 * 4096,
       "score_bytes": 8 * 4096 * 4096 * 4, "flops": 4 * 8 * 4096 * 4096 * 40, "upcast": ""}
QKVO = 4 * 8 * 4096 * 40 * 4  # Q, K, V and O, each 8 x 4096 x 40 float32
TABLE = 8 * 4096 * 4096 * 4


def test_the_cpus_limits_are_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNPROF_CACHE", str(tmp_path))
    first = limits.device_limits("cpu", ["float32"])
    flops, bandwidth = first["device_peak_flops"]["float32"], first["device_peak_bytes_per_s"]
    assert 1e8 < flops < 1e13 and 1e8 < bandwidth < 1e12  # a CPU, whatever its load: not zero, not a GPU
    cache = json.loads((tmp_path / "device-limits.json").read_text())
    (key, entry), = cache.items()
    assert "torch 2.13" in key and "threads" in key and entry["flops"] == {"float32": flops}
    again = limits.device_limits("cpu", ["float32"])  # from the cache: the very figures, not a new measurement
    assert again["device_peak_flops"] == {"float32": flops} and again["device_peak_bytes_per_s"] == bandwidth
    both = limits.device_limits("cpu", ["float32", "bfloat16"])  # only the missing dtype is measured
    assert both["device_peak_flops"]["float32"] == flops and both["device_peak_flops"]["bfloat16"] > 0
    assert set(json.loads((tmp_path / "device-limits.json").read_text())[key]["flops"]) == {"float32", "bfloat16"}
    assert both["device_limits"]["cache"] == str(tmp_path / "device-limits.json")
    assert 1e6 < both["device_score_gemm_per_s"]["float32"] < both["device_softmax_per_s"]["float32"] * 10


def test_a_figure_an_older_cache_entry_lacks_is_measured_and_added_alone(tmp_path, monkeypatch):
    """An entry written before the score GEMMs' rate was measured gets that figure, and keeps every other: what a
    sweep's manifest held stays comparable with what the new one holds."""
    monkeypatch.setenv("ATTNPROF_CACHE", str(tmp_path))
    first = limits.device_limits("cpu", ["float32"])
    path = tmp_path / "device-limits.json"
    (key, entry), = json.loads(path.read_text()).items()
    older = {k: v for k, v in entry.items() if k != "score_gemm_per_s"}
    path.write_text(json.dumps({key: older}))
    again = limits.device_limits("cpu", ["float32"])
    assert again["device_score_gemm_per_s"]["float32"] > 0
    assert {k: again[k] for k in ("device_peak_flops", "device_peak_bytes_per_s", "device_softmax_per_s")} == \
        {k: first[k] for k in ("device_peak_flops", "device_peak_bytes_per_s", "device_softmax_per_s")}
    assert json.loads(path.read_text())[key]["score_gemm_per_s"] == again["device_score_gemm_per_s"]


def test_the_cache_lives_under_xdg_cache_home_unless_attnprof_cache_says(monkeypatch, tmp_path):
    monkeypatch.delenv("ATTNPROF_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert limits.cache_path() == tmp_path / "attnprof" / "device-limits.json"


@pytest.mark.parametrize("name, options, expected", [
    ("naive", {}, QKVO + 4 * TABLE),  # the score table written, read, the probabilities written, read
    ("sliced", {"slice_size": 2}, QKVO + 4 * TABLE),  # the same traffic, a slice at a time
    ("sdpa-flash", {}, QKVO),  # Q, K and V read once, O written once
    ("sdpa", {}, QKVO),
    ("split", {"budget_bytes": 2**27}, QKVO + 2 * 8 * 4096 * 40 * 4 * 3 + 4 * TABLE),  # K and V read by 4 chunks
    ("subquad", {}, QKVO + 2 * 8 * 4096 * 40 * 4 * 3 + 4 * TABLE + 2 * 8 * 4096 * 40 * 4),  # 4 x 1 chunks
    ("sdpa-math", {}, QKVO + 4 * TABLE),  # float32 already: no copies
])
def test_each_backends_model_of_the_bytes_a_call_moves(name, options, expected):
    assert memory.bytes_moved(name, ROW, "float32", **options) == expected


def test_math_copies_half_inputs_to_float32_and_sdpa_follows_its_kernel():
    half = {**ROW, "score_bytes": TABLE // 2}
    a = 8 * 4096 * 40 * 2  # one projection in float16
    assert memory.bytes_moved("sdpa-math", half, "float16") == 2 * 4 * a + 4 * TABLE + 3 * a * 3 + a * 3
    assert memory.bytes_moved("sdpa", {**half, "sdpa_kernel": "math"}, "float16") == \
        memory.bytes_moved("sdpa-math", half, "float16")
    assert memory.bytes_moved("sdpa", {**half, "sdpa_kernel": "flash"}, "float16") == 4 * a


def test_a_registered_backend_moves_the_bytes_of_the_builtin_it_is_like():
    from diffusers.models.attention_processor import AttnProcessor

    backends.register(backends.Backend("mine", "materialised", "a plugin", factory=AttnProcessor, memory_like="naive"))
    try:
        assert memory.bytes_moved("mine", ROW, "float32") == memory.bytes_moved("naive", ROW, "float32")
    finally:
        backends.BACKENDS.pop("mine")


def test_a_call_is_placed_against_the_bound_that_applies():
    # 1 TFLOP/s compute, 100 GB/s: the ridge at 10 FLOPs per byte
    memory = limits.place(flops=4e9, bytes_moved=2e9, ms=100.0, peak_flops=1e12, peak_bytes_per_s=1e11)
    assert memory == {"achieved_flops_per_s": 4e10, "arithmetic_intensity": 2.0, "roofline_bound": "memory",
                      "pct_of_peak": pytest.approx(100 * 4e10 / 2e11)}  # bound: 2 FLOPs/B x 100 GB/s
    compute = limits.place(flops=4e11, bytes_moved=1e9, ms=1000.0, peak_flops=1e12, peak_bytes_per_s=1e11)
    assert compute["roofline_bound"] == "compute" and compute["pct_of_peak"] == pytest.approx(40.0)
    unknown = limits.place(flops=4e9, bytes_moved=2e9, ms=100.0)  # no limits measured: no bound, no percent
    assert unknown["roofline_bound"] is None and unknown["pct_of_peak"] is None
    assert unknown["achieved_flops_per_s"] == 4e10
    # a 32 MiB last-level cache at 400 GB/s: a call whose tables (8 MiB) stay in half of it meets the cache's roof,
    # so sliced's small tables no longer run "at 150% of memory"; one whose tables (20 MiB) spill meets DRAM's
    cached = dict(peak_flops=1e12, peak_bytes_per_s=1e11, cache_bytes=32 * 2**20, cache_bytes_per_s=4e11)
    fits = limits.place(flops=4e9, bytes_moved=2e9, ms=10.0, **cached, working=8 * 2**20)
    assert fits["pct_of_peak"] == pytest.approx(100 * 4e11 / (2.0 * 4e11))  # 50% of the cache's roof
    spills = limits.place(flops=4e9, bytes_moved=2e9, ms=10.0, **cached, working=20 * 2**20)
    assert spills["pct_of_peak"] == pytest.approx(100 * 4e11 / (2.0 * 1e11))  # DRAM's: 200%, a bound beaten


class FakeDevice:
    """A device whose clock moves only when work runs: each product or copy takes `ms` (an H200's 8192^3 fp16
    product: about 1.5 ms), and the first WARM_MS of work runs at half speed (an idle GPU's low clock)."""

    matmul_max, copy_bytes, kernel_clock = 8192, 2**20, False

    def __init__(self, ms: float):
        import torch

        self.torch, self.ms, self.now, self.intervals = torch.device("cpu"), ms, 0.0, []

    def work(self):
        self.now += self.ms * (2 if self.now < limits.WARM_MS else 1)

    def synchronize(self):
        pass

    def interval(self):
        dev = self

        class Interval:
            def start(self):
                self.t0 = dev.now

            def stop(self):
                self.t1 = dev.now
                dev.intervals.append(self.t1 - self.t0)

            def ms(self):
                return self.t1 - self.t0

        return Interval()


def test_each_limit_times_at_least_100_ms_of_work_on_a_warmed_device():
    """A product of 1.5 ms (the matmul search stops at the cap, n = 8192): the device is warmed for WARM_MS first,
    then each of the ROUNDS timed intervals holds at least TARGET_MS of products, so the figure is the warm speed."""
    dev = FakeDevice(ms=1.5)
    best = limits._best_ms(dev, dev.work)
    assert best == pytest.approx(1.5)  # the warm speed, not the cold one (3 ms)
    timed = dev.intervals[-limits.ROUNDS:]
    assert len(timed) == limits.ROUNDS and min(timed) >= limits.TARGET_MS
    assert sum(dev.intervals[:-limits.ROUNDS - 1]) >= limits.WARM_MS  # warmed before the first timed interval


def test_the_matmul_search_stops_at_the_cap_and_still_times_100_ms(monkeypatch):
    dev = FakeDevice(ms=0.05)
    monkeypatch.setattr(limits.torch, "mm", lambda a, b, out: dev.work())
    monkeypatch.setattr(limits.torch, "randn", lambda *a, **k: None)
    monkeypatch.setattr(limits.torch, "empty", lambda *a, **k: None)
    flops = limits.matmul_flops_per_s(dev, "float16")
    assert flops == pytest.approx(2 * 8192**3 / 0.05e-3)  # at n = 8192, the warm 0.05 ms per product
    assert min(dev.intervals[-limits.ROUNDS:]) >= limits.TARGET_MS


PAGES_SCRIPT = """
import json, sys, torch
from diffusers.models.attention_processor import Attention
from profiler import devices
from profiler.attention import backends
from profiler.measure.probes import CallTimer
attn, x = Attention(query_dim=32, heads=4, dim_head=8).eval(), torch.randn(1, 4096, 32)
timer = CallTimer(devices.get("cpu"), faults=True)
with torch.no_grad():
    for name in sys.argv[1:]:
        attn.set_processor(backends.make_processor(name))
        attn(x)  # the first call of a processor, outside the count
        timer({"call_index": name}, lambda: attn(x))
print(json.dumps(timer.faulted))
"""


def test_the_new_pages_a_call_gets_in_a_process_left_as_it_is_are_the_models():
    """One self-attention call of 4096 tokens, 4 heads of 8, in float32, in a fresh process whose memory is left as
    a user's is (glibc maps every allocation of 32 MiB and up anew): the new pages counted during it are those of
    memory.new_page_bytes: naive's two 256 MiB tables, sliced's two 64 MiB tables a head, split's and subquad's one
    64 MiB table a chunk (their softmax in place; two a chunk said twice what subquad's calls were counted to get in
    a recorded generation). Q, K, V and the outputs (512 KiB each) may add a few MiB."""
    import subprocess
    import sys

    names = ["naive", "sliced", "split", "subquad"]
    done = subprocess.run([sys.executable, "-c", PAGES_SCRIPT, *names], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    counted = json.loads(done.stdout.strip().splitlines()[-1])
    row = {"batch": 1, "heads": 4, "head_dim": 8, "tokens_q": 4096, "tokens_k": 4096, "score_elements": 4 * 4096**2,
           "score_bytes": 4 * 4096**2 * 4, "flops": 4 * 4 * 4096**2 * 8, "upcast": ""}
    want = {n: memory.new_page_bytes(n, row, "float32", 32 * 2**20, **backends.BACKENDS[n].options) for n in names}
    assert want == {"naive": 2**29, "sliced": 2**29, "split": 2**28, "subquad": 2**28}
    for n in names:
        assert want[n] <= counted[n] < want[n] + 16 * 2**20, (n, counted[n] / 2**20)


class LaunchBoundDevice(FakeDevice):
    """A GPU behind a slow host (the H200's): looped one launch after another in one interval, each run takes the
    host's `launch` ms (the GPU idles between), while replayed from a CUDA graph (devices.Cuda.replay_ms) each takes
    its kernel's `ms`. Its L2-sized copy: 7.5 MiB in 11.6 us a launch (the audit's 1.35e12 B/s), 2.5 us a kernel."""

    kernel_clock = True

    def __init__(self, ms: float, launch: float):
        super().__init__(ms)
        self.launch, self.replays = launch, []

    def work(self):
        self.now += self.launch

    def replay_ms(self, fn, times, rounds=5):
        self.replays.append(times)
        return [self.ms] * rounds


def test_the_small_figures_are_rates_from_replays_not_a_cost_per_launch():
    """Timed as the large ones are (a loop in one interval), the cache's copy reads the host's cost per launch; from
    replays it reads the kernel's, and each replay holds at least LAUNCHES runs."""
    dev = LaunchBoundDevice(ms=0.0025, launch=0.0116)
    assert limits._best_ms(dev, dev.work) == pytest.approx(0.0116)  # what the H200's limits stored: per launch
    assert limits._replayed_ms(dev, dev.work) == pytest.approx(0.0025)
    assert dev.replays and min(dev.replays) >= limits.LAUNCHES and max(dev.replays) <= limits.MAX_LAUNCHES


def test_a_slow_small_figure_on_the_cpu_is_timed_over_target_ms_not_launches_runs():
    """The CPU has no launch to spread: a run of 22 ms (float16's score GEMMs, emulated there) is replayed for
    TARGET_MS of work an interval (5 runs), not LAUNCHES (4.4 s an interval: 18 s of a first float16 plan)."""
    dev = LaunchBoundDevice(ms=22.0, launch=22.0)
    dev.kernel_clock = False
    assert limits._replayed_ms(dev, dev.work) == pytest.approx(22.0)
    assert dev.replays == [math.ceil(limits.TARGET_MS / 22.0)]


def test_softmax_score_gemms_and_the_caches_copy_go_through_the_devices_replay(monkeypatch):
    """On the CPU too (its replay_ms is a host-clock loop, the same physics as before): each small figure is timed by
    devices.replay_ms and comes out a rate (elements or bytes a second, not zero); how many runs an interval holds
    there is test_a_slow_small_figure_on_the_cpu_is_timed_over_target_ms_not_launches_runs's."""
    from profiler import devices

    seen = []
    real = devices.Cpu.replay_ms

    def spy(self, fn, times, rounds=5, **kw):
        seen.append(times)
        return real(self, fn, times, rounds, **kw)

    monkeypatch.setattr(devices.Cpu, "replay_ms", spy)
    monkeypatch.setattr(limits, "TARGET_MS", 5.0)
    monkeypatch.setattr(limits, "WARM_MS", 5.0)
    dev = devices.get("cpu")
    assert limits.softmax_per_s(dev, "float32") > 1e6 and limits.score_gemm_per_s(dev, "float32") > 1e6
    assert limits.copy_bytes_per_s(dev, 2**20, replayed=True) > 1e8
    assert len(seen) == 3


def test_a_process_that_lacks_the_limits_waits_for_the_one_measuring_them_and_reads_what_it_stored(tmp_path,
                                                                                                    monkeypatch):
    """Two processes (two sweeps, or a suite's workers) asking at once for limits the cache lacks: the second waits on
    the cache's lock while the first measures, then reads the figures the first stored and measures nothing (two
    measuring at once would each time a machine the other keeps busy)."""
    import threading

    from profiler.store import cache_lock

    monkeypatch.setenv("ATTNPROF_CACHE", str(tmp_path))
    path, key = limits.cache_path(), limits.device_key("cpu")
    stored = {"flops": {"float32": 1.5e9}, "softmax_per_s": {"float32": 2.5e8}, "score_gemm_per_s": {"float32": 3.5e8},
              "bytes_per_s": 4.5e9, "cache_bytes": 0, "cache_bytes_per_s": None, "fresh_bytes_per_s": None,
              "launch_us": 5.5, "replayed": True, "measured_at": "2026-12-05T12:00:00+00:00"}
    got = {}
    with cache_lock(path):  # the first process, measuring
        second = threading.Thread(target=lambda: got.update(limits.device_limits("cpu", ["float32"])))
        second.start()
        second.join(1.0)
        assert second.is_alive() and not got  # waiting on the lock
        path.write_text(json.dumps({key: stored}))  # what the first stored as it ended
    second.join(120)
    assert got["device_peak_flops"] == {"float32": 1.5e9} and got["device_launch_us"] == 5.5
    assert json.loads(path.read_text()) == {key: stored}  # nothing measured, nothing added


def test_a_cache_bandwidth_below_the_memorys_is_refused_in_one_line(tmp_path, monkeypatch):
    """The H200 run's limits (its manifest: memory 4.24e12 B/s, its 60 MiB L2's copy 1.35e12 B/s, a cost per launch):
    the cache figure is refused with one line, and the time model prices every op at the memory's bandwidth."""
    from profiler.planner.timing import Device

    entry = {"bytes_per_s": 4.2408e12, "cache_bytes": 62914560, "cache_bytes_per_s": 1.3527e12}
    lines = limits.refused_lines(entry)
    assert len(lines) == 1 and "below the memory's" in lines[0] and "1.35e+12" in lines[0]
    assert limits.refused_lines({**entry, "cache_bytes_per_s": 8e12}) == []
    h200 = {"device_peak_flops": {"float16": 6.458e14}, "device_peak_bytes_per_s": 4.2408e12,
            "device_memory": {"cache_bytes": 62914560, "cache_bytes_per_s": 1.3527e12}}
    d = Device.of(h200, "float16")
    assert d.cache_bandwidth is None and float(d.moved_ms(1e6, 1e6)) == pytest.approx(1e6 / 4.2408e12 * 1e3)
    # a cache entry that holds such a figure: device_limits says so and hands on no cache bandwidth
    monkeypatch.setenv("ATTNPROF_CACHE", str(tmp_path))
    got = limits.device_limits("cpu", ["float32"])
    path = tmp_path / "device-limits.json"
    (key, stored), = json.loads(path.read_text()).items()
    assert stored["replayed"] and stored["launch_us"] == got["device_launch_us"] > 0
    # what this (shared, maybe busy) CPU measured decides its own verdict; the verdicts below are set by hand
    assert got["device_limits"]["refused"] == limits.refused_lines(stored)
    path.write_text(json.dumps({key: {**stored, "cache_bytes_per_s": stored["bytes_per_s"] * 3}}))
    fast = limits.device_limits("cpu", ["float32"])
    assert fast["device_limits"]["refused"] == [] and Device.of(fast, "float32").cache_bandwidth is not None
    path.write_text(json.dumps({key: {**stored, "cache_bytes_per_s": stored["bytes_per_s"] / 3}}))
    again = limits.device_limits("cpu", ["float32"])
    assert len(again["device_limits"]["refused"]) == 1 and Device.of(again, "float32").cache_bandwidth is None
    assert again["device_memory"]["cache_bytes_per_s"] == stored["bytes_per_s"] / 3  # as measured, for the record
