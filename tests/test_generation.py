"""A whole generation's time before it runs (planner/generation.py), calibrated by recorded generations
(planner/calibration.py) or from a GPU's published figures and efficiencies (profiler/gpus.py), and the device
terms of the time model (planner/timing.py's Device: the cache, new pages). No verdict here depends on how fast this
machine is: the generations recorded are the data, and what is asserted is what the model makes of them."""
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from profiler import gpus
from profiler.cli import main
from profiler.measure.limits import device_key
from profiler.planner import calibration, timing
from profiler.planner.generation import GenerationSpec, generation_spec, pipeline_spec, predict_generation
from profiler.spec import InputError
from profiler.store import Run, list_runs

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("generate", REPO / "docs" / "examples" / "generate.py")
gen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen)


def test_a_generation_on_a_gpu_of_the_table_is_its_parts_each_named_with_its_source(capsys):
    """SD 1.5 at 512x512, 20 steps under guidance on an A100: the text encoder twice (prompt and negative prompt),
    20 U-Net forwards at batch 2, one VAE decode at batch 1; each part's kernels and host priced apart, the longer
    overlapped op by op (at least the longer), its bound; the total their sum, in seconds, and with CUDA graphs on the U-Net its kernels' alone;
    every part from the published figures and the kernel times of GPUs, said so; --json the same figures. Without
    guidance: the U-Net at batch 1, text once, fewer kernels."""
    args = ["plan", "--pipeline", "sd15", "--size", "512x512", "--steps", "20", "--gpu", "A100", "--host-us-per-op",
            "60"]  # a cloud machine's host per dispatched kernel (the published ones: 27 to 63 us)
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "20 x batch 2" in out and "2 x batch 1" in out and "predicted total:" in out
    assert "attention kernels fitted on NVIDIA H200 (13 cells), 1064 calls, carried to sm80" in " ".join(out.split())
    assert "A100-40GB's published figures" in out and "an estimate, not a measurement" in out
    assert "host-bound at batch 2 (the U-Net); with CUDA graphs on the U-Net about" in out
    assert "host: given (--host-us-per-op)" in out
    assert main([*args, "--json"]) == 0
    g = json.loads(capsys.readouterr().out)[0]
    parts = {p["part"]: p for p in g["parts"]}
    assert g["total_ms"] == pytest.approx(sum(p["total_ms"] for p in g["parts"])) == pytest.approx(1e3 * g["total_s"])
    assert parts["denoise"]["forwards"] == 20 and parts["denoise"]["batch"] == 2
    assert parts["denoise"]["total_ms"] == pytest.approx(20 * parts["denoise"]["each_ms"])
    assert parts["text"]["forwards"] == 2 and parts["decode"]["batch"] == 1
    assert 0 < g["attention_ms"] < parts["denoise"]["total_ms"] + parts["decode"]["total_ms"]
    for p in g["parts"][:-1]:  # every forward: at least the longer of its kernels and its host, which bounds it
        assert p["each_ms"] >= max(p["gpu_ms"], p["host_ms"]) and p["bound"] == ("host" if p["host_ms"] > p["gpu_ms"]
                                                                                 else "gpu")
    u = parts["denoise"]
    assert g["graph_total_ms"] == pytest.approx(g["total_ms"] - 20 * (u["each_ms"] - u["gpu_ms"]))
    # the U-Net's forward is the time model's on its own (attnprof plan --model sd15 --gpu A100 at batch 2)
    h = gpus.get("A100")
    p = timing.walked_plan("sd15", 512, 512, 2, "float16")
    t = timing.predict(p, "sdpa", {}, gpus.limits(h, "float16"),
                       calibration.published_calibration(h, "float16", host_us=60.0), h)
    assert u["each_ms"] == pytest.approx(t["predicted_forward_time_ms"])
    assert u["host_ms"] == pytest.approx(t["predicted_host_time_ms"]) and u["bound"] == "host"
    assert main([*args, "--guidance", "1", "--json"]) == 0
    one = {p["part"]: p for p in json.loads(capsys.readouterr().out)[0]["parts"]}
    assert one["denoise"]["batch"] == 1 and one["text"]["forwards"] == 1
    assert one["denoise"]["gpu_ms"] < u["gpu_ms"]


def test_a_generation_plan_refuses_bad_input_in_one_line(capsys):
    assert main(["plan", "--pipeline", "sd15", "--size", "512x512", "--steps", "0", "--gpu", "A100"]) == 2
    assert "at least one step" in capsys.readouterr().err
    assert main(["plan", "--pipeline", "sd15", "--frames", "16", "--size", "512x512", "--gpu", "A100"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "animatediff-sd15" in err
    assert main(["plan", "--pipeline", "sd-nope", "--size", "512x512", "--gpu", "A100"]) == 2
    assert capsys.readouterr().err.strip() == ("attnprof: error: unknown pipeline 'sd-nope': use sd15, sdxl, tiny-sd15, "
                                               "animatediff-sd15 (or sdxl-base for sdxl)")  # every one plan takes
    with pytest.raises(InputError, match="no ControlNet"):
        GenerationSpec("animatediff-sd15", 512, 512, controlnet=True)


def test_the_device_terms_cache_and_new_pages():
    """A working set of at most half the last-level cache moves at the cache's bandwidth, a larger one at the
    memory's; an op's output of at least fresh_min bytes pays for its new pages, a smaller one does not."""
    d = timing.Device(flops=1e12, bandwidth=1e10, cache_bytes=32e6, cache_bandwidth=1e11, new_page_bandwidth=4e9,
                      fresh_min=32 * 2**20)
    assert float(d.moved_ms(1e6, 16e6)) == pytest.approx(1e6 / 1e11 * 1e3)  # in the cache
    assert float(d.moved_ms(1e6, 17e6)) == pytest.approx(1e6 / 1e10 * 1e3)  # spilled
    ops = np.array([[0.0, 1e8, 40 * 2**20, 3], [0.0, 1e8, 16 * 2**20, 3]])  # (FLOPs, moved, new output, class)
    ms = d.ops_ms(ops)
    assert ms[0] - ms[1] == pytest.approx(40 * 2**20 / 4e9 * 1e3)
    assert timing.Device(1e12, 1e10).ops_ms(ops)[0] == pytest.approx(1e8 / 1e10 * 1e3)  # a GPU of the table: neither
    f = d.rest_features(ops)
    assert f["other"] == pytest.approx(ms.sum()) and f["ops"] == 2 and f["convolution"] == 0


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Two recorded generations of the tiny SD 1.5 pipeline, as profiler.profile stores them: 64x64 in 2 steps and
    96x64 in 3, each with sdpa."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("recorded")
    # in a process of their own, as a user's: this one may have kept its memory, timing cells (devices.keep_memory)
    subprocess.run([sys.executable, "-c", _RECORD, str(out)], check=True, cwd=REPO)
    return out


_RECORD = """
import sys
sys.path.insert(0, "docs/examples")
import generate as gen
from profiler import profile

pipe = gen.tiny_pipeline()
for size, width, steps in ((64, 64, 2), (64, 96, 3)):
    with profile(pipe, out=sys.argv[1], backend="sdpa"):
        gen.generate(pipe, steps=steps, size=size, width=width)
"""


def test_a_recorded_generation_is_calibration_data_for_each_component(recorded):
    """Its components matched to the registry's models by their configs (the tiny U-Net, VAE and CLIP), each
    forward's rest a sample of its own, each U-Net call one under sdpa (diffusers' loaded AttnProcessor2_0); the
    pipeline's own work the generation's wall time less its components' forwards."""
    runs = [Run.open(p) for p in list_runs(recorded)]
    assert len(runs) == 2
    configs = runs[0].manifest()["record"]["configs"]
    assert {c: calibration.named(v["class"], v["config"]) for c, v in configs.items()} == \
        {"unet": "tiny-sd15", "vae": "tiny-vae", "text_encoder": "tiny-clip"}
    calls, rests = calibration.record_samples(runs[0], runs[0].manifest())
    table, _ = runs[0].read()
    cell = table.iloc[0]
    assert len(calls) == 32 + 1  # the U-Net's calls (one forward's median) and the VAE's one
    assert sorted(r["component"] for r in rests) == ["generation", "text_encoder", "unet", "vae"]
    comps = json.loads(cell["components"])
    overhead = next(r for r in rests if r["component"] == "generation")
    assert overhead["overhead_ms"] == pytest.approx(cell["generation_s"] * 1e3 - sum(c["time_ms"] for c in comps))
    assert overhead["steps"] == cell["steps"] and overhead["pixels"] == cell["width"] * cell["height"]
    unet = next(r for r in rests if r["component"] == "unet")
    per_forward = next(c for c in comps if c["component"] == "unet")
    assert unet["rest_ms"] == pytest.approx((per_forward["time_ms"] - per_forward["attention_ms"]) / cell["steps"])
    spec = generation_spec(runs[0], runs[0].manifest(), cell.to_dict())
    assert (spec.pipeline, spec.width, spec.height, spec.steps, spec.backend, spec.batch) == \
        ("tiny-sd15", cell["width"], cell["height"], cell["steps"], "sdpa", 1)


def test_a_generation_predicted_from_recorded_ones(recorded, capsys):
    """plan --pipeline on this CPU with --results: every part calibrated on the recorded generations, the pipeline's
    own work counted from their fit, each source saying so."""
    c = calibration.calibrate(recorded, device_key("cpu", kept=False), write=False)  # profile() takes no
    # calibrations: none passed over
    assert c["generation"] and c["rest"]["float32"]["cells"] >= 2 and "sdpa float32" in c["backends"]
    spec = GenerationSpec("tiny-sd15", 80, 64, steps=4, backend="sdpa", dtype="float32")
    g = predict_generation(spec, c["limits"], c, None, "cpu")
    parts = {p["part"]: p for p in g["parts"]}
    assert parts["pipeline"]["total_ms"] == pytest.approx(timing.apply(c["generation"], {
        "steps": 4.0, "pixels": 80.0 * 64, "one": 1.0}, 0.0))
    assert parts["pipeline"]["source"].startswith("calibrated on") and "calibrated on" in parts["denoise"]["source"]
    assert main(["plan", "--pipeline", "tiny-sd15", "--size", "80x64", "--steps", "4", "--backend", "sdpa",
                 "--dtype", "float32", "--device", "cpu", "--results", str(recorded)]) == 0
    out = capsys.readouterr().out
    assert "predicted total:" in out and "recorded generations of this device" in out


def test_the_spec_of_a_pipeline_call_about_to_run():
    """What attnprof record predicts before each pipeline call: the call's own size, steps and guidance, the
    pipeline's defaults where it gives none, the loaded processors' backend."""
    pipe = gen.tiny_pipeline()
    spec = pipeline_spec(pipe, ("a cat",), {"height": 96, "num_inference_steps": 4}, None)
    size = pipe.unet.config.sample_size * pipe.vae_scale_factor
    assert (spec.pipeline, spec.width, spec.height, spec.steps, spec.guidance, spec.backend, spec.batch) == \
        ("tiny-sd15", size, 96, 4, 7.5, "sdpa", 1)
    spec = pipeline_spec(pipe, (), {"prompt": ["a", "b"], "num_images_per_prompt": 2,
                                                "guidance_scale": 1.0}, "naive")
    assert spec.batch == 4 and not spec.cfg and spec.backend == "naive" and spec.steps == 50
