import pytest
import torch

from profiler import devices
from profiler.measure.probes import CallTimer, NvmlSampler, cpu_peak_bytes, summarize
from tests.rss import fresh_process_peak_rss

MiB = 2**20

# One naive attention call (diffusers AttnProcessor) with 8 heads and 4096 tokens in fp32: two 512 MiB score
# tables are alive at once (scores and their softmax).
CALL = """
import torch
from diffusers.models.attention_processor import Attention, AttnProcessor
torch.manual_seed(0)
attn = Attention(query_dim=64, heads=8, dim_head=8, processor=AttnProcessor())
x = torch.randn(1, 4096, 64)
def call():
    with torch.no_grad():
        return attn(x)
"""


def test_summarize_median_iqr_and_noisy_flag():
    steady = summarize([10.0, 10.2, 9.9, 10.1, 10.0])
    assert steady["time_ms"] == 10.0 and not steady["noisy"]
    jumpy = summarize([10.0, 14.0, 9.0, 13.0, 10.0])
    assert jumpy["time_ms"] == 10.0 and jumpy["noisy"] and jumpy["iqr_ms"] == pytest.approx(3.0)


def test_cpu_timer_uses_the_injected_clock():
    ticks = iter([0.0, 0.004, 1.0, 1.0025])
    timer = CallTimer(devices.get("cpu"), clock=lambda: next(ticks))
    timer({"call_index": 3}, lambda: None)
    timer({"call_index": 3}, lambda: None)
    assert timer.samples == {}  # read after the forward, as CUDA events must be
    timer.collect()
    assert timer.samples[3] == pytest.approx([4.0, 2.5])


def test_a_calls_new_pages_are_counted_on_the_cpu_and_not_on_cuda():
    """A call that touches 64 MiB of memory the kernel maps anew (an anonymous mmap, new pages whatever the
    allocator's thresholds) is counted 64 MiB; one that touches nothing new, next to nothing. CUDA counts none."""
    import mmap

    timer, size = CallTimer(devices.get("cpu"), faults=True), 64 * MiB

    def touch():
        with mmap.mmap(-1, size) as m:
            for offset in range(0, size, 4096):
                m[offset] = 1

    timer({"call_index": 0}, touch)
    timer({"call_index": 1}, lambda: sum(range(1000)))
    assert size <= timer.faulted[0] < size + 8 * MiB and timer.faulted[1] < MiB
    assert devices.Cuda.faulted_bytes(None) is None and not CallTimer(devices.get("cpu")).faulted


def test_cpu_memory_method_agrees_with_a_fresh_process_max_rss():
    scope = {}
    exec(CALL, scope)
    scope["call"]()  # warm up lazy initialisation outside the measurement
    _, traced = cpu_peak_bytes(scope["call"])
    rss = fresh_process_peak_rss(CALL)
    assert 1000 * MiB < traced < 1100 * MiB, traced / MiB  # two 512 MiB tables, not one
    assert abs(traced - rss) / rss < 0.05, (traced / MiB, rss / MiB)


def test_nvml_is_recorded_unavailable_without_a_driver():
    where = [devices.get("cpu")] + ([] if torch.cuda.is_available() else [devices.get("cuda")])  # no driver here
    for device in where:
        with NvmlSampler(device) as s:
            pass
        result = s.result()
        assert result["nvml_status"].startswith("unavailable: ")
        assert result["nvml_device_used_max_bytes"] is None


def test_no_garbage_collection_lands_inside_a_timed_forward():
    """Python's cyclic collector is off during every forward of a cell (warm-up and timed) and on again after: the
    collection that a probe pass's leftovers set off otherwise lands in a later forward (tiny-sd15 at 256x256 here:
    87 ms a forward, 130 ms with it). A cycle left before is still collected, after them."""
    import gc
    import weakref

    from profiler.measure.rows import timed_forwards

    class Cycle:
        pass

    seen = []

    class Work:
        def forward(self, unet, inputs):
            seen.append(gc.isenabled())
            return torch.zeros(1)

    def litter():
        c = Cycle()
        c.me = c  # freed only by the cyclic collector
        return weakref.ref(c)

    garbage = litter()
    timed_forwards(Work(), None, None, devices.get("cpu"), warmup=1, repeats=2)
    assert seen == [False] * 3 and gc.isenabled()
    gc.collect()
    assert garbage() is None
