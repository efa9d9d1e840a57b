import pytest
import torch
from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

from profiler.unet import models
from profiler.planner import plan
from profiler.attention.recorder import Recorder


@pytest.mark.parametrize("fixture, size", [("tiny_sd15", (64, 64)), ("tiny_sdxl", (96, 64))])
def test_planner_rows_equal_recorder_rows_of_a_real_forward(request, fixture, size):
    unet = request.getfixturevalue(fixture)
    name = fixture.replace("_", "-")
    w, h = size
    with torch.no_grad(), Recorder(unet) as rec:
        unet(**models.example_inputs(unet, 2, w, h))
    measured = [{k: v for k, v in r.items() if k != "pass_index"} for r in rec.rows]
    planned = plan(name, w, h, batch=2, dtype="float32")["blocks"]
    assert measured == planned
    assert len(measured) == {"tiny_sd15": 32, "tiny_sdxl": 140}[fixture]


def test_rows_are_grouped_by_forward_pass(tiny_sd15):
    inputs = models.example_inputs(tiny_sd15, 1, 64, 64)
    with torch.no_grad(), Recorder(tiny_sd15) as rec:
        tiny_sd15(**inputs)
        tiny_sd15(**inputs)
    passes = rec.passes()
    assert [len(p) for p in passes] == [32, 32]
    assert [r["call_index"] for r in passes[1]] == list(range(32))
    assert {r["pass_index"] for r in passes[1]} == {1}


def test_processors_restored_after_an_exception(tiny_sd15):
    before = dict(tiny_sd15.attn_processors)
    calls = []

    class Explode:
        def before(self, row):
            calls.append(row["block"])
            if len(calls) == 5:
                raise RuntimeError("boom inside the forward")

        def after(self, row):
            pass

    with pytest.raises(RuntimeError, match="boom"):
        with torch.no_grad(), Recorder(tiny_sd15, processor=AttnProcessor, around=Explode()):
            tiny_sd15(**models.example_inputs(tiny_sd15, 1, 64, 64))
    after = tiny_sd15.attn_processors
    assert after.keys() == before.keys()
    assert all(after[k] is before[k] for k in before)
    assert len(calls) == 5


def test_wrapper_output_equals_plain_forward(tiny_sd15):
    inputs = models.example_inputs(tiny_sd15, 1, 64, 64)
    with torch.no_grad():
        plain = tiny_sd15(**inputs).sample
        with Recorder(tiny_sd15):
            wrapped = tiny_sd15(**inputs).sample
    assert torch.equal(plain, wrapped)
    assert all(isinstance(p, AttnProcessor2_0) for p in tiny_sd15.attn_processors.values())


def test_upcast_softmax_counts_four_bytes_per_score(tiny_sd15):
    unet = models.build("tiny-sd15", weights="meta", dtype="float16")
    for m in unet.modules():
        if hasattr(m, "upcast_softmax"):
            m.upcast_softmax = True
    with torch.no_grad(), Recorder(unet, processor=AttnProcessor) as rec:
        unet(**models.example_inputs(unet, 1, 64, 64))
    assert all(r["score_bytes"] == 4 * r["score_elements"] for r in rec.rows)
    assert plan("tiny-sd15", 64, 64)["blocks"][0]["score_bytes"] == 2 * rec.rows[0]["score_elements"]


@pytest.mark.parametrize("name, layers, heads", [("clip-l", 12, 12), ("openclip-bigg", 32, 20)])
def test_a_clip_text_encoders_attention_is_recorded_at_its_real_size(name, layers, heads):
    """transformers' CLIP attention (SD 1.5's CLIP-L, SDXL's OpenCLIP bigG: their real configs, built on the meta
    device) recorded by the same hooks and row shape as diffusers' modules: one call a layer, 77 tokens, heads of 64;
    no processor of a backend reaches it (it has none), and its eager path's float32 softmax is told."""
    import transformers

    from profiler.attention.recorder import clip_attention_modules, unrecorded_attention
    from profiler.planner.pipeline import TEXT_ENCODERS

    cls, config = TEXT_ENCODERS[name]
    with torch.device("meta"):
        model = getattr(transformers, cls)(transformers.CLIPTextConfig(**config))
    modules = clip_attention_modules(model)
    assert len(modules) == layers and unrecorded_attention(model) == {}
    ids = torch.zeros(2, 77, dtype=torch.long, device="meta")
    with torch.no_grad(), Recorder(model, processor=AttnProcessor, modules=modules) as rec:
        model(input_ids=ids)
    assert [r["call_index"] for r in rec.rows] == list(range(layers))
    assert {(r["kind"], r["batch"], r["heads"], r["head_dim"], r["tokens_q"], r["tokens_k"], r["upcast"])
            for r in rec.rows} == {("self", 2, heads, 64, 77, 77, "")}
    assert rec.rows[0]["flops"] == 4 * 2 * heads * 77 * 77 * 64 and rec.rows[0]["score_bytes"] == 2 * heads * 77 ** 2 * 4
    model.config._attn_implementation = "eager"
    with torch.no_grad(), Recorder(model, modules=modules) as rec:
        model(input_ids=ids)
    assert {r["upcast"] for r in rec.rows} == {"softmax"}


def test_nvtx_ranges_are_a_step_per_forward_with_its_blocks_inside_and_none_when_off(tiny_sd15, monkeypatch):
    """With NVTX ranges on (injected: tests/test_devices.py's FakeNvtx), two forwards are two ranges `step 0`, `step
    1`, each holding one range per attention call named by its block path, in the order the recorder saw them; a
    Ctrl-C inside a forward (KeyboardInterrupt passes by forward hooks) leaves no range open once the recorder exits;
    off, not one NVTX call."""
    from profiler import devices
    from tests.test_devices import FakeNvtx, nvtx_on

    inputs = models.example_inputs(tiny_sd15, 1, 64, 64)
    fake = nvtx_on(monkeypatch)
    with torch.no_grad(), Recorder(tiny_sd15) as rec:
        tiny_sd15(**inputs)
        tiny_sd15(**inputs)
    assert [name for name, _ in fake.ranges] == ["step 0", "step 1"]
    for (_, calls), rows in zip(fake.ranges, rec.passes(), strict=True):
        assert [name for name, _ in calls] == [r["block"] for r in rows] and len(calls) == 32
    def ctrl_c(module, args):
        raise KeyboardInterrupt

    hook = tiny_sd15.mid_block.attentions[0].transformer_blocks[0].attn2.register_forward_pre_hook(ctrl_c)
    try:
        with pytest.raises(KeyboardInterrupt), torch.no_grad(), Recorder(tiny_sd15):
            tiny_sd15(**inputs)
    finally:
        hook.remove()
    assert fake.open == [fake.ranges] and fake.ranges[-1][0] == "step 0"
    monkeypatch.setattr(devices, "NVTX", off := FakeNvtx())
    monkeypatch.delenv(devices.NVTX_ENV)
    with torch.no_grad(), Recorder(tiny_sd15):
        tiny_sd15(**inputs)
    assert off.ranges == []
