"""The backends of profiler/attention/fused.py: diffusers' dispatcher (diffusers:<name>), compiled FlexAttention (flex),
SageAttention (sage) and FlashAttention 3 (flash-attn-3): their answers, availability with reasons, memory models
against fake-tensor traces and CPU measurements at SD's real head dims, and flex's compile time kept apart.
Tests that compile flex (about 20 s for the first shape of a process here, 4 s for each next) are marked slow."""
import pandas as pd
import pytest
import torch
from diffusers.models.attention_processor import Attention

from profiler.attention import backends, fused
from profiler.execute.grid import Sweep
from profiler.execute.sweep import execute
from profiler.measure.probes import cpu_peak_bytes
from profiler.planner import memory, plan
from profiler.planner.forward import trace
from profiler.attention.recorder import describe_call
from profiler.store import Run
from tests.test_backends import case

MiB = 2**20
DISPATCHER_ON_CPU = ["diffusers:native", "diffusers:_native_math"]


@pytest.fixture
def eager_flex(monkeypatch):
    """flex's processor with FlexAttention uncompiled: its wiring (layouts, block mask, mask as score_mod) without
    the compile."""
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(fused, "compiled_flex", lambda: flex_attention)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("kind", ["self", "cross"])
@pytest.mark.parametrize("name", DISPATCHER_ON_CPU + ["flex"])
def test_new_backends_match_the_float64_reference(name, kind, dtype, tol, eager_flex):
    attn, x, ctx, refs = case(kind, dtype)
    for mask, want in refs:
        with torch.no_grad():
            got = backends.make_processor(name)(attn, x, ctx, mask)
        assert got.dtype == dtype and got.shape == want.shape
        err = (got.double() - want).abs().max().item() / want.abs().max().item()
        assert err < tol, f"{name} {kind} {dtype} mask={mask is not None}: relative error {err:.2e}"


def test_the_full_block_mask_covers_every_block_and_is_built_once_per_shape():
    mask = fused.full_block_mask(300, 77, "cpu")
    assert mask.full_kv_num_blocks.tolist() == [[[1, 1, 1]]] and mask.kv_num_blocks.sum() == 0
    assert mask.seq_lengths == (300, 77) and mask.BLOCK_SIZE == (128, 128)
    assert fused.full_block_mask(300, 77, "cpu") is mask


def test_every_dispatcher_backend_is_available_or_says_why_on_the_cpu():
    from diffusers.models.attention_dispatch import AttentionBackendName

    for b in AttentionBackendName:
        ok, reason = backends.availability(f"diffusers:{b.value}", "cpu", "float32", (40, 80, 160))
        if b.value in ("native", "_native_math", "flex"):
            assert ok, reason
            continue
        assert not ok and reason.startswith(f"diffusers:{b.value}"), (b.value, reason)
        if b.value.endswith("_hub"):
            assert reason.endswith("needs a download at run time (a kernel from the Hugging Face Hub)")
    assert backends.availability("diffusers:_native_flash", "cpu", "float32")[1].endswith(
        "Query, key, and value must be either bfloat16 or float16.")  # diffusers' own per-call check
    assert "not usable because of missing package" in backends.availability("diffusers:flash", "cpu")[1]
    assert backends.availability("diffusers:_native_cudnn", "cpu")[1] == \
        "diffusers:_native_cudnn runs on CUDA only, not on cpu"


def test_sage_and_fa3_reasons_need_no_gpu(monkeypatch):
    """Their limits, said before anything runs: not installed here; with the package and a GPU faked, the dtype,
    the architecture and SD 1.5's head_dim 160 (beyond sage's 128)."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert backends._static_reason("sage", cpu, "float16", (64,)) == \
        "sage is not installed: pip install sageattention"
    assert backends._static_reason("flash-attn-3", cpu, "float16", (64,)).startswith("flash-attn-3 is not installed")
    monkeypatch.setattr(backends.importlib.util, "find_spec", lambda name: object())
    assert backends._static_reason("sage", cpu, "float16", (64,)) == "sage runs on CUDA only, not on cpu"
    monkeypatch.setattr(backends, "_cuda_arch", lambda device: (9, 0))
    assert backends._static_reason("sage", cuda, "float32", (64,)) == \
        "sage runs in float16 or bfloat16 only, not float32"
    assert backends._static_reason("sage", cuda, "float16", (40, 80, 160)) == \
        "sage needs head_dim <= 128 (thu-ml/SageAttention#119); this model has head_dim 160"
    assert backends._static_reason("sage", cuda, "float16", (64,)) == ""
    assert backends._static_reason("flash-attn-3", cuda, "bfloat16", (40, 80, 160)) == ""
    monkeypatch.setattr(backends, "_cuda_arch", lambda device: (8, 0))
    assert backends._static_reason("flash-attn-3", cuda, "float16", (64,)) == \
        "flash-attn-3 runs on Hopper (sm90) only; this GPU is sm80"
    monkeypatch.setattr(backends, "_cuda_arch", lambda device: (7, 5))
    assert backends._static_reason("sage", cuda, "float16", (64,)) == \
        "sage needs an sm80 or newer GPU; this GPU is sm75"


def test_attnprof_backends_lists_every_dispatcher_backend_by_family(monkeypatch, capsys):
    from diffusers.models.attention_dispatch import AttentionBackendName

    from profiler.cli import main

    monkeypatch.setattr(backends, "_probe", lambda *a: (True, ""))  # the reasons said before running anything
    assert main(["backends", "--device", "cpu", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    for family in ("materialised:", "chunked:", "fused exact:", "fused approximate:"):
        assert f"\n{family}\n" in out
    for b in AttentionBackendName:
        assert f"  diffusers:{b.value} " in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert lines["flex"].endswith(" available") and lines["diffusers:_native_math"].endswith(" available")
    assert lines["diffusers:flash_hub"].endswith("needs a download at run time (a kernel from the Hugging Face Hub)")
    assert out.index("fused approximate:") < out.index("  diffusers:sage ")


def test_the_registry_lists_the_dispatcher_only_when_asked():
    """Importing profiler.attention.backends (every command's start) does not import diffusers' dispatcher."""
    import subprocess
    import sys

    code = ("import sys, profiler.attention.backends as b, profiler.report.compare; "
            "assert b.label('flex', {}) == 'flex' and 'sdpa' in b.BACKENDS; "
            "print('diffusers.models.attention_dispatch' in sys.modules, 'diffusers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


@pytest.mark.parametrize("model, head_dims", [("sd15", {40, 80, 160}), ("sdxl-base", {64})])
def test_dispatcher_memory_models_hold_to_the_trace_at_real_head_dims(model, head_dims):
    """Every call of the real U-Nets, within 1%: on the CPU in float32 (aten's CPU flash kernel with its
    per-thread buffers, the math kernel) and on CUDA in float16 through each SDPA kernel, diffusers' dispatcher
    around it (no head-merge copy where the kernel writes (B, T, h, d); cuDNN's contiguous q, k and v copies)."""
    for device, dtype, names in (("cpu", "float32", ["diffusers:native", "diffusers:_native_math"]),
                                 ("cuda", "float16", ["diffusers:native", "diffusers:_native_flash",
                                                      "diffusers:_native_efficient", "diffusers:_native_cudnn"])):
        t = trace(model, 512, 512, 1, dtype, device, names)
        assert {r["head_dim"] for r in t["rows"]} == head_dims
        for name in names:
            assert not t["backends"][name]["how"].startswith("memory model"), (name, t["backends"][name]["how"])
            for row in t["rows"]:
                traced = row["traced_peak_bytes"][name]
                assert memory.predicted_peak_bytes(name, row, dtype) == pytest.approx(traced, rel=0.01), \
                    (device, name, row["block"], row["head_dim"], row["kind"])


def test_the_planner_says_which_backends_come_from_their_memory_model():
    for name in ("flex", "diffusers:flex", "sage", "diffusers:_flash_3", "flash-attn-3"):
        p = plan("sd15", 512, 512, 1, "float16", backend=name, device="cuda")
        assert p["totals"]["forward_method"].startswith("attention calls from the memory model"), name
        finest = p["blocks"][0]
        assert finest["head_dim"] == 40 and finest["tokens_q"] == 4096
        if name != "diffusers:flex":  # the fused kernels: far under the 256 MiB score table
            assert finest["predicted_peak_bytes"] < finest["score_bytes"] / 8, name
    flex_cpu = plan("sd15", 512, 512, 1, "float32", backend="flex", device="cpu")["blocks"][0]
    a_k = 8 * 4096 * 40 * 4  # the compiled CPU kernel's reordered K and V: two more of these
    assert flex_cpu["predicted_peak_bytes"] == 3 * a_k + a_k + 2 * a_k
    eager = plan("sd15", 512, 512, 1, "float32", backend="diffusers:flex", device="cpu")["blocks"][0]
    assert eager["predicted_peak_bytes"] > 3 * eager["score_bytes"]  # uncompiled: three float32 tables


def call_peak(name, tokens, head_dim, heads=8, **options):
    """(measured, predicted) peak of one processor call on the CPU in float32, self-attention."""
    torch.manual_seed(0)
    attn = Attention(query_dim=heads * head_dim, heads=heads, dim_head=head_dim).eval()
    x = torch.randn(1, tokens, heads * head_dim)
    processor = backends.make_processor(name, **options)
    with torch.no_grad():
        processor(attn, x)  # compiles, where the backend does
        _, measured = cpu_peak_bytes(lambda: processor(attn, x))
    row = {**describe_call(attn, x, None), "device": "cpu"}
    return measured, memory.predicted_peak_bytes(name, row, "float32", **options)


@pytest.mark.parametrize("name", ["diffusers:native", "diffusers:flex"])
def test_dispatcher_memory_models_against_the_cpu_measurement(name):
    """SD 1.5's finest self-attention (8 heads of 40, 4096 tokens): within 10%, as for the built-in backends."""
    measured, predicted = call_peak(name, 4096, 40)
    assert abs(predicted - measured) / measured < 0.10, (name, measured / MiB, predicted / MiB)
    table = 8 * 4096 * 4096 * 4
    assert (measured < table / 10) if name == "diffusers:native" else (measured > 3 * table)


@pytest.fixture(scope="module")
def measured_run(tmp_path_factory):
    """tiny-sd15 at 256x256 with flex and diffusers:native on the CPU, in process (flex compiles)."""
    sweep = Sweep(models=("tiny-sd15",), sizes=((256, 256),), dtypes=("float32",), device="cpu", repeats=2, warmup=1,
                  backends=(("flex", ()), ("diffusers:native", ())), out=str(tmp_path_factory.mktemp("results")))
    return Run.open(execute(sweep, workers=False, progress=False).run_path)


@pytest.mark.slow
def test_flex_and_the_dispatcher_run_in_a_measured_cell(measured_run):
    cells, blocks = measured_run.read()
    assert set(cells["status"]) == {"ok"} and cells["error_ok"].all()
    by = cells.set_index("backend")
    assert by.loc["flex", "compile_s"] > 0 and pd.isna(by.loc["diffusers:native", "compile_s"])  # nothing to compile
    finest = blocks[(blocks["backend"] == "flex") & (blocks["kind"] == "self") & (blocks["level"] == 0)]
    assert (finest["peak_mem_bytes"] < finest["score_bytes"] / 16).all()  # never the 32 MiB score table
    assert by.loc["flex", "kernel"] == "Torch-Compiled Region"  # its compiled kernel named, once for every shape


@pytest.mark.slow
def test_the_planner_holds_to_the_measured_calls_of_the_new_backends(measured_run):
    """Each call's planner figure against the measured one, with the allowance that the sdpa test takes (1 MiB:
    kernels' per-thread tiles that no fake tensor shows)."""
    blocks = measured_run.blocks()
    for backend, group in blocks.groupby("backend"):
        p = plan("tiny-sd15", 256, 256, 1, "float32", backend=backend, device="cpu")
        planned = [b["traced_peak_bytes"] for b in p["blocks"]]
        got = group.sort_values("call_index")["peak_mem_bytes"].tolist()
        assert planned == pytest.approx(got, abs=MiB), backend


@pytest.mark.slow
@pytest.mark.parametrize("tokens, head_dim", [(4096, 40), (1024, 80), (256, 160), (1024, 64)])
def test_compiled_flex_at_real_head_dims_against_its_model_and_the_table(tokens, head_dim):
    """SD 1.5's 40 / 80 / 160 and SDXL's 64 compile and run; the measured call within 10% of the memory model (or
    1 MiB: the kernel's per-thread tiles), and at the finest level far under the float32 score table."""
    measured, predicted = call_peak("flex", tokens, head_dim)
    assert abs(predicted - measured) <= max(0.10 * measured, MiB), (measured / MiB, predicted / MiB)
    if tokens == 4096:  # SD 1.5's finest: about 30 MiB (projections, output, reordered K and V) of a 512 MiB table
        assert measured < 8 * tokens * tokens * 4 / 16


def test_gpu_check_knows_the_new_kernels_and_says_why_they_do_not_run_here(tmp_path):
    from profiler import gpu_check

    from profiler.measure.trace import attribute
    from tests.test_devices import CALLS, Ev

    # Sage's sm80 kernel as its source names it, a Triton template, FA3's CUTLASS wrapper: each credited to its call
    # as a GPU kernel (kept in the call's kernels), and each the backend's own
    gpu = {"sage": "void qk_int_sv_f16_attn_kernel<128u, 64u>(signed char*, ...)",
           "flex": "triton_tem_fused_flex_attention_0",
           "diffusers:_flash_3": "void cutlass::device_kernel<flash::FlashAttnFwdSm90<...>>(...)"}
    for backend, name in gpu.items():
        block = next(iter(CALLS))
        events = [Ev(block, 0, 10), Ev("cudaLaunchKernel", 2, 3, corr=7), Ev(name, 20, 30, device="cuda", linked=7)]
        call = attribute(events, CALLS)[0][CALLS[block]]
        kernels = call["gpu_kernels"]
        assert len(kernels) == 1 and gpu_check.own_gpu_kernels(backend, kernels), (backend, call)
        assert not any(gpu_check.own_gpu_kernels(other, kernels) for other in gpu if other != backend)
    assert not gpu_check.own_gpu_kernels("sage", "sageattention::qk_int8_sv_f16_accum_f16_attn")  # its CPU op
    assert not gpu_check.own_gpu_kernels("sage", "pytorch_flash::flash_fwd_kernel")  # never another's
    assert not gpu_check.own_gpu_kernels("diffusers:_flash_3", "flash_fwd_kernel")
    from profiler.gpu_check import checks, steps

    last = [c for c in gpu_check.STEPS if c.group == "last"]
    assert [c.backend for c in last] == list(checks.NEW_BACKENDS)
    if not torch.cuda.is_available():
        ctx = checks.Context(device="cuda", out=tmp_path, runs=tmp_path / "runs")
        why = [steps.precondition(c, ctx, set()) for c in last]
        assert all("CUDA" in w for w in why), why


def test_a_backends_own_kernels_and_attention_op_are_on_its_record_alone(monkeypatch):
    """A backend registered with kernels= and attention_op= (a plugin's, which no table names): a trace credits its
    GPU kernel to the call, make gpu-check counts it as the backend's own, and a compiled cell finds its calls by its
    op; unregistered, its kernel is no attention kernel. SDPA's op is every SDPA backend's, naive has none."""
    from diffusers.models.attention_processor import AttnProcessor

    from profiler.attention import backends
    from profiler.gpu_check import checks
    from profiler.measure.trace import attention_op, attribute
    from tests.test_devices import CALLS, Ev

    mine = backends.Backend("mine", backends.EXACT, "a plugin's kernel", factory=AttnProcessor, model="fused",
                            kernels=r"my_attn_fwd", attention_op=r"^mylib::attn")
    block = next(iter(CALLS))
    events = [Ev(block, 0, 10), Ev("cudaLaunchKernel", 2, 3, corr=7),
              Ev("void my_attn_fwd<64>(float*)", 20, 30, device="cuda", linked=7)]
    assert attribute(events, CALLS)[0][CALLS[block]]["gpu_kernels"] == []
    monkeypatch.setitem(backends.BACKENDS, "mine", mine)
    kernels = attribute(events, CALLS)[0][CALLS[block]]["gpu_kernels"]
    assert kernels == ["my_attn_fwd"] and checks.own_gpu_kernels("mine", kernels)
    assert not checks.own_gpu_kernels("flex", kernels)
    assert not checks.own_gpu_kernels("sdpa", kernels + ["pytorch_flash::flash_fwd_kernel"])  # SDPA's are no one's own
    assert attention_op("mine").pattern == "^mylib::attn" and attention_op("naive") is None
    assert attention_op("xformers").search("xformers_flash::flash_fwd") and attention_op("flash-attn-3").search(
        "flash_attn_3::fwd")
    sdpa = attention_op("sdpa-flash")
    assert sdpa.search("aten::_scaled_dot_product_flash_attention") and not sdpa.search(
        "aten::scaled_dot_product_attention") and attention_op("sdpa") == sdpa


@pytest.mark.slow
def test_flex_compiles_in_the_compile_pass_and_never_in_a_timed_forward(monkeypatch):
    """Dynamo's count of compiled graphs after the compile pass is its count at the end of the cell."""
    from torch._dynamo.utils import counters

    from profiler.measure import cell as C

    graphs, compile_pass = [], C._compile_pass

    def counted(*args):
        out = compile_pass(*args)
        graphs.append(counters["stats"]["unique_graphs"])
        return out

    monkeypatch.setattr(C, "_compile_pass", counted)
    spec = Sweep(models=("tiny-sd15",), sizes=((128, 128),), dtypes=("float32",), device="cpu",
                 backends=(("flex", ()),)).cells()[0]
    row, _ = C.measure_cell(spec, C.ModelCache(), repeats=2, warmup=0)
    assert graphs[0] >= 1 and counters["stats"]["unique_graphs"] == graphs[0]
    assert row["compile_s"] > 0 and row["error_ok"]
