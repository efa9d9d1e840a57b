import copy
import functools
import json
import math

import pytest
import torch
from diffusers.models.attention_processor import Attention, AttnProcessor

from profiler.attention import backends, chunked
from profiler.unet import models
from profiler.measure.probes import cpu_peak_bytes
from profiler.planner import memory
from profiler.attention.processor import Processor
from profiler.attention.recorder import describe_call
from profiler.spec import InputError

MiB = 2**20
ON_CPU = ["naive", "sliced", "split", "subquad", "sdpa", "sdpa-flash", "sdpa-math"]


def chunky(name: str, kind: str = "self") -> dict:
    """Options that make the chunked backends cut 1000 tokens (and 77 keys) into uneven chunks."""
    return {"sliced": {"slice_size": 3}, "split": {"budget_bytes": MiB},
            "subquad": {"query_chunk": 128, "key_chunk": 300 if kind == "self" else 30}}.get(name, {})


def reference(attn, x, ctx, mask):
    """Plain softmax(q k^T * scale + mask) v through the same module, in float64."""
    attn64 = copy.deepcopy(attn).double()
    to64 = lambda t: None if t is None else t.double()  # noqa: E731
    with torch.no_grad():
        return AttnProcessor()(attn64, to64(x), to64(ctx), to64(mask))


@functools.cache
def case(kind: str, dtype: torch.dtype):
    """An Attention module, batch 2 of 1000 query tokens (77 keys for cross), a key mask (B, 1, Tk), and the
    float64 references without and with the mask."""
    gen = torch.Generator().manual_seed(0)
    attn = Attention(query_dim=64, heads=8, dim_head=8, cross_attention_dim=32 if kind == "cross" else None)
    attn = attn.to(dtype).eval()
    x = torch.randn(2, 1000, 64, generator=gen).to(dtype)
    ctx = torch.randn(2, 77, 32, generator=gen).to(dtype) if kind == "cross" else None
    tokens_k = 77 if kind == "cross" else 1000
    mask = torch.where(torch.rand(2, 1, tokens_k, generator=gen) < 0.2, -10000.0, 0.0).to(dtype)
    return attn, x, ctx, [(m, reference(attn, x, ctx, m)) for m in (None, mask)]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("kind", ["self", "cross"])
@pytest.mark.parametrize("name", ON_CPU)
def test_backend_matches_float64_reference(name, kind, dtype, tol):
    attn, x, ctx, refs = case(kind, dtype)
    for mask, want in refs:
        with torch.no_grad():
            got = backends.make_processor(name, **chunky(name, kind))(attn, x, ctx, mask)
        assert got.dtype == dtype and got.shape == want.shape
        err = (got.double() - want).abs().max().item() / want.abs().max().item()
        assert err < tol, f"{name} {kind} {dtype} mask={mask is not None}: relative error {err:.2e}"


CORES = {
    "split": lambda q, k, v, mask=None, **kw: chunked.split_attention(q, k, v, mask, budget_bytes=1, **kw),
    "subquad-k1": lambda q, k, v, mask=None, **kw: chunked.subquad_attention(q, k, v, mask, query_chunk=1,
                                                                            key_chunk=1, **kw),
    "subquad-k2": lambda q, k, v, mask=None, **kw: chunked.subquad_attention(q, k, v, mask, query_chunk=2,
                                                                            key_chunk=2, **kw),
}


@pytest.mark.parametrize("core", CORES)
def test_worked_example(core):
    q = torch.tensor([[[1.0, 0.0]]])  # (1, 1, 2)
    k = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]])  # (1, 3, 2)
    v = torch.tensor([[[2.0, 0.0], [0.0, 2.0], [1.0, 1.0]]])  # (1, 3, 2)
    out = CORES[core](q, k, v, scale=1 / math.sqrt(2))
    assert out[0, 0].tolist() == pytest.approx([1.203, 0.797], abs=1e-3)
    weights = CORES[core](q, k, torch.eye(3)[None], scale=1 / math.sqrt(2))  # v = identity: output = weights
    assert weights[0, 0].tolist() == pytest.approx([0.401, 0.198, 0.401], abs=1e-3)


@pytest.mark.parametrize("core", CORES)
def test_cores_with_per_query_mask_and_masked_chunks(core):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(3, 7, 5, generator=gen, dtype=torch.float64) for _ in range(3))
    mask = torch.where(torch.rand(3, 7, 7, generator=gen) < 0.3, float("-inf"), 0.0).double()
    mask[..., 0] = 0.0  # every query keeps one key
    mask[:, :, 1:3] = float("-inf")  # a whole key chunk masked for every query
    want = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(5) + mask, -1) @ v
    assert torch.allclose(CORES[core](q, k, v, mask), want, atol=1e-12)


@pytest.mark.parametrize("name", ["split", "subquad"])
def test_chunked_processors_do_what_attn_processor_does_around_the_core(name):
    """4-D input, spatial norm, group norm, norm_cross, residual, rescale, upcast: same output as AttnProcessor."""
    gen = torch.Generator().manual_seed(2)
    attn = Attention(query_dim=32, heads=4, dim_head=8, cross_attention_dim=12, cross_attention_norm="layer_norm",
                     norm_num_groups=4, spatial_norm_dim=4, residual_connection=True, rescale_output_factor=2.0,
                     upcast_softmax=True).eval()
    x = torch.randn(2, 32, 6, 5, generator=gen)  # (B, C, H, W): 30 tokens
    temb = torch.randn(2, 4, 3, 3, generator=gen)
    ctx = torch.randn(2, 7, 12, generator=gen)
    opts = {"split": {"budget_bytes": 8 * 7 * 4 * 4}, "subquad": {"query_chunk": 4, "key_chunk": 3}}[name]
    with torch.no_grad():
        want = AttnProcessor()(attn, x, ctx, temb=temb)
        got = backends.make_processor(name, **opts)(attn, x, ctx, temb=temb)
    assert got.shape == x.shape
    assert torch.allclose(got, want, atol=1e-5)


def test_upcast_in_bfloat16_scores_in_float32():
    gen = torch.Generator().manual_seed(3)
    attn = Attention(query_dim=64, heads=8, dim_head=8, upcast_attention=True, upcast_softmax=True)
    attn = attn.to(torch.bfloat16).eval()
    x = torch.randn(1, 300, 64, generator=gen).to(torch.bfloat16)
    want = reference(attn, x, None, None)
    for name in ("split", "subquad"):
        with torch.no_grad():
            got = backends.make_processor(name, **chunky(name))(attn, x)
        assert (got.double() - want).abs().max() / want.abs().max() < 2e-2


def test_registry_names_and_families():
    from diffusers.models.attention_dispatch import AttentionBackendName

    dispatcher = [f"diffusers:{b.value}" for b in AttentionBackendName]
    assert len(dispatcher) == 27 and "diffusers:_native_math" in dispatcher and "diffusers:sage" in dispatcher
    assert backends.names() == ["naive", "sliced", "split", "subquad", "sdpa", "sdpa-flash", "sdpa-efficient",
                                "sdpa-math", "sdpa-cudnn", "xformers", "flash-attn", "flash-attn-3", "flex",
                                "sage", *dispatcher]
    assert {n: b.family for n, b in backends.BACKENDS.items() if b.family != "fused exact"} == {
        "naive": "materialised", "sliced": "chunked", "split": "chunked", "subquad": "chunked",
        "sage": "fused approximate", **{n: "fused approximate" for n in dispatcher if "sage" in n}}
    assert backends.BACKENDS["subquad"].options == {"query_chunk": 1024, "key_chunk": 4096}
    with pytest.raises(AttributeError):
        backends.BACKENDS["naive"].family = "fused"


def test_a_plugin_names_a_family_the_reports_group_by():
    plugin = backends.Backend("mine", "fused", "a plugin", factory=lambda: None, memory_like="sdpa")
    with pytest.raises(ValueError, match="family .fused.: use one of materialised, chunked, fused exact, fused approx"):
        backends.register(plugin)
    assert "mine" not in backends.BACKENDS


class Textbook(Processor):
    """softmax(q k^T * scale + mask) v written out, as diffusers' AttnProcessor computes it: a backend of a test's."""

    def __init__(self, spare: int = 2):
        self.spare = spare  # an option, to be labelled: it changes nothing

    def attend(self, attn, hidden_states, context, mask):
        q, k, v = (attn.head_to_batch_dim(p(x)) for p, x in
                   ((attn.to_q, hidden_states), (attn.to_k, context), (attn.to_v, context)))  # (n, T, d)
        return attn.batch_to_head_dim(torch.bmm(attn.get_attention_scores(q, k, mask), v))  # (B, Tq, C)


def test_adding_a_backend_is_one_entry(capsys, monkeypatch, tmp_path):
    """One register() call and its processor: `attnprof backends` lists it under its family, `plan --backend` gives
    each call a predicted peak, a measured run stores its cells and `show` names it, and the dashboard's transforms
    give it its family and label. (The other backends' probes are stubbed: `backends` would compile flex's.)"""
    from dashboards import transforms
    from profiler.cli import main
    from profiler.store import list_runs

    backends.register(backends.Backend("textbook", "materialised", "a test's: the softmax written out",
                                       {"spare": 2}, factory=Textbook, model="naive"))
    try:
        probe = backends.availability
        monkeypatch.setattr(backends, "availability", lambda name, *a: probe(name, *a) if name == "textbook" else
                            (True, ""))
        assert main(["backends", "--device", "cpu"]) == 0
        out = capsys.readouterr().out
        materialised = out.split("\nmaterialised:\n")[1].split("\n\n")[0].splitlines()
        assert [ln.split() for ln in materialised] == [["naive", "available"], ["textbook", "available"]]
        monkeypatch.undo()

        assert main(["plan", "--model", "tiny-sd15", "--size", "64x64", "--backend", "textbook", "--json"]) == 0
        (planned,) = json.loads(capsys.readouterr().out)
        assert planned["backend"] == "textbook" and len(planned["blocks"]) == 32
        assert all(b["predicted_peak_bytes"] == memory.predicted_peak_bytes("naive", b, planned["dtype"]) > 0
                   for b in planned["blocks"])  # its model's: naive's

        assert main(["run", "--model", "tiny-sd15", "--size", "64x64", "--backend", "textbook", "--option",
                     "spare=3", "--device", "cpu", "--dtype", "float32", "--repeats", "1", "--warmup", "0",
                     "--in-process", "--quiet", "--out", str(tmp_path)]) == 0
        capsys.readouterr()
        (run,) = list_runs(tmp_path)
        cells, blocks = transforms.load_run(run)
        assert cells["status"].tolist() == ["ok"] and len(blocks) == 32 and (blocks["status"] == "ok").all()
        assert cells["family"].tolist() == ["materialised"] and cells["backend_label"].tolist() == ["textbook(spare=3)"]
        assert main(["show", "latest", "--results", str(tmp_path), "--wide"]) == 0
        shown = capsys.readouterr().out
        row = next(line for line in shown.splitlines() if line.startswith("tiny-sd15") and "textbook(spare=3)" in line)
        assert " materialised " in row  # its family column
    finally:
        backends.BACKENDS.pop("textbook", None)


def test_unknown_backend_and_bad_options():
    with pytest.raises(InputError, match=r"unknown backend 'nope': use one of naive, sliced, split, subquad, sdpa"):
        backends.check_backend_name("nope")
    with pytest.raises(InputError, match="unknown backend 'nope'"):
        backends.make_processor("nope")
    with pytest.raises(InputError, match="backend 'split' has no option 'budget': use budget_bytes"):
        backends.check_options("split", {"budget": 5})
    with pytest.raises(InputError, match="backend 'naive' has no option 'slice_size': it takes no options"):
        backends.make_processor("naive", slice_size=2)
    for bad in (0, -1, 2.5, "many", True, None):
        with pytest.raises(InputError, match=r"option query_chunk=.* of backend 'subquad': use a whole number >= 1"):
            backends.check_options("subquad", {"query_chunk": bad})
    assert backends.check_options("subquad", {"key_chunk": "512"}) == {"query_chunk": 1024, "key_chunk": 512}
    assert backends.make_processor("sliced", slice_size=4).slice_size == 4


def test_make_processor_returns_new_instances():
    for name in backends.names():
        assert backends.make_processor(name) is not backends.make_processor(name)


def test_availability_on_cpu():
    for name in ON_CPU:
        assert backends.availability(name, "cpu", "float32") == (True, "")
    assert backends.availability("xformers", "cpu") == (False, "xformers is not installed: pip install xformers")
    assert backends.availability("flash-attn", "cpu") == (False, "flash-attn is not installed: pip install flash-attn")
    for name in ("sdpa-efficient", "sdpa-cudnn"):
        assert backends.availability(name, "cpu", "float16") == (False, f"{name} runs on CUDA only, not on cpu")
    if not torch.cuda.is_available():
        ok, reason = backends.availability("sdpa", "cuda:0")
        assert not ok and "CUDA is not available" in reason
    with pytest.raises(InputError, match="unknown device"):
        backends.availability("naive", "gpu0")


def test_a_kernel_that_does_not_run_is_reported_with_torch_s_reason():
    ok, reason = backends._probe("sdpa-efficient", "cpu", "float32")
    assert not ok
    assert reason.startswith("sdpa-efficient does not run on cpu in float32 at head_dim 64: ")
    assert "backend" in reason.lower() or "kernel" in reason.lower()


def measure_call(name, dtype=torch.float32, **options):
    """Measured and predicted peak of one processor call: 8 heads of 40, 4096 tokens, batch 1 (SD1.5's finest)."""
    torch.manual_seed(0)
    attn = Attention(query_dim=320, heads=8, dim_head=40).to(dtype).eval()
    x = torch.randn(1, 4096, 320, dtype=dtype)
    processor = backends.make_processor(name, **options)
    with torch.no_grad():
        _, measured = cpu_peak_bytes(lambda: processor(attn, x))
    row = describe_call(attn, x, None)
    return measured, memory.predicted_peak_bytes(name, row, str(dtype).removeprefix("torch."), **options)


@pytest.fixture(scope="module")
def naive_peak():
    return measure_call("naive")


def test_naive_memory_model_within_5_percent(naive_peak):
    measured, predicted = naive_peak
    assert 1024 * MiB < measured < 1060 * MiB  # two 512 MiB score tables alive at once, plus q, k, v
    assert abs(predicted - measured) / measured < 0.05


@pytest.mark.parametrize("name, options", [("sliced", {}), ("sliced", {"slice_size": 3}),
                                           ("split", {}), ("split", {"budget_bytes": 20 * MiB}),
                                           ("subquad", {}), ("subquad", {"query_chunk": 1000, "key_chunk": 3000}),
                                           ("sdpa-flash", {}), ("sdpa", {}), ("sdpa-math", {})])
def test_memory_models_within_10_percent(name, options, naive_peak):
    measured, predicted = measure_call(name, **options)
    assert abs(predicted - measured) / measured < 0.10, f"{name} {options}: {measured / MiB:.1f} MiB measured"
    if backends.BACKENDS[name].family == "fused exact" and name != "sdpa-math":
        assert measured < naive_peak[0] / 10 and predicted < naive_peak[1] / 10


def test_split_budget_bounds_the_chunk_table():
    row = {"batch": 2, "heads": 8, "head_dim": 40, "tokens_q": 4096, "tokens_k": 4096,
           "score_elements": 2 * 8 * 4096 * 4096, "score_bytes": 2 * 8 * 4096 * 4096 * 2}
    assert chunked.split_rows(16, 4096, 2, 64 * MiB) == 512
    assert chunked.split_rows(16, 4096, 2, 1) == 1
    small = memory.predicted_peak_bytes("split", row, "float16", budget_bytes=16 * MiB)
    large = memory.predicted_peak_bytes("split", row, "float16", budget_bytes=256 * MiB)
    naive = memory.predicted_peak_bytes("naive", row, "float16")
    assert small < large < naive == 2 * row["score_bytes"] + 3 * 2 * 4096 * 320 * 2


@pytest.mark.parametrize("name", ON_CPU)
def test_processor_in_a_tiny_unet_matches_another_implementation(tiny_sd15, name):
    """Each backend against a different implementation: diffusers' AttnProcessor (baddbmm + softmax), and naive
    against AttnProcessor2_0 (SDPA)."""
    from diffusers.models.attention_processor import AttnProcessor2_0

    inputs = models.example_inputs(tiny_sd15, 2, 64, 64)
    options = {"sliced": {"slice_size": 3}, "split": {"budget_bytes": 4096},
               "subquad": {"query_chunk": 24, "key_chunk": 40}}.get(name, {})
    other = AttnProcessor2_0 if name == "naive" else AttnProcessor
    originals = tiny_sd15.attn_processors
    try:
        with torch.no_grad():
            tiny_sd15.set_attn_processor({k: other() for k in originals})
            want = tiny_sd15(**inputs).sample
            tiny_sd15.set_attn_processor({k: backends.make_processor(name, **options) for k in originals})
            got = tiny_sd15(**inputs).sample
    finally:
        tiny_sd15.set_attn_processor(originals)
    assert type(backends.make_processor(name, **options)) is not other
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


def test_the_names_a_user_imports_come_from_profiler(tmp_path):
    """`from profiler import Backend, register, make_processor, profile, plan, fit` in a fresh process: the real
    objects, no warning, no torch imported by `import profiler`."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    code = ("import sys, profiler\n"
            "assert 'torch' not in sys.modules\n"
            "from profiler import Backend, register, make_processor, profile, plan, fit\n"
            "import profiler.attention.backends as b, profiler.record.session as s, profiler.api as api\n"
            "assert (Backend, register, make_processor) == (b.Backend, b.register, b.make_processor)\n"
            "assert (profile, plan, fit) == (s.profile, api.plan, api.fit)\n"
            "assert type(make_processor('sliced', slice_size=2)).__name__ == 'SlicedAttnProcessor'\n"
            "print(len(plan('tiny-sd15', '64x64', backend='sdpa').blocks))\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{repo}"}
    done = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "32", done.stderr[-2000:]


def test_the_kernel_each_backend_runs_is_read_from_its_record():
    """The kernel the GPU time model prices a call by (call_kernel): a forced SDPA kernel, PyTorch's choice for the
    call, a library's own (flash-attn's FlashAttention-2 is PyTorch's flash kernel, FA3 its own: each record's
    runs_kernel), xformers' by arch and head dim, else the backend itself; a dispatcher backend as the kernel it
    runs. SD 1.5's head dims 40 and 160, SDXL's 64."""
    from profiler.attention.backends import call_kernel

    row = {"head_dim": 64, "sdpa_kernel": "efficient"}
    assert [call_kernel(n, row, "sm90") for n in ("flash-attn", "flash-attn-3", "diffusers:flash", "sdpa-cudnn",
                                                  "sdpa", "naive", "subquad")] == \
        ["flash", "fa3", "flash", "cudnn", "efficient", "naive", "subquad"]
    assert call_kernel("xformers", {"head_dim": 160}, "sm80") == "flash"
    assert call_kernel("xformers", {"head_dim": 40}, "sm75") == "efficient"
