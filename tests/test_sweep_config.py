"""The sweep loader: every shipped YAML validates; each bad config is one line naming the file, the key and the fix."""
import math
from pathlib import Path

import pytest

from profiler.unet import models
from profiler.cli import main
from profiler.execute.grid import load

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("sweeps/*.yaml")), ids=lambda p: p.name)
def test_every_shipped_sweep_validates(path):
    sweep = load(path)
    assert sweep.models and sweep.sizes and sweep.backends
    if sweep.device in ("cpu", "auto"):  # every grid's cells, each once (a setting multiplies its grid)
        n = sum(len(g.models) * len(g.sizes) * len(g.batch) * len(g.dtypes) * len(g.backends)
                * math.prod(len(v) for _, v in g.model_settings) for g in (sweep, *sweep.also))
        assert len({c.cell_id for c in sweep.cells()}) == len(sweep.cells()) == n


# the attention modules of each shipped model (hand counts): SD 1.x / 2.x U-Nets 32, SDXL base 140, the refiner 88
# (4 layers at two levels and the mid block), their ControlNets the down and mid blocks' 14 and 68, a VAE its two mid
# blocks' 2, AnimateDiff SD 1.5's 32 spatial and 40 temporal (20 motion modules), its SDXL 140 + 30 (15 modules),
# SVD 16 spatio-temporal transformers of 4, Kandinsky 2.2's 22 SimpleCrossAttn blocks
ATTENTIONS = {"sd15": 32, "sd15-inpainting": 32, "sd21-base": 32, "sd21-768-v": 32, "tiny-sd15": 32, "sdxl-base": 140,
              "tiny-sdxl": 140, "sdxl-refiner": 88, "sd15-controlnet": 14, "tiny-sd15-controlnet": 14,
              "sdxl-controlnet": 68, "sd15-vae": 2, "sdxl-vae": 2, "tiny-vae": 2, "animatediff-sd15": 72,
              "tiny-animatediff": 72, "animatediff-sdxl": 170, "svd-xt": 64, "tiny-svd": 64, "kandinsky22-decoder": 22}


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("models/*.yaml")), ids=lambda p: p.name)
def test_every_shipped_model_config_builds_on_meta(path):
    model = models.build(models.resolve(path.stem), weights="meta")
    assert len(model.attn_processors) == ATTENTIONS[path.stem]


GOOD = """models: [tiny-sd15]
sizes: [64x64]
backends: [naive, {sliced: {slice_size: 2}}]
dtypes: [float32]
device: cpu
"""


def test_a_good_config_gives_the_grid(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(GOOD + "batch: [1, 2]\nmemory_budget: 2GiB\ntimeout_s: 30\nrepeats: 2\nwarmup: 0\n")
    sweep = load(path)
    cells = sweep.cells()
    assert len(cells) == 4 and sweep.memory_budget == 2 * 2**30 and sweep.timeout_s == 30.0
    sliced = [c for c in cells if c.backend == "sliced"][0]
    assert sliced.options == {"slice_size": 2}
    assert len({c.cell_id for c in cells}) == 4


def test_backends_in_the_mapping_form_the_docs_give(tmp_path):
    """docs/backends.md: `backends: {sliced: {slice_size: 4}}`, each name a key with its options (or none)."""
    path = tmp_path / "s.yaml"
    path.write_text(GOOD.replace("backends: [naive, {sliced: {slice_size: 2}}]",
                                 "backends: {sliced: {slice_size: 4}, naive: null, sdpa: {}}"))
    cells = load(path).cells()
    assert [(c.backend, c.options) for c in cells] == [("sliced", {"slice_size": 4}), ("naive", {}), ("sdpa", {})]


@pytest.mark.parametrize("extra, message", [
    ("colour: blue\n", "unknown key 'colour': the keys are models, sizes"),
    ("size: [64x64]\n", "unknown key 'size' (did you mean 'sizes'?): the keys are models, sizes"),
    ("sizes: [640x48x]\n", "key 'sizes': malformed size '640x48x'"),
    ("sizes: [500x500]\n", "key 'sizes': size '500x500': width 500 is not a positive multiple of 8"),
    ("sizes: 512x512\n", "key 'sizes' must be a non-empty list of WxH strings, not '512x512'"),
    ("sizes: [512]\n", "key 'sizes' must be a list of WxH strings"),
    ("batch: [0]\n", "key 'batch': batch 0 is below 1"),
    ("batch: ['2']\n", "key 'batch' must be a list of whole numbers"),
    ("dtypes: [float8]\n", "key 'dtypes': unknown dtype 'float8'"),
    ("backends: [nope]\n", "key 'backends': unknown backend 'nope'"),
    ("backends: [{sliced: {slice_sz: 2}}]\n", "key 'backends'"),
    ("backends: [{sliced: 2}]\n", "options of 'sliced' must be a mapping"),
    ("repeats: three\n", "key 'repeats' must be a whole number >= 1"),
    ("warmup: -1\n", "key 'warmup' must be a whole number >= 0"),
    ("device: gpu\n", "device 'gpu' is not auto, cpu, cuda or cuda:N"),
    ("memory_budget: lots\n", "key 'memory_budget': 'lots' is not a size"),
    ("timeout_s: 0\n", "key 'timeout_s' must be a positive number"),
    ("out: [a]\n", "key 'out' must be a folder path"),
])
def test_bad_configs_are_rejected_before_any_model_is_built(tmp_path, capsys, extra, message):
    path = tmp_path / "bad.yaml"
    path.write_text(GOOD.replace(extra.split(":")[0] + ":", "#") + extra if extra.split(":")[0] in GOOD
                    else GOOD + extra)
    results = tmp_path / "results"
    code = main(["sweep", str(path), "--out", str(results), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2
    assert str(path) in err and message in err, err
    assert len(err.strip().splitlines()) == 1
    assert not results.exists()  # nothing was built or stored


@pytest.mark.parametrize("content, message", [
    ("models: [tiny-sd15\n", "not valid YAML at line 2, column 1"),
    ("models: [tiny-sd15]\nsizes: [64x64]\n  backends: [sdpa]\n", "not valid YAML at line 3, column 3 (expected "),
    ("- tiny-sd15\n", "expected a mapping of keys"),
    ("sizes: [64x64]\n", "key 'models' is missing"),
    ("models: [sd14]\n", "key 'models': unknown model 'sd14'"),
])
def test_bad_config_files(tmp_path, capsys, content, message):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    assert main(["sweep", str(path), "--quiet"]) == 2
    assert message in capsys.readouterr().err


def test_missing_config_file(capsys):
    assert main(["sweep", "configs/sweeps/nope.yaml"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_setting_is_one_entry_that_the_flags_and_the_labels_read():
    """spec.SETTINGS holds what the code knows of a model's setting (its kind, default, what it takes, how a value
    reads, its words): each reads its own default back; attnprof run and plan have a flag for each (a new setting
    without one fails here)."""
    import argparse

    from profiler.cli import build_parser
    from profiler.spec import SETTINGS, settings_label

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    for command in ("run", "plan"):
        assert set(SETTINGS) <= {a.dest for a in commands[command]._actions}, command
    assert {n: s.read(s.default) for n, s in SETTINGS.items()} == {n: s.default for n, s in SETTINGS.items()}
    assert settings_label('{"vae_part": "encoder", "controlnet": true, "tome": 0.5}') == \
        "controlnet, tome 0.5, vae encoder"


def test_vae_upcast_defaults_to_the_vae_configs_force_upcast():
    """A setting whose default comes from the model's config (its entry's config_key): the SDXL VAE's config says
    force_upcast, so an upcast is its default (a cell's key leaves it out) and no upcast is the setting kept; the SD 1.5
    VAE's the other way round."""
    from profiler.unet.workload import Workload, check_settings

    assert Workload("sdxl-vae").settings["vae_upcast"] is True and Workload("sd15-vae").settings["vae_upcast"] is False
    assert check_settings("sdxl-vae", {"vae_upcast": "true"}) == ()
    assert check_settings("sdxl-vae", {"vae_upcast": False}) == (("vae_upcast", False),)
    assert check_settings("sd15-vae", {"vae_upcast": True}) == (("vae_upcast", True),)
