"""The public facts of ../shared/DESIGN.md, on full-size models built on the meta device."""
import pytest
import torch

from profiler.unet import models
from profiler.planner import plan
from profiler.spec import InputError


@pytest.mark.parametrize("name, total_m, share", [("sd15", 859.52, 31.1), ("sdxl-base", 2567.46, 86.0)])
def test_parameter_counts_and_transformer_share(name, total_m, share):
    counts = plan(name, 512, 512)["totals"]
    assert round(counts["params_total"] / 1e6, 2) == total_m
    assert round(100 * counts["share_transformer_blocks"], 1) == share
    assert 0 < counts["params_attention"] < counts["params_transformer_blocks"]


@pytest.mark.parametrize("name, calls", [("sd15", 32), ("sd21-base", 32), ("sdxl-base", 140)])
def test_attention_calls_per_forward(name, calls):
    t = plan(name, 512, 512)["totals"]
    assert (t["calls"], t["calls_self"], t["calls_cross"]) == (calls, calls // 2, calls // 2)


def test_sd15_tokens_per_level_and_score_table():
    rows = plan("sd15", 512, 512, dtype="float32")["blocks"]
    tokens = {(r["stage"], r["level"]): r["tokens_q"] for r in rows}
    assert tokens[("down", 0)] == tokens[("up", 0)] == 64 * 64 == 4096
    assert tokens[("down", 1)] == 1024 and tokens[("down", 2)] == 256 and tokens[("mid", 3)] == 64
    first = rows[0]
    assert first["block"] == "down_blocks.0.attentions.0.transformer_blocks.0.attn1"
    assert (first["kind"], first["heads"], first["head_dim"], first["tokens_k"]) == ("self", 8, 40, 4096)
    assert first["score_elements"] // first["heads"] == 16_777_216
    assert first["score_bytes"] == 16_777_216 * 8 * 4
    assert first["flops"] == 4 * 8 * 4096 * 4096 * 40
    cross = rows[1]
    assert (cross["kind"], cross["tokens_k"]) == ("cross", 77)


def test_doubling_the_side_gives_4x_tokens_16x_scores():
    small, big = plan("sd15", 512, 512)["blocks"], plan("sd15", 1024, 1024)["blocks"]
    for a, b in zip(small, big, strict=True):
        assert b["tokens_q"] == 4 * a["tokens_q"]
        if a["kind"] == "self":
            assert b["score_elements"] == 16 * a["score_elements"]


def test_non_square_sdxl_bucket():
    rows = plan("sdxl-base", 832, 1216)["blocks"]
    assert max(r["tokens_q"] for r in rows) == 52 * 76  # level 1 of 104x152 latent
    assert min(r["tokens_q"] for r in rows) == 26 * 38


@pytest.mark.parametrize("full, tiny", [("sd15", "tiny-sd15"), ("sdxl-base", "tiny-sdxl")])
def test_tiny_models_keep_the_real_topology(full, tiny):
    keys = ("block", "stage", "level", "kind", "heads", "tokens_q", "score_elements", "score_bytes")
    a, b = plan(full, 768, 512)["blocks"], plan(tiny, 768, 512)["blocks"]
    assert [tuple(r[k] for k in keys) for r in a] == [tuple(r[k] for k in keys) for r in b]
    assert plan(tiny, 512, 512)["totals"]["params_total"] < 50e6


def test_meta_build_allocates_no_weights():
    unet = models.build("sdxl-base", weights="meta")
    assert all(p.device.type == "meta" for p in unet.parameters())


def test_random_build_is_seeded_and_finite(tiny_sd15):
    again = models.build("tiny-sd15", weights="random", dtype="float32")
    for (n, p), (_, q) in zip(tiny_sd15.named_parameters(), again.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    with torch.no_grad():
        out = tiny_sd15(**models.example_inputs(tiny_sd15, 1, 64, 64)).sample
    assert out.shape == (1, 4, 8, 8) and torch.isfinite(out).all() and out.std() > 0


@pytest.mark.parametrize("sub", [None, "unet"])
def test_real_checkpoint_loads_from_a_saved_folder(tmp_path, tiny_sd15, sub):
    target = tmp_path / sub if sub else tmp_path
    tiny_sd15.save_pretrained(target, safe_serialization=True)
    assert (target / "diffusion_pytorch_model.safetensors").is_file()
    loaded = models.build(str(tmp_path), weights="pretrained", dtype="float32")
    inputs = models.example_inputs(tiny_sd15, 1, 64, 64)
    for (name, p), (_, q) in zip(loaded.named_parameters(), tiny_sd15.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    with torch.no_grad():  # same weights; summation order may differ in the last bits
        torch.testing.assert_close(loaded(**inputs).sample, tiny_sd15(**inputs).sample, rtol=1e-5, atol=1e-5)
    assert plan(str(tmp_path), 512, 512)["totals"]["calls"] == 32


def test_a_folder_holding_only_the_fp16_variant_loads_it(tmp_path, tiny_sd15):
    half = models.build("tiny-sd15", weights="random", dtype="float16")
    half.save_pretrained(tmp_path / "unet", safe_serialization=True, variant="fp16")
    assert sorted(p.name for p in (tmp_path / "unet").iterdir()) == ["config.json",
                                                                     "diffusion_pytorch_model.fp16.safetensors"]
    assert models.resolve(str(tmp_path)).variant == "fp16"
    loaded = models.build(str(tmp_path), weights="pretrained", dtype="float32")
    for (name, p), (_, q) in zip(loaded.named_parameters(), tiny_sd15.named_parameters(), strict=True):
        assert p.dtype == torch.float32 and torch.equal(p, q.half().float()), name  # the fp16 file's values
    tiny_sd15.save_pretrained(tmp_path / "unet", safe_serialization=True)  # beside it, the plain file wins
    assert models.resolve(str(tmp_path)).variant is None


@pytest.mark.parametrize("save, found", [({"safe_serialization": False}, "holds only diffusion_pytorch_model.bin"),
                                         (None, "holds no weights")])
def test_a_folder_without_safetensors_weights_is_refused_naming_what_it_holds(tmp_path, tiny_sd15, save, found):
    if save:
        tiny_sd15.save_pretrained(tmp_path, **save)
    else:
        tiny_sd15.save_config(tmp_path)
    with pytest.raises(InputError) as e:
        models.resolve(str(tmp_path))
    assert str(e.value) == (f"model folder {tmp_path} {found}: attnprof loads the U-Net's weights from "
                            "diffusion_pytorch_model.safetensors (or a variant such as diffusion_pytorch_model.fp16"
                            ".safetensors); re-save the model with save_pretrained(folder, safe_serialization=True)")


def test_config_only_model_has_no_real_weights():
    with pytest.raises(InputError, match="config only"):
        models.build("sd15", weights="pretrained")


@pytest.mark.parametrize("content, message", [
    ("unet: {foo: 1}", "does not describe a U-Net .UNet2DConditionModel: it lacks down_block_types"),
    ("just text", "describes no model: expected a top-level mapping named by its kind, one of unet:, vae:, "
                  "controlnet:, animatediff:, svd:"),
    ("unet: [1, 2", "not valid YAML at line 1, column 12"),
    ("vae: {block_out_channels: [8]}", "does not describe a VAE .AutoencoderKL: it lacks down_block_types"),
    ("animatediff: {unet: tiny-vae}", "animatediff.unet must name a U-Net of the registry, not 'tiny-vae'"),
    ("controlnet: {unet: sd99}", "controlnet.unet must name a U-Net of the registry, not 'sd99'"),
])
def test_bad_model_files(tmp_path, content, message):
    path = tmp_path / "m.yaml"
    path.write_text(content)
    with pytest.raises(InputError, match=message):
        models.resolve(str(path))


def test_folder_with_another_models_config(tmp_path):
    """A folder's config names its class: one attnprof builds is read as its kind (a VAE's config must then hold a
    VAE's keys); one of another class is refused naming it and the classes it takes."""
    (tmp_path / "config.json").write_text('{"_class_name": "SD3Transformer2DModel", "num_layers": 24}')
    with pytest.raises(InputError, match="its class is SD3Transformer2DModel.*UNetMotionModel"):
        models.resolve(str(tmp_path))
    (tmp_path / "config.json").write_text('{"_class_name": "AutoencoderKL", "block_out_channels": [1]}')
    with pytest.raises(InputError, match="does not describe a VAE .AutoencoderKL: it lacks down_block_types"):
        models.resolve(str(tmp_path))


@pytest.mark.parametrize("typed, meant", [("sdxl", "sdxl-base"), ("sd-15", "sd15"), ("tiny-vea", "tiny-vae")])
def test_an_unknown_name_suggests_the_nearest_known_one(typed, meant):
    with pytest.raises(InputError, match=f"unknown model '{typed}': did you mean {meant}\\? known models are "):
        models.resolve(typed)


def _hub_cache(root, repo_id: str, config: dict) -> None:
    """A Hugging Face hub cache holding one repository's unet/config.json, laid out as huggingface_hub lays it."""
    import json

    repo = root / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    (repo / "snapshots" / ("0" * 40) / "unet").mkdir(parents=True)
    (repo / "snapshots" / ("0" * 40) / "unet" / "config.json").write_text(json.dumps(config))


def test_a_cached_hub_id_resolves_from_the_cache_without_the_hub(tmp_path, monkeypatch):
    from huggingface_hub import constants

    config = models.resolve("tiny-sd15").config
    _hub_cache(tmp_path, "someone/tiny-unet", {"_class_name": "UNet2DConditionModel", **config})
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    source = models.resolve("someone/tiny-unet")
    assert (source.config, source.weights, source.subfolder) == (config, "someone/tiny-unet", "unet")


@pytest.mark.parametrize("offline, message", [(True, "HF_HUB_OFFLINE is set"),
                                              (False, r"the hub \(http://127.0.0.1:9\) cannot be reached")])
def test_an_uncached_hub_id_fails_at_once_with_one_line(tmp_path, monkeypatch, offline, message):
    """No retries: offline it is refused from the cache alone; online, one request to a hub that does not answer."""
    import time

    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens there
    started = time.monotonic()
    with pytest.raises(InputError, match=f"model 'someone/not-cached' is not in the local Hugging Face cache and "
                                         f"{message}.*give a local diffusers folder") as e:
        models.resolve("someone/not-cached")
    assert time.monotonic() - started < 10 and "\n" not in str(e.value)
