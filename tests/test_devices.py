"""CPU tests that catch GPU bugs: the meta device (cross-device writes fail there as on CUDA), CUDA calls checked for
the cell's device, NVML found by UUID / PCI bus id in a faked NVML module, GPU kernels credited by correlation id,
allocation failures of every form. Where a GPU is needed, tests/test_gpu.py (pytest -m gpu)."""
import json
import os
import platform
import re
import types

import pytest
import torch

from profiler import devices
from profiler.attention import kernel_choice
from profiler.unet import models
from profiler.measure.probes import NvmlSampler
from profiler.measure.trace import Event as Ev, attribute, sdpa_kernel

GiB = 2**30


@pytest.mark.parametrize("name", sorted(models.known_models()))
def test_every_registry_model_builds_with_random_weights_on_meta(name):
    """On meta, as on CUDA, a CPU tensor written into a device parameter fails: the random init must stay on the
    parameters' device."""
    unet = models.build(name, weights="random", device="meta", dtype="float16")
    assert {p.device.type for p in unet.parameters()} == {"meta"}
    assert {p.dtype for p in unet.parameters()} == {torch.float16}


def test_random_weights_are_the_same_in_every_dtype(tiny_sd15):
    half = models.build("tiny-sd15", weights="random", dtype="float16")
    for (name, a), (_, b) in zip(tiny_sd15.named_parameters(), half.named_parameters(), strict=True):
        assert torch.equal(a.half(), b), name  # rounded once from the same float32 product


@pytest.mark.parametrize("exc, expected", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.16 GiB. GPU 0 has 1.0 GiB free."),
     "OutOfMemoryError: CUDA out of memory. Tried to allocate 3.16 GiB. GPU 0 has 1.0 GiB free."),
    (RuntimeError("CUDA out of memory. Tried to allocate 3.16 GiB"),
     "RuntimeError: CUDA out of memory. Tried to allocate 3.16 GiB"),
    (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
     "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    (RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED\nTried to allocate 512.00 MiB"),
     "RuntimeError: cuDNN error: CUDNN_STATUS_ALLOC_FAILED (tried to allocate 512.00 MiB)"),
    (RuntimeError("expected scalar type Half but found Float"), None),
    (ValueError("out of memory"), None),  # not an allocation failure's type
])
def test_every_form_of_allocation_failure_is_an_oom(exc, expected):
    assert devices.oom_message(exc) == expected


class _Recorder:
    """Stands in for torch.cuda's functions: records the device each is given."""

    def __init__(self, monkeypatch, reserved=(0,)):
        self.calls, self._reserved = [], iter(reserved)
        for name in ("synchronize", "reset_peak_memory_stats", "memory_allocated", "max_memory_allocated",
                     "current_stream"):
            monkeypatch.setattr(torch.cuda, name, self._fn(name))
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", self._fn("max_memory_reserved", self._reserved))
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: self.calls.append(("empty_cache", None)))
        monkeypatch.setattr(torch.cuda, "device", lambda d: self.calls.append(("device", d)) or _NullGuard())
        monkeypatch.setattr(torch.cuda, "Event", lambda **kw: types.SimpleNamespace(record=self._record))

    def _fn(self, name, values=None):
        def fn(device=None):
            self.calls.append((name, device))
            return next(values) if values else 7
        return fn

    def _record(self, stream):
        self.calls.append(("Event.record", stream))


class _NullGuard:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_every_cuda_call_names_the_cells_device(monkeypatch):
    fake = _Recorder(monkeypatch, reserved=iter([300, 100, 250]))
    dev = devices.get("cuda:1")
    with dev.guard():
        dev.begin_cell()
        dev.synchronize()
        dev.reset_peak()  # folds the reserved peak so far (300) in before the reset
        dev.allocated()
        dev.peak_allocated()
        interval = dev.interval()
        interval.start()
        interval.stop()
        reserved = dev.reserved_max()  # max(300, now 100): the cell's peak, not the last call's
        dev.release()
    assert reserved == 300
    cuda1 = torch.device("cuda", 1)
    named = [(name, d) for name, d in fake.calls if name not in ("empty_cache", "Event.record")]
    assert named and all(d == cuda1 for _, d in named), named
    assert [d for name, d in fake.calls if name == "Event.record"] == [7, 7]  # the stream current_stream(cuda:1) gave
    assert devices.get("cuda").torch == torch.device("cuda", 0)


def test_a_cuda_graph_is_captured_on_the_cells_device_even_outside_its_guard(monkeypatch):
    """torch.cuda.graph captures on the current device's stream: capture makes the cell's device current itself, so
    that a graph of cuda:1's forward is never captured on cuda:0 (the default device)."""
    fake = _Recorder(monkeypatch)
    current = []
    monkeypatch.setattr(torch.cuda, "device", lambda d: current.append(d) or _NullGuard())
    monkeypatch.setattr(torch.cuda, "Stream", lambda d: fake.calls.append(("Stream", d)) or
                        types.SimpleNamespace(wait_stream=lambda other: None))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: _NullGuard())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d: fake.calls.append(("current_stream", d)) or
                        types.SimpleNamespace(wait_stream=lambda other: None))
    graph = types.SimpleNamespace(replay=lambda: fake.calls.append(("replay", current[-1] if current else None)))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g: fake.calls.append(("graph", current[-1] if current else None))
                        or _NullGuard())
    fake.calls.clear()
    assert devices.get("cuda:1").capture(lambda: None) is graph
    cuda1 = torch.device("cuda", 1)
    named = [(name, d) for name, d in fake.calls if name != "Event.record"]
    assert ("graph", cuda1) in named and ("replay", cuda1) in named and all(d == cuda1 for _, d in named), named


def test_the_memory_snapshot_is_recorded_on_the_cells_device_and_stopped_after(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda enabled="all", device=None, **kw: calls.append(("record", enabled, device)))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: calls.append(("dump", path, None)))
    dev = devices.get("cuda:1")
    with dev.memory_history(tmp_path / "c.memory.pickle"):
        calls.append(("forward", None, None))
    cuda1 = torch.device("cuda", 1)
    assert calls == [("record", "all", cuda1), ("forward", None, None), ("dump", str(tmp_path / "c.memory.pickle"),
                                                                          None), ("record", None, cuda1)]
    with dev.memory_history(None):  # no --trace: nothing recorded
        pass
    assert len(calls) == 4 and dev.memory_snapshot and not devices.get("cpu").memory_snapshot


def test_reserved_peak_of_the_cell_survives_every_reset(monkeypatch):
    _Recorder(monkeypatch, reserved=iter([5 * GiB, 2 * GiB, 1 * GiB, 3 * GiB, 7]))
    dev = devices.get("cuda:0")
    dev.begin_cell()
    dev.reset_peak()  # 5 GiB before this reset
    dev.reset_peak()  # 2 GiB
    dev.reset_peak()  # 1 GiB
    assert dev.reserved_max() == 5 * GiB  # now 3 GiB
    dev.begin_cell()  # a new cell starts from zero
    assert dev.reserved_max() == 7


class FakeNvml:
    """pynvml's surface that devices and NvmlSampler use, over two GPUs; NVML numbers them the other way round."""

    class NVMLError(Exception):
        pass

    def __init__(self, pids=(), fail_after=None):
        self.gpus = {"GPU-bbbb": ("00000000:3B:00.0", 40 * GiB), "GPU-aaaa": ("00000000:AF:00.0", 10 * GiB)}
        self.pids, self.fail_after, self.reads = list(pids), fail_after, 0

    def nvmlDeviceGetHandleByUUID(self, uuid):
        if uuid not in self.gpus:
            raise self.NVMLError("Not Found")
        return uuid

    def nvmlDeviceGetHandleByPciBusId(self, bus):
        for uuid, (pci, _) in self.gpus.items():
            if pci == bus:
                return uuid
        raise self.NVMLError("Not Found")

    def nvmlDeviceGetMemoryInfo(self, handle):
        self.reads += 1
        if self.fail_after is not None and self.reads > self.fail_after:
            raise self.NVMLError("GPU is lost")
        return types.SimpleNamespace(used=self.gpus[handle][1], free=GiB, total=80 * GiB)

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return [types.SimpleNamespace(pid=pid, usedGpuMemory=GiB) for pid in self.pids]

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        return list(self.gpus)[index]

    def nvmlDeviceGetName(self, handle):
        return b"NVIDIA H200"


def _props(uuid, bus):
    return types.SimpleNamespace(uuid=uuid, pci_domain_id=0, pci_bus_id=bus, pci_device_id=0, name="Fake GPU",
                                 total_memory=80 * GiB)


def test_nvml_device_is_found_by_uuid_then_pci_bus_id_never_by_ordinal():
    nvml = FakeNvml()
    assert devices.nvml_handle(nvml, 0, _props("aaaa", 0xAF)) == "GPU-aaaa"  # NVML's index 1
    assert devices.nvml_handle(nvml, 0, _props("MIG-cccc", 0x3B)) == "GPU-bbbb"  # no such UUID: by PCI bus id
    with pytest.raises(LookupError, match="NVML has no device matching cuda:3"):
        devices.nvml_handle(nvml, 3, _props("dddd", 0x01))
    assert devices.pci_bus_id(_props("x", 0xAF)) == "00000000:AF:00.0"
    assert devices.nvml_uuids("aaaa") == ["GPU-aaaa", "MIG-aaaa"] and devices.nvml_uuids("MIG-x") == ["MIG-x"]


def _sampled(monkeypatch, nvml) -> dict:
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: _props("aaaa", 0xAF))
    with NvmlSampler(devices.get("cuda:0"), interval_s=0.001, nvml=nvml) as s:
        import time

        time.sleep(0.05)
    return s.result()


def test_nvml_sampler_reads_the_matched_device_and_this_process(monkeypatch):
    r = _sampled(monkeypatch, FakeNvml(pids=[os.getpid(), 1]))
    assert r["nvml_status"] == "ok" and r["nvml_samples"] >= 1
    assert r["nvml_device_used_max_bytes"] == 10 * GiB  # GPU-aaaa, not NVML's device 0
    assert r["nvml_process_used_max_bytes"] == GiB


def test_nvml_sampler_in_a_container_reports_process_memory_unknown(monkeypatch):
    r = _sampled(monkeypatch, FakeNvml(pids=[4242]))  # the host's pid of this process
    assert r["nvml_process_used_max_bytes"] is None
    assert r["nvml_status"].startswith("ok; process memory unknown")


def test_an_nvml_error_in_the_sampler_thread_is_reported(monkeypatch):
    r = _sampled(monkeypatch, FakeNvml(pids=[os.getpid()], fail_after=2))
    assert r["nvml_status"] == "error after 2 samples: NVMLError: GPU is lost"
    assert r["nvml_samples"] == 2 and r["nvml_device_used_max_bytes"] == 10 * GiB


B0, B1 = (f"down_blocks.0.attentions.0.transformer_blocks.0.attn{i}" for i in (1, 2))
CALLS = {B0: 0, B1: 1}  # each call's range, named by its block path (probes.CallProbe)


def test_gpu_kernels_are_credited_to_the_call_that_launched_them():
    """Call 0 launches a flash kernel that runs on the GPU during call 1's window (GPU work is asynchronous); call 1
    launches a mem-efficient kernel that runs after both windows."""
    events = [
        Ev(B0, 100, 200), Ev(B1, 200, 300),
        Ev("gpu_user_annotation", 0, 10**6, device="cuda", linked=0),  # kineto's GPU twin of a range: not a window
        Ev("aten::_scaled_dot_product_flash_attention", 110, 150, corr=11),
        Ev("aten::_scaled_dot_product_efficient_attention", 210, 250, corr=12),
        Ev("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>(Flash_fwd_params)", 220, 280,
           device="cuda", corr=901, linked=11),
        Ev("fmha_cutlassF_f16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<>::Params)", 400, 500,
           device="cuda", corr=902, linked=12),
    ]
    per_call, _ = attribute(events, CALLS)
    assert per_call[0]["kernel"] == "aten::_scaled_dot_product_flash_attention,pytorch_flash::flash_fwd_kernel"
    assert per_call[1]["kernel"] == ("aten::_scaled_dot_product_efficient_attention,"
                                     "fmha_cutlassF_f16_aligned_64x64_rf_sm80")


# GPU kernel names as public profiles show them (H100 / A100 / B200), and the SDPA kernel each belongs to
KERNEL_NAMES = [
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_kernel0_0", "cudnn"),
    ("cudnn_generated_fort_native_sdpa_sm80_flash_fprop_wmma_f16_knob_3_64x64x128_4x1x1_kernel0_0", "cudnn"),
    ("cudnn_generated_fort_native_sdpa_sm100_flash_fprop_f16_knob_1", "cudnn"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, cutlass::half_t, "
     "Flash_kernel_traits<64, 128, 128, 4, cutlass::half_t>>, false, false, false, false, true, true, false>"
     "(pytorch_flash::Flash_fwd_params)", "flash"),
    ("fmha_cutlassF_f16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::half_t, "
     "cutlass::arch::Sm80, true, 64, 128, 128, true, true>::Params)", "efficient"),
    ("void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t>, false, "
     "false, false, false, true, true, false, false>(Flash_fwd_params)", "flash"),
    ("void flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<64, 64, 256, 4, false, false, cutlass::half_t>, false, "
     "false, false, false, true, false, true, false>(Flash_fwd_params)", "flash"),
    ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<flash::CollectiveMainloopFwdSm90"
     "<2, cute::tuple<cute::C<1>, cute::C<1>, cute::C<1>>>>>>(flash::FlashAttnFwdSm90<>::Params)", "flash"),
    ("void (anonymous namespace)::cunn_SoftMaxForward<8, c10::Half, float, c10::Half, "
     "(anonymous namespace)::SoftMaxForwardEpilogue>(c10::Half*, c10::Half const*, int)", "math"),
    ("void at::native::(anonymous namespace)::softmax_warp_forward<float, float, float, 10, false, false>(float*, "
     "float const*, int, int, int, bool const*, int, bool)", "math"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "flash"),
    ("aten::_scaled_dot_product_attention_math", "math"),
    ("aten::_scaled_dot_product_cudnn_attention", "cudnn"),
    ("aten::_scaled_dot_product_efficient_attention", "efficient"),
    ("sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__"
     "5x_cublas", None),
    ("ampere_fp16_s16816gemm_fp16_128x128_ldg8_f2f_stages_32x5_tn", None),
    ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor"
     "<c10::Half, c10::Half, c10::Half, at::native::binary_internal::MulFunctor<float>>>>(int, T3)", None),
]


@pytest.mark.parametrize("name, kernel", KERNEL_NAMES, ids=[k[0][:48] for k in KERNEL_NAMES])
def test_sdpa_kernel_names_each_kernel_and_never_takes_cudnn_for_flash(name, kernel):
    assert sdpa_kernel([name]) == kernel
    # within one call: a fused kernel wins over the gemms and elementwise kernels of the projections around it
    assert sdpa_kernel([KERNEL_NAMES[-2][0], name, KERNEL_NAMES[-1][0]]) == kernel


def test_the_fused_kernel_names_the_call_even_beside_a_softmax_elsewhere_in_it():
    assert sdpa_kernel(["cunn_SoftMaxForward", KERNEL_NAMES[0][0]]) == "cudnn"
    assert sdpa_kernel([]) is None


def test_only_gpu_kernels_name_a_calls_gpu_kernels_and_their_time():
    """A CPU op named like an extension (xformers::, flash_attn::) is no GPU kernel: a call that launched none has
    no gpu_kernels, and its GPU time sums only what ran on the GPU."""
    events = [
        Ev(B0, 100, 200), Ev(B1, 200, 300),
        Ev("xformers::efficient_attention_forward_cutlass", 110, 190, corr=0),
        Ev("flash_attn::_flash_attn_forward", 210, 220, corr=0),
        Ev("aten::_scaled_dot_product_cudnn_attention", 230, 240, corr=13),
        Ev("aten::mm", 250, 260, corr=14),
        Ev(KERNEL_NAMES[0][0], 400, 2400, device="cuda", corr=903, linked=13),  # 2 us
        Ev("sm90_xmma_gemm_f16f16_f16f32_f32_tn_n", 2500, 3500, device="cuda", corr=904, linked=14),  # 1 us
    ]
    per_call, _ = attribute(events, CALLS)
    assert per_call[0]["gpu_kernels"] == [] and per_call[0]["gpu_time_ms"] is None
    assert per_call[1]["gpu_kernels"] == [KERNEL_NAMES[0][0]] and per_call[1]["sdpa_kernel"] == "cudnn"
    assert per_call[1]["gpu_time_ms"] == pytest.approx(0.003)  # both of its kernels, the gemm too
    cpu = attribute([Ev(B0, 0, 10), Ev("aten::_scaled_dot_product_flash_attention_for_cpu", 1, 9)],
                    CALLS)[0]
    assert cpu[0]["sdpa_kernel"] == "flash" and cpu[0]["gpu_time_ms"] is None


def test_the_planner_follows_pytorchs_sdpa_priority_for_the_gpu_it_plans_for():
    """sm90 with a cuDNN past 9.15: cuDNN at every SD head dim (it takes up to 256 there from cuDNN 9.10); float32:
    mem-efficient; Ampere and Ada: flash; Turing: mem-efficient (no flash before sm80); the deprioritizing variable
    and an older cuDNN put flash first. The rule itself (sdpa_rule): on a GPU box whose process holds a CUDA context,
    sdpa_choice would ask that GPU instead."""
    h100 = kernel_choice.GpuTarget("H100", (9, 0), 91501, 13, False)
    assert [kernel_choice.sdpa_rule("float16", d, 77, h100) for d in (40, 64, 80, 160)] == \
        ["cudnn", "cudnn", "cudnn", "cudnn"]
    assert kernel_choice.sdpa_rule("float32", 40, 77, h100) == "efficient"
    assert kernel_choice.sdpa_rule("float16", 160, 77, kernel_choice.GpuTarget("H100", (9, 0), 92300, 13, False)) \
        == "cudnn"
    assert kernel_choice.sdpa_can_use("cudnn", "float16", 160, 77, kernel_choice.GpuTarget("A100", (8, 0), 92300, 13, False)) \
        is False  # beyond 128 only on sm90 / sm10x
    assert kernel_choice.sdpa_can_use("cudnn", "float16", 160, 77, kernel_choice.GpuTarget("H100", (9, 0), 90900, 13, False)) \
        is False  # and only from cuDNN 9.10
    assert kernel_choice.sdpa_rule("float16", 40, 77, kernel_choice.GpuTarget("H100", (9, 0), 91400, 13, False)) \
        == "flash"
    for arch, want in (("sm80", "flash"), ("8.9", "flash"), ("sm_75", "efficient"), ("sm120", "flash")):
        assert kernel_choice.sdpa_choice("float16", 40, 77, "cuda", kernel_choice.gpu_target(arch)) == want, arch
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")
        assert kernel_choice.sdpa_rule("float16", 40, 77, h100) == "flash"
    assert kernel_choice.sdpa_choice("float16", 40, 77, "cpu") == "flash"  # asked of PyTorch


def test_the_plan_of_sdpa_on_cuda_names_each_calls_kernel_and_the_gpu(capsys):
    from profiler.cli import main

    assert main(["plan", "--model", "sd15", "--size", "512x512", "--backend", "sdpa", "--gpu-arch", "sm90",
                 "--json"]) == 0
    p = json.loads(capsys.readouterr().out)[0]
    assert {(b["head_dim"], b["sdpa_kernel"]) for b in p["blocks"]} == {(40, "cudnn"), (80, "cudnn"), (160, "cudnn")}
    assert "sm90" in p["totals"]["gpu"] and "cudnn for 32 calls" in p["totals"]["forward_method"]
    assert main(["plan", "--model", "sd15", "--backend", "sdpa", "--gpu-arch", "volta"]) == 2
    assert "--gpu-arch 'volta' is not a compute capability" in capsys.readouterr().err


def test_where_a_cuda_context_exists_pytorch_is_asked_and_the_rule_kept_beside(monkeypatch):
    """In a worker (a CUDA context exists) the planner's choice is PyTorch's answer on the device, not the rule; a
    target assumed with --gpu-arch still follows the rule. A cell records each call's answer and the rule's, and
    the shapes where they differ (here: PyTorch picks flash at head_dim 160 where the rule names cuDNN)."""
    from profiler.measure.cell import sdpa_choices
    from profiler.spec import CellSpec

    asked = lambda dtype, head_dim, tokens_k, device: "flash" if head_dim == 160 else "cudnn"  # noqa: E731
    monkeypatch.setattr(kernel_choice, "asked_sdpa_choice", asked)
    monkeypatch.setattr(devices, "primary_context_active", lambda index=0: True)
    h200 = kernel_choice.GpuTarget("NVIDIA H200", (9, 0), 91501, 13, False)
    asked_for = []
    monkeypatch.setattr(kernel_choice, "gpu_target", lambda arch=None, index=0: asked_for.append(index) or h200)
    assert kernel_choice.sdpa_choice("float16", 160, 77, "cuda", h200) == "flash"  # asked
    assert kernel_choice.sdpa_choice("float16", 160, 77, "cuda", kernel_choice.GpuTarget("x", (9, 0), None, 13, True)) == "cudnn"
    blocks = [{"head_dim": 40, "tokens_k": 4096}, {"head_dim": 160, "tokens_k": 64}]
    cell = sdpa_choices(CellSpec("sd15", 512, 512, 1, "float16", "sdpa", "cuda"), blocks)
    assert [(b["sdpa_kernel_asked"], b["sdpa_kernel_rule"]) for b in blocks] == [("cudnn", "cudnn"),
                                                                                 ("flash", "cudnn")]
    assert cell == {"sdpa_rule_differs": "head_dim 160 tokens_k 64: torch flash, rule cudnn"}
    sdpa_choices(CellSpec("sd15", 512, 512, 1, "float16", "sdpa", "cuda:1"), blocks)
    assert asked_for[-2:] == [0, 1]  # the rule of the cell's own GPU: cuda:1's, not device 0's
    assert sdpa_choices(CellSpec("sd15", 512, 512, 1, "float16", "sdpa-flash", "cuda"), blocks) == {}  # forced
    assert sdpa_choices(CellSpec("sd15", 512, 512, 1, "float16", "sdpa", "cpu"), blocks) == {}  # no rule there
    assert [b["sdpa_kernel_asked"] for b in blocks] == ["cudnn", "flash"]  # but asked on the CPU too


_HEAP = """
import ctypes, sys
import torch
from profiler import devices
from profiler.attention import kernel_choice

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
if sys.argv[1] == "kept":  # a process of ours that times cells
    devices.keep_memory()
if sys.argv[1] == "profiled":  # a user's own, a generation profiled in it
    from diffusers.models.attention_processor import Attention
    import profiler

    attn = Attention(query_dim=32, heads=2, dim_head=16)
    with torch.no_grad(), profiler.profile(attn, out=None):
        attn(torch.randn(1, 16, 32))
before = libc.mallinfo2()  # what was mapped and in the heap before (torch's own, at import)
x = torch.ones(64 * 2**20 // 4)  # a 64 MiB table: glibc left as it is maps it anew, every time
mapped = libc.mallinfo2().hblkhd - before.hblkhd
del x
print(mapped, libc.mallinfo2().arena - before.arena, int(devices.get("cpu").memory_kept))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_our_processes_keep_their_memory_and_a_users_generation_is_left_as_it_is():
    """A process of ours that times cells keeps its memory (devices.keep_memory): a 64 MiB table comes from the heap,
    not a mapping of its own, and stays with the process when freed, so that the next cell's tables reuse it,
    whatever ran before. A user's own process, a generation profiled in it, is left as it is: glibc maps the table
    anew (and unmaps it when freed), as it does when the user runs it without us."""
    import subprocess
    import sys

    def heap(mode):
        out = subprocess.run([sys.executable, "-c", _HEAP, mode], capture_output=True, text=True, check=True)
        return [int(v) for v in out.stdout.split()]

    mapped, kept, flag = heap("kept")
    assert mapped == 0 and kept > 48 * 2**20 and flag == 1  # in the heap (less what it held free), kept when freed
    for mode in ("left", "profiled"):
        mapped, kept, flag = heap(mode)
        assert mapped >= 64 * 2**20 and kept < 16 * 2**20 and flag == 0, mode
    from profiler.measure.limits import device_key

    assert device_key("cpu", kept=True).endswith(" | memory kept")  # two machines to the time model
    assert "memory kept" not in device_key("cpu", kept=False)


class FakeNvtx:
    """NVTX's calls (devices.NVTX's seam) recorded as a tree: `ranges` holds (name, children) per range."""

    def __init__(self):
        self.ranges: list = []
        self.open = [self.ranges]

    def range_push(self, name: str) -> int:
        self.open[-1].append((name, []))
        self.open.append(self.open[-1][-1][1])
        return len(self.open) - 2

    def range_pop(self) -> int:
        assert len(self.open) > 1, "a pop with no range open"
        self.open.pop()
        return len(self.open) - 1

    def range(self, message: str, *args):
        import contextlib

        @contextlib.contextmanager
        def ranged():
            self.range_push(message.format(*args))
            try:
                yield
            finally:
                self.range_pop()
        return ranged()


def nvtx_on(monkeypatch) -> FakeNvtx:
    """NVTX ranges on (ATTNPROF_NVTX=1, as --nvtx sets it) into a FakeNvtx: a CUDA build's NVTX, on any machine."""
    fake = FakeNvtx()
    monkeypatch.setattr(devices, "NVTX", fake)
    monkeypatch.setenv(devices.NVTX_ENV, "1")
    return fake


def test_nvtx_ranges_are_on_where_asked_or_under_nsys_and_refused_on_a_torch_without_nvtx(monkeypatch, capsys):
    """Off by default: devices.nvtx() is None (no call made, on the CPU build as on a CUDA one); on with
    ATTNPROF_NVTX=1 (what --nvtx sets for the command, and puts back after) or under Nsight Systems
    (NSYS_PROFILING_SESSION_ID); where torch has no NVTX (a CPU build) --nvtx is one line and exit 2, for run and
    record alike, and nsys's variable turns nothing on."""
    from profiler.cli import main

    fake = FakeNvtx()
    monkeypatch.setattr(devices, "NVTX", fake)
    monkeypatch.delenv(devices.NVTX_ENV, raising=False)
    monkeypatch.delenv("NSYS_PROFILING_SESSION_ID", raising=False)
    assert devices.nvtx() is None
    with devices.nvtx_range("cell"):
        pass
    assert fake.ranges == []
    with devices.nvtx_ranges():
        assert os.environ[devices.NVTX_ENV] == "1" and devices.nvtx() is fake
        with devices.nvtx_range("a {cell}"):
            pass
    assert devices.NVTX_ENV not in os.environ and fake.ranges == [("a {cell}", [])]
    monkeypatch.setenv("NSYS_PROFILING_SESSION_ID", "7")
    assert devices.nvtx() is fake
    monkeypatch.setattr(devices, "NVTX", None)
    assert devices.nvtx() is None
    for argv in (["run", "--model", "tiny-sd15", "--size", "64x64", "--nvtx"], ["record", "--nvtx", "--", "x.py"]):
        assert main(argv) == 2
        assert capsys.readouterr().err == f"attnprof: error: --nvtx: this torch ({torch.__version__}) has no NVTX, a " \
            "CPU build: install a CUDA build of torch for Nsight Systems' ranges, or leave --nvtx out\n"
    assert devices.NVTX_ENV not in os.environ


def test_run_with_nvtx_ranges_each_cell_its_steps_and_their_blocks(monkeypatch, tmp_path, capsys):
    """attnprof run --nvtx (in process, NVTX injected): a range per cell named by its shape and backend (and one for
    the preflight's planned forward, one for the fp32 reference forward), inside it a `step N` range per hooked
    forward, inside each one range per attention call named by its block path (32 for tiny-sd15, each once per
    step, in the order they ran), no range left open; the environment as it was after."""
    from profiler.attention.recorder import attention_modules
    from profiler.cli import main

    fake = nvtx_on(monkeypatch)
    monkeypatch.delenv(devices.NVTX_ENV)
    assert main(["run", "--model", "tiny-sd15", "--size", "64x64", "--backend", "sdpa", "--device", "cpu", "--dtype",
                 "float32", "--repeats", "1", "--warmup", "0", "--in-process", "--quiet", "--nvtx",
                 "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    assert fake.open == [fake.ranges] and devices.NVTX_ENV not in os.environ
    assert [name for name, _ in fake.ranges][:3] == ["preflight: each cell's memory planned (fake tensors)",
                                                     "tiny-sd15 64x64 batch 1 reference (sdpa, float32)",
                                                     "tiny-sd15 64x64 batch 1 float32 sdpa"]
    assert {name for name, _ in fake.ranges[2:]} == {"tiny-sd15 64x64 batch 1 float32 sdpa"}
    steps = [s for _, inside in fake.ranges[1:] for s in inside]
    blocks = list(attention_modules(models.build("tiny-sd15", device="meta")))
    assert steps and all(re.fullmatch(r"step \d+", name) for name, _ in steps)
    for _, calls in steps:
        assert len(calls) == 32 and sorted(name for name, _ in calls) == sorted(blocks)
        assert all(inside == [] for _, inside in calls)
    assert len({tuple(name for name, _ in calls) for _, calls in steps}) == 1  # the same order in every step
