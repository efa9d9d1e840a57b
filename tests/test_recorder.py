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
