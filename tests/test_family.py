"""The rest of the U-Net family, each model kind one record (profiler/unet/kinds.py): AnimateDiff and SVD (temporal
attention over frames), the SDXL refiner, Kandinsky 2.2's decoder (added-KV attention), and U-Net configs of every
shape diffusers builds (class embeddings, each addition_embed_type, SimpleCrossAttn, GLIGEN, per-block cross
widths). Full-size models on the meta device against hand counts and FlopCounterMode; tiny ones with the real block
topology measured on the CPU; a new kind added in one record."""
import contextlib
import io
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml

from profiler.attention import backends
from profiler.unet import kinds, models
from profiler.cli import main
from profiler.planner import plan
from profiler.attention.recorder import Recorder
from profiler.spec import InputError
from profiler.store import list_runs
from profiler.unet.workload import Workload

REPO = Path(__file__).resolve().parent.parent
TINY = yaml.safe_load((REPO / "configs" / "models" / "tiny-sd15.yaml").read_text())["unet"]


def _calls(rows) -> Counter:
    return Counter((r["kind"], r["batch"], r["heads"], r["tokens_q"], r["tokens_k"]) for r in rows)


def _levels(kind: str, batch: int, heads: list, tokens: list, counts: list, keys) -> Counter:
    """A hand count: per level, `counts` calls of this kind with its heads and tokens (keys(tokens): the keys)."""
    return Counter({(kind, batch(t) if callable(batch) else batch, h, *(keys(t) if callable(keys) else (t, keys))): n
                    for h, t, n in zip(heads, tokens, counts)})


# AnimateDiff on SD 1.5 at 512x512, 16 frames, batch 2: spatial calls see 2 x 16 images (8 heads; 4096, 1024, 256 and
# 64 tokens: 5, 5, 5 and 1 transformer blocks, self and cross); its 20 motion modules (2 per down level, 3 per up
# level, 4 levels) attend over the 16 frames at every position: batch 2 x positions, 10 calls per level.
ANIMATEDIFF = (_levels("self", 32, [8] * 4, [4096, 1024, 256, 64], [5, 5, 5, 1], lambda t: (t, t))
               + _levels("cross", 32, [8] * 4, [4096, 1024, 256, 64], [5, 5, 5, 1], 77)
               + _levels("temporal", lambda t: 2 * t, [8] * 4, [4096, 1024, 256, 64], [10] * 4, lambda t: (16, 16)))
# SVD-XT at 1024x576 (latent 128x72), 25 frames, batch 1: at each level 5 spatio-temporal transformers (1 at the mid
# block), each a spatial self and cross (25 images; one image-embedding token) and a temporal self and cross
# (positions x frames); heads 5, 10, 20, 20 of 64.
SVD = Counter()
for heads, t, n in zip([5, 10, 20, 20], [9216, 2304, 576, 144], [5, 5, 5, 1]):
    SVD.update({("self", 25, heads, t, t): n, ("cross", 25, heads, t, 1): n, ("temporal", t, heads, 25, 25): n,
                ("cross", t, heads, 25, 1): n})
# The SDXL refiner at 1024x1024: attention at two levels (4096 tokens, 12 heads; 1024, 24 heads), 4 transformer
# layers a block: 2 down and 3 up attention blocks a level (20 layers), and the mid block's 4 (256 tokens, 24 heads).
REFINER = (_levels("self", 1, [12, 24, 24], [4096, 1024, 256], [20, 20, 4], lambda t: (t, t))
           + _levels("cross", 1, [12, 24, 24], [4096, 1024, 256], [20, 20, 4], 77))
# Kandinsky 2.2's decoder at 768x768 (latent 96x96): SimpleCrossAttn at three levels (2304, 576, 144 positions;
# heads of 64: 12, 18, 24), 3 down and 4 up a level and the mid block's 1; each call's keys are the 32 tokens of the
# projected image embedding and every position of its level.
KANDINSKY = _levels("added-kv", 1, [12, 18, 24], [2304, 576, 144], [7, 7, 8], lambda t: (t, 32 + t))

FULL = [("animatediff-sd15", (512, 512), 2, {"frames": 16}, ANIMATEDIFF),
        ("svd-xt", (1024, 576), 1, {"frames": 25}, SVD),
        ("sdxl-refiner", (1024, 1024), 1, {}, REFINER),
        ("kandinsky22-decoder", (768, 768), 1, {}, KANDINSKY)]


def _flops_per_module(model: str, size, batch: int, settings: dict) -> dict[str, int]:
    """FlopCounterMode's count of each Attention module's score and output products (bmm, baddbmm: what naive
    attention is) on a meta forward of the real class, by the recorder's block path."""
    from diffusers.models.attention_processor import AttnProcessor
    from torch.utils.flop_counter import FlopCounterMode

    w = Workload(model, settings)
    module = w.build(lambda which: w.make_part(which, "meta", "cpu", "float16"))
    inputs = w.inputs(module, batch, *size)
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), Recorder(module, processor=AttnProcessor), counter:
        w.forward(module, inputs)
    from profiler.attention.recorder import attention_modules

    prefix, attention = type(module).__name__ + ".", set(attention_modules(module))
    out = {}
    for name, ops in counter.get_flop_counts().items():
        if name.startswith(prefix) and name[len(prefix):] in attention:
            out[name[len(prefix):]] = sum(v for op, v in ops.items() if str(op).split(".")[1] in ("bmm", "baddbmm"))
    return out


@pytest.mark.parametrize("model, size, batch, settings, expected", FULL, ids=[f[0] for f in FULL])
def test_every_call_of_the_real_class_against_a_hand_count_and_flop_counter(model, size, batch, settings, expected):
    p = plan(model, *size, batch, "float16", settings=tuple(settings.items()))
    assert _calls(p["blocks"]) == expected
    flops = _flops_per_module(model, size, batch, settings)
    mine = Counter()
    for r in p["blocks"]:
        mine[r["block"]] += r["flops"]
    assert mine == Counter(flops) and sum(flops.values()) == p["totals"]["flops_total"]


def test_xformers_is_refused_on_animatediffs_temporal_calls_with_the_reason(capsys):
    """batch x heads 2 x 64 x 64 x 8 = 65,536: one over xformers' limit (xformers#845) on the finest level's temporal
    calls, said per call and as the plan's verdict; the spatial calls run."""
    assert main(["plan", "--model", "animatediff-sd15", "--size", "512x512", "--frames", "16", "--batch", "2",
                 "--backend", "xformers"]) == 0
    out = capsys.readouterr().out
    assert "xformers cannot run this call (batch x heads 65,536 > 65,535" in out
    p = plan("animatediff-sd15", 512, 512, 2, "float16", "xformers", settings=(("frames", 16),))
    refused = [r for r in p["blocks"] if r["refused"]]
    assert {(r["kind"], r["batch"]) for r in refused} == {("temporal", 8192)} and len(refused) == 10
    assert p["totals"]["refused"].endswith("10 of 72 calls, e.g. down_blocks.0.motion_modules.0.transformer_blocks"
                                           ".0.attn1")


def test_tiny_video_models_run_on_the_cpu_with_every_backend(tmp_path):
    """tiny-animatediff and tiny-svd (the block topology of AnimateDiff on SD 1.5 and of SVD) at 64x64 and 4 frames,
    measured: naive, sliced, subquad and sdpa ok, within the float32 tolerance of the reference, with a time and a
    peak on every call, their temporal calls named."""
    out = io.StringIO()
    for model in ("tiny-animatediff", "tiny-svd"):
        with contextlib.redirect_stdout(out):
            assert main(["run", "--model", model, "--size", "64x64", "--frames", "4", "--backend", "naive",
                         "--backend", "sliced", "--backend", "subquad", "--backend", "sdpa", "--device", "cpu",
                         "--repeats", "1", "--warmup", "0", "--in-process", "--quiet", "--out", str(tmp_path)]) == 0
    from profiler.store import Run

    for path in list_runs(tmp_path):
        cells, blocks = Run.open(path).read()
        assert list(cells["status"]) == ["ok"] * 4 and cells["error_ok"].all()
        assert set(cells["frames"]) == {4} and blocks["time_ms"].gt(0).all() and blocks["peak_mem_bytes"].gt(0).all()
        assert blocks["kind"].eq("temporal").sum() == 4 * {"tiny-animatediff": 40, "tiny-svd": 16}[cells["model"][0]]
    assert "temporal attention (over the frames at each position: 40 of 72 calls) took" in out.getvalue()


def test_fit_answers_for_a_video_model_in_size_and_in_frames(capsys):
    assert main(["fit", "--model", "animatediff-sd15", "--frames", "16", "--budget", "24GiB", "--backend", "sdpa",
                 "--quiet"]) == 0
    assert "the largest image whose forward fits 24.0 GiB" in capsys.readouterr().out
    assert main(["fit", "--model", "tiny-animatediff", "--size", "256x256", "--budget", "2GiB", "--backend",
                 "sdpa", "--device", "cpu", "--dtype", "float32", "--quiet", "--json"]) == 0
    import json

    found = json.loads(capsys.readouterr().out)
    sdpa = found["backends"][0]
    assert found["max_frames"] == 32 and sdpa["frames"] == 32 and sdpa["next_frames"] is None


# ---- any U-Net config a user holds

def _tiny(tmp_path: Path, name: str, **changes) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, "unet": {**TINY, **changes}}))
    return str(path)


SIMPLE = {"down_block_types": ["ResnetDownsampleBlock2D"] + ["SimpleCrossAttnDownBlock2D"] * 3,
          "up_block_types": ["SimpleCrossAttnUpBlock2D"] * 3 + ["ResnetUpsampleBlock2D"],
          "mid_block_type": "UNetMidBlock2DSimpleCrossAttn", "attention_head_dim": 8}


def _pipeline_inputs(case: str, batch: int, size: int) -> dict:
    """One forward's inputs as diffusers' pipelines make them for each case, by hand (not kinds.unet_inputs)."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    h = size // 8
    out = {"sample": r(batch, 4, h, h), "timestep": torch.full((batch,), 500), "encoder_hidden_states": r(batch, 77, 32)}
    extra = {
        "num_class_embeds": {"class_labels": torch.zeros(batch, dtype=torch.int64)},
        "class_timestep": {"class_labels": torch.full((batch,), 10)},
        "class_projection": {"class_labels": r(batch, 16)},
        "add_text": {},
        "add_text_image": {"added_cond_kwargs": {"image_embeds": r(batch, 32), "text_embeds": r(batch, 32)}},
        "add_image": {"added_cond_kwargs": {"image_embeds": r(batch, 48)}, "encoder_hidden_states": None},
        "add_image_hint": {"added_cond_kwargs": {"image_embeds": r(batch, 48), "hint": r(batch, 3, size, size)},
                           "encoder_hidden_states": None},  # Kandinsky 2.2's pipelines: the image embedding alone
        "text_proj": {"encoder_hidden_states": r(batch, 77, 48)},
        "simple": {},
        "gligen": {"cross_attention_kwargs": {"gligen": {"boxes": r(batch, 30, 4), "positive_embeddings":
                                                         r(batch, 30, 32), "masks": torch.ones(batch, 30)}}},
        "tuple_same": {},
    }
    return {**out, **extra[case]}


CASES = {"num_class_embeds": {"num_class_embeds": 10}, "class_timestep": {"class_embed_type": "timestep"},
         "class_projection": {"class_embed_type": "projection", "projection_class_embeddings_input_dim": 16},
         "add_text": {"addition_embed_type": "text", "addition_embed_type_num_heads": 4},
         "add_text_image": {"addition_embed_type": "text_image"},
         "add_image": {"addition_embed_type": "image", "encoder_hid_dim": 48, "encoder_hid_dim_type": "image_proj"},
         "add_image_hint": {"addition_embed_type": "image_hint", "encoder_hid_dim": 48,
                            "encoder_hid_dim_type": "image_proj", "in_channels": 8},
         "text_proj": {"encoder_hid_dim_type": "text_proj", "encoder_hid_dim": 48},
         "simple": SIMPLE, "gligen": {"attention_type": "gated"}, "tuple_same": {"cross_attention_dim": [32] * 4}}


@pytest.mark.parametrize("case", list(CASES))
def test_each_shape_of_config_plans_the_calls_its_pipeline_makes(tmp_path, case):
    """The planner's calls (meta device, attnprof's own inputs from the config) equal those of a real forward of the
    same config fed by hand as its pipeline feeds it: kinds, batch, heads, head dims and tokens of queries and keys
    (GLIGEN's gated self-attention over the positions and its 30 boxes; SimpleCrossAttn's keys: 77 tokens and the
    positions)."""
    path = _tiny(tmp_path, case, **CASES[case])
    planned = plan(path, 64, 64, 2, "float32")["blocks"]
    unet = models.build(path, "random", dtype="float32")
    with torch.no_grad(), Recorder(unet) as rec:
        unet(**_pipeline_inputs(case, 2, 64))
    fields = ("block", "kind", "batch", "heads", "head_dim", "tokens_q", "tokens_k")
    assert [{k: r[k] for k in fields} for r in planned] == [{k: r[k] for k in fields} for r in rec.rows]
    if case == "simple":
        assert {r["kind"] for r in planned} == {"added-kv"} and all(r["tokens_k"] == 77 + r["tokens_q"]
                                                                    for r in planned)
    if case == "gligen":
        gated = [r for r in planned if ".fuser." in r["block"]]
        assert len(gated) == 16 and all(r["tokens_q"] == r["tokens_k"] for r in gated)
        assert {r["tokens_q"] for r in gated} == {64 + 30, 16 + 30, 4 + 30, 1 + 30}


def test_cross_widths_that_differ_per_block_are_refused_before_anything_is_built(tmp_path, capsys):
    path = _tiny(tmp_path, "widths", cross_attention_dim=[32, 48, 32, 32])
    out = tmp_path / "results"
    assert main(["run", "--model", path, "--size", "64x64", "--device", "cpu", "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cross_attention_dim [32, 48, 32, 32]: widths that differ per block" in err[0]
    assert not out.exists() or not list(out.iterdir())
    with pytest.raises(InputError, match="attention_type 'gated-text-image'"):
        models.resolve(_tiny(tmp_path, "gti", attention_type="gated-text-image"))


def test_added_kv_attention_takes_naive_and_sdpa_and_refuses_the_rest(tmp_path):
    """A SimpleCrossAttn U-Net: naive and sdpa (their AttnAddedKV processors) measured within the tolerance of the
    reference, which runs the model's own processors; sliced refused before it runs, with the reason; and a backend
    run wrongly (plain AttnProcessor2_0 on the added-KV modules, whose widths agree here) is caught by the
    reference."""
    from profiler.execute.grid import Sweep
    from profiler.execute.sweep import execute
    from profiler.measure.cell import ModelCache, measure_cell
    from profiler.store import Run

    path = _tiny(tmp_path, "simple", **SIMPLE, cross_attention_dim=64)  # the widths of its attention levels
    sweep = Sweep(models=(path,), sizes=((64, 64),), dtypes=("float32",), device="cpu", repeats=1, warmup=0,
                  backends=(("naive", ()), ("sdpa", ()), ("sliced", ())), out=str(tmp_path / "r"))
    cells = Run.open(execute(sweep, workers=False, progress=False).run_path).cells().set_index("backend")
    assert cells.loc["naive", "status"] == cells.loc["sdpa", "status"] == "ok"
    assert cells.loc["naive", "error_ok"] and cells.loc["sdpa", "error_ok"]
    assert cells.loc["sliced", "status"] == "unavailable" and "cannot stand in for a SimpleCrossAttn block's " \
        "added-KV attention" in cells.loc["sliced", "error"]
    assert backends.BACKENDS["sdpa-flash"].added_kv and not backends.BACKENDS["subquad"].added_kv

    import profiler.attention.recorder as recorder_module

    def wrong(processor, attn):  # every module gets AttnProcessor2_0, whatever its attention
        from diffusers.models.attention_processor import AttnProcessor2_0

        return AttnProcessor2_0() if getattr(attn, "added_kv_proj_dim", None) else processor

    spec = sweep.cells()[1]  # sdpa
    cache = ModelCache()
    cache.reference(spec)  # the reference first, with the model's own processors
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(recorder_module, "for_module", wrong, raising=False)
        import profiler.attention.processor as processor_module

        mp.setattr(processor_module, "for_module", wrong)
        cell, _ = measure_cell(spec, cache, repeats=1, warmup=0)
    assert not cell["error_ok"] and cell["max_rel_err"] > 0.05


# ---- a new kind: one record and its config

def test_a_new_kind_is_one_record_and_every_command_knows_it(tmp_path, capsys):
    """ModelScope's text-to-video U-Net (UNet3DConditionModel) as a kind of its own: its record (class, keys, how it
    is made and fed, its temporal attention's path) and a tiny config; then plan, run and show take it, its frames
    a setting, its temporal calls named."""
    import diffusers

    def inputs(model, s: kinds.Shape, settings: dict) -> dict:
        make = kinds._maker(model, s.seed)
        return {"sample": make(s.batch, 4, s.frames, s.height // 8, s.width // 8),
                "timestep": kinds._timestep(model, s.batch), "encoder_hidden_states": make(s.batch, s.tokens, 32)}

    kinds.register(kinds.Kind("t2v", "UNet3DConditionModel", "a text-to-video U-Net (ModelScope)",
                              ("down_block_types", "up_block_types", "block_out_channels"),
                              lambda config: diffusers.UNet3DConditionModel.from_config(config), inputs, frames=True,
                              temporal=("temp_attentions.", "transformer_in.")))
    try:
        path = tmp_path / "tiny-t2v.yaml"
        path.write_text(yaml.safe_dump({"name": "tiny-t2v", "t2v": {
            "block_out_channels": [32, 64], "down_block_types": ["CrossAttnDownBlock3D", "DownBlock3D"],
            "up_block_types": ["UpBlock3D", "CrossAttnUpBlock3D"], "cross_attention_dim": 32, "norm_num_groups": 8,
            "attention_head_dim": 8, "layers_per_block": 1}}))
        assert main(["plan", "--model", str(path), "--size", "64x64", "--frames", "4", "--dtype", "float32"]) == 0
        planned = capsys.readouterr().out
        assert "temporal" in planned and "4 frames" in planned
        assert main(["run", "--model", str(path), "--size", "64x64", "--frames", "4", "--device", "cpu",
                     "--backend", "sdpa", "--repeats", "1", "--warmup", "0", "--in-process", "--quiet",
                     "--out", str(tmp_path / "r")]) == 0
        assert main(["show", "latest", "--results", str(tmp_path / "r")]) == 0
        shown = " ".join(capsys.readouterr().out.split())
        assert "(over the frames at each position: 10 of 18 calls) took sdpa" in shown and "4 frames" in shown
    finally:
        kinds.KINDS.pop("t2v")
