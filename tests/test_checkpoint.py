"""Single-file checkpoints (profiler/unet/checkpoint.py): the LDM names of our U-Nets against diffusers' own conversion,
a tiny U-Net written in the original layout and loaded back, detection and planning from headers alone (real key
names and shapes: full-size U-Nets built on the meta device from configs/models, mapped to LDM names, with the few
text-encoder keys diffusers' detector looks at), the kinds refused, pickles, and what a run records."""
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint
from safetensors.torch import save_file

from profiler.unet import checkpoint, models
from profiler.cli import main
from profiler.planner import plan
from profiler.spec import InputError

PREFIX = checkpoint.PREFIX
# the keys of a whole pipeline's text encoders (and VAE) that diffusers' detector reads, with their real shapes
TEXT = {
    "sd15": {"cond_stage_model.transformer.text_model.embeddings.position_embedding.weight": (77, 768),
             "first_stage_model.decoder.conv_out.weight": (3, 128, 3, 3)},
    "sd21-base": {"cond_stage_model.model.token_embedding.weight": (49408, 1024),
                  "cond_stage_model.model.positional_embedding": (77, 1024)},
    "sdxl-base": {"conditioner.embedders.0.transformer.text_model.embeddings.position_embedding.weight": (77, 768),
                  "conditioner.embedders.1.model.positional_embedding": (77, 1280),
                  "conditioner.embedders.1.model.transformer.resblocks.9.mlp.c_proj.bias": (1280,)},
}


def header_only(path: Path, shapes: dict) -> Path:
    """A safetensors header declaring fp16 tensors of these shapes, and no data after it: not a loadable file (its
    data offsets point past its end), so whatever reads it reads the header alone."""
    doc, offset = {}, 0
    for name, shape in shapes.items():
        size = 2 * math.prod(shape)
        doc[name] = {"dtype": "F16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(doc).encode()
    path.write_bytes(len(blob).to_bytes(8, "little") + blob)
    return path


def ldm_header(config: dict, extra: dict | None = None, prefix: str = PREFIX) -> dict:
    """{LDM name: shape} of the U-Net of a config, as a whole-pipeline file (prefix) or a U-Net alone ('') holds it."""
    return {**{prefix + k: s for k, s in checkpoint.ldm_shapes(config).items()}, **(extra or {})}


@pytest.mark.parametrize("name", ["tiny-sd15", "sd15", "sd21-base", "sdxl-base"])
def test_ldm_names_are_the_inverse_of_diffusers_conversion(name):
    source = models.resolve(name)
    state = models.build(source, "meta").state_dict()
    ldm = checkpoint.ldm_state_dict(state, source.config)
    assert len(ldm) == len(state)  # no two tensors under one LDM name
    back = convert_ldm_unet_checkpoint(ldm, source.config)
    assert set(back) == set(state)
    assert all(back[k] is state[k] for k in state)


def _tiny_file(path: Path, prefix: str = PREFIX) -> dict:
    source = models.resolve("tiny-sd15")
    state = {k: v.contiguous() for k, v in models.build(source, "random", seed=7).state_dict().items()}
    save_file(checkpoint.ldm_state_dict(state, source.config, prefix), str(path))
    return state


@pytest.mark.parametrize("prefix", [PREFIX, ""], ids=["whole-pipeline-names", "unet-alone"])
def test_tiny_checkpoint_loads_back_the_weights_written(tmp_path, prefix):
    path = tmp_path / "tiny.safetensors"
    written = _tiny_file(path, prefix)
    source = models.resolve(str(path))
    found = source.checkpoint
    assert (found.model_type, found.kind, found.config_name) == ("v1", "SD 1.x", "tiny-sd15")
    assert source.config == models.resolve("tiny-sd15").config
    assert found.bytes == path.stat().st_size and len(found.header_sha256) == 64
    loaded = models.build(source, "pretrained", dtype="float32").state_dict()
    assert set(loaded) == set(written)
    assert all(torch.equal(loaded[k], written[k]) for k in written)
    assert models.build(source, "pretrained", dtype="bfloat16").dtype == torch.bfloat16


KINDS = [  # (registry config, its changes, text encoder keys of, what the file is, its diffusers name)
    ("sdxl-base", {}, "sdxl-base", "SDXL base", "xl_base"),
    ("sd15", {}, "sd15", "SD 1.x", "v1"),
    ("sd21-base", {}, "sd21-base", "SD 2.x", "v2"),
    ("sd15", {"in_channels": 9}, "sd15", "SD 1.x inpainting", "inpainting"),
    ("sdxl-base", {}, None, "SDXL base", "xl_base"),  # a U-Net alone: no text encoder keys to tell it by
    ("sdxl-refiner", {}, None, "SDXL refiner", "xl_refiner"),  # told by its added embedding: 2560 wide
]


@pytest.mark.parametrize("name, changes, text, kind, model_type", KINDS,
                         ids=["sdxl", "sd15", "sd21", "sd15-inpainting", "sdxl-unet-alone", "sdxl-refiner"])
def test_a_header_alone_names_the_model_and_plans_as_its_config(tmp_path, name, changes, text, kind, model_type):
    config = {**models.resolve(name).config, **changes}
    path = header_only(tmp_path / "model.safetensors", ldm_header(config, TEXT.get(text), PREFIX if text else ""))
    with pytest.raises(Exception):  # not loadable: it has no weights, so planning it reads the header alone
        from safetensors import safe_open
        safe_open(str(path), framework="pt")
    source = models.resolve(str(path))
    assert (source.checkpoint.kind, source.checkpoint.model_type, source.checkpoint.config_name) == \
        (kind, model_type, name)
    assert source.config == config
    assert source.checkpoint.unet_only == (text is None)
    size = (1024, 1024) if name.startswith("sdxl") else (512, 512)  # the refiner: its per-block figures too
    mine, theirs = plan(str(path), *size), plan(name, *size)
    assert mine["model_file_kind"] == kind
    assert mine["blocks"] == theirs["blocks"] and mine["totals"]["flops_total"] == theirs["totals"]["flops_total"]


def test_cli_plan_of_an_sdxl_header_names_it_and_prints_sdxl_base_figures(tmp_path, capsys):
    path = header_only(tmp_path / "sd_xl_base_1.0.safetensors", ldm_header(models.resolve("sdxl-base").config,
                                                                            TEXT["sdxl-base"]))
    assert main(["plan", "--model", str(path), "--size", "1024x1024"]) == 0
    mine = capsys.readouterr().out.splitlines()
    assert main(["plan", "--model", "sdxl-base", "--size", "1024x1024"]) == 0
    theirs = capsys.readouterr().out.splitlines()
    assert mine[0].startswith(f"{path} (SDXL base, single file sd_xl_base_1.0.safetensors; U-Net config sdxl-base) "
                              "at 1024x1024")
    assert mine[1:] == theirs[1:] and len(mine) > 100


def _controlnet_header() -> dict:
    """An A1111 ControlNet file: the U-Net's down half under control_model., its hint encoder and zero convs."""
    half = {k: s for k, s in checkpoint.ldm_shapes(models.resolve("sd15").config).items()
            if k.startswith(("time_embed", "input_blocks", "middle_block"))}
    return {**{f"control_model.{k}": s for k, s in half.items()}, "control_model.input_hint_block.0.weight":
            (16, 3, 3, 3), "control_model.zero_convs.0.0.weight": (320, 320, 1, 1),
            "control_model.middle_block_out.0.weight": (1280, 1280, 1, 1)}


def _upscaler_header() -> dict:
    """The SD x4 upscaler's U-Net: 7 input channels, levels 256, 512, 512, 1024 wide (a skip connection into the
    last level, input_blocks.10, by which diffusers tells it)."""
    config = {**models.resolve("sd21-base").config, "in_channels": 7, "block_out_channels": [256, 512, 512, 1024],
              "down_block_types": ["DownBlock2D"] + ["CrossAttnDownBlock2D"] * 3,
              "up_block_types": ["CrossAttnUpBlock2D"] * 3 + ["UpBlock2D"], "attention_head_dim": 8}
    return ldm_header(config)


@pytest.mark.parametrize("shapes, what", [
    (_controlnet_header, "is a ControlNet (diffusers calls it 'controlnet')"),
    (_upscaler_header, "is the SD x4 upscaler (diffusers calls it 'upscale')"),
    (lambda: {f"{PREFIX}joint_blocks.37.x_block.mlp.fc1.weight": (9728, 2432)}, "is SD 3.5 (a DiT)"),
], ids=["controlnet", "upscaler", "dit"])
def test_a_kind_attnprof_does_not_profile_gets_one_line_and_exit_2(tmp_path, capsys, shapes, what):
    path = header_only(tmp_path / "other.safetensors", shapes())
    assert main(["plan", "--model", str(path), "--size", "512x512"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and what in err and "give an SD 1.x, SD 2.x or SDXL base or refiner checkpoint" in err


def test_a_unet_unlike_every_config_is_named_by_its_first_difference(tmp_path):
    shapes = ldm_header(models.resolve("sd15").config, TEXT["sd15"])
    shapes[f"{PREFIX}middle_block.1.proj_in.weight"] = (1280, 1280)  # linear where SD 1.5 has a 1x1 conv
    with pytest.raises(InputError, match=r"does not match the sd15 config \(middle_block.1.proj_in.weight is "
                                         r"\[1280, 1280\] in the file, \[1280, 1280, 1, 1\] in the config\)"):
        models.resolve(str(header_only(tmp_path / "odd.safetensors", shapes)))


def test_not_a_safetensors_file_and_a_missing_file_get_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 64)
    assert main(["plan", "--model", str(bad)]) == 2
    assert "is not a safetensors file" in capsys.readouterr().err
    assert main(["plan", "--model", str(tmp_path / "none.safetensors")]) == 2
    assert "does not exist: check the path" in capsys.readouterr().err


def test_a_pickle_is_refused_without_allow_pickle_and_read_with_it(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(checkpoint.PICKLE_ENV, raising=False)
    source = models.resolve("tiny-sd15")
    state = models.build(source, "random", seed=1).state_dict()
    path = tmp_path / "tiny.ckpt"
    torch.save({"state_dict": checkpoint.ldm_state_dict(state, source.config)}, path)
    assert main(["plan", "--model", str(path), "--size", "64x64"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "loading a pickle can run any code it holds: give --allow-pickle" in err
    assert main(["plan", "--model", str(path), "--size", "64x64", "--allow-pickle"]) == 0
    assert "(SD 1.x, single file tiny.ckpt; U-Net config tiny-sd15)" in capsys.readouterr().out
    loaded = models.build(str(path), "pretrained").state_dict()
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    monkeypatch.delenv(checkpoint.PICKLE_ENV)  # read before, but not allowed now: refused again, not cached
    with pytest.raises(InputError, match="is a pickle"):
        models.resolve(str(path))


def test_a_sweep_config_takes_a_file_and_allow_pickle(tmp_path):
    from profiler.execute.grid import loads

    path = tmp_path / "tiny.safetensors"
    _tiny_file(path)
    sweep = loads(f"models: ['{path}']\nsizes: ['64x64']\nallow_pickle: false\n", "cfg")
    assert [c.model for c in sweep.cells("cpu")] == [str(path)]
    with pytest.raises(InputError, match="key 'allow_pickle' must be true or false, not 'yes'"):
        loads(f"models: ['{path}']\nallow_pickle: 'yes'\n", "cfg")


def test_run_of_a_tiny_checkpoint_ends_ok_and_records_the_file(tmp_path, capsys):
    from profiler.report.compare import compare
    from profiler.store import Run, list_runs

    path = tmp_path / "tiny.safetensors"
    _tiny_file(path)
    code = main(["run", "--model", str(path), "--device", "cpu", "--dtype", "float32", "--size", "64x64",
                 "--backend", "sdpa", "--repeats", "1", "--warmup", "0", "--in-process", "--quiet",
                 "--out", str(tmp_path / "results")])
    assert code == 0, capsys.readouterr()
    run = Run.open(list_runs(tmp_path / "results")[-1])
    cells = run.cells()
    facts = models.resolve(str(path)).checkpoint.facts()
    assert cells["status"].tolist() == ["ok"]
    assert cells.iloc[0][list(facts)].to_dict() == facts
    assert run.manifest()["model_files"] == {str(path): facts}
    from profiler.report.show import format_run
    assert f"model file {path}: SD 1.x (U-Net config tiny-sd15), 12.4 MiB, header sha256 " \
           f"{facts['model_header_sha256'][:16]}" in format_run(run)
    # the same file elsewhere is the same checkpoint: its cells match in diff and the dashboard's Compare page
    moved = cells.assign(model=str(tmp_path / "copy" / "tiny.safetensors"))
    assert len(compare(cells, moved)["matched"]) == 1
    other = moved.assign(model_header_sha256="0" * 64)
    assert len(compare(cells, other)["matched"]) == 0
    # its replay (each attention shape's kernel alone) records the file too
    assert main(["replay", run.id, "--results", str(tmp_path / "results"), "--device", "cpu", "--repeats", "1",
                 "--warmup", "0", "--out", str(tmp_path / "replays"), "--quiet"]) == 0
    replayed = Run.open(list_runs(tmp_path / "replays")[-1]).cells()
    assert replayed[list(facts)].drop_duplicates().to_dict("records") == [facts]
    shutil.rmtree(tmp_path / "results")


def test_fit_of_a_header_alone_answers_as_its_config(tmp_path, capsys):
    path = header_only(tmp_path / "tiny.safetensors", ldm_header(models.resolve("tiny-sd15").config))
    answers = []
    for model in (str(path), "tiny-sd15"):
        assert main(["fit", "--model", model, "--budget", "256MiB", "--backend", "sdpa", "--device", "cpu",
                     "--quiet", "--json"]) == 0
        answers.append({k: v for k, v in json.loads(capsys.readouterr().out).items() if k != "model"})
    assert answers[0] == answers[1] and answers[0]["backends"]
