"""Beyond the bare U-Net: the VAE, the ControlNet, IP-Adapter and ToMe as cell settings, and the largest image a
whole generation fits (attnprof fit --pipeline)."""
import json

import pytest
import torch

from profiler.cli import main
from profiler.execute.grid import Sweep, loads
from profiler.execute.sweep import execute
from profiler.planner import plan
from profiler.planner.forward import trace
from profiler.store import Run

MiB, GiB = 2**20, 2**30


def _plan_json(capsys, *args) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)[0]


def test_the_vae_decoders_attention_at_1024(capsys):
    """One mid-block self-attention over the latent pixels: 16384 tokens, 1 head of 512, its softmax upcast to
    float32, so a 1 GiB score table though the VAE runs in float16; naive's forward holds two of them."""
    p = _plan_json(capsys, "--model", "sd15-vae", "--size", "1024x1024")
    (call,) = p["blocks"]
    assert (call["block"], call["kind"], call["stage"]) == ("decoder.mid_block.attentions.0", "self", "mid")
    assert (call["tokens_q"], call["tokens_k"], call["heads"], call["head_dim"]) == (16384, 16384, 1, 512)
    assert call["score_bytes"] == 2**30 and call["upcast"] == "softmax"
    assert p["totals"]["params_total"] == 83_653_863
    naive = _plan_json(capsys, "--model", "sd15-vae", "--size", "1024x1024", "--backend", "naive")["totals"]
    assert naive["predicted_forward_peak_bytes"] > naive["weights_bytes"] + 2 * GiB
    encoder = _plan_json(capsys, "--model", "sd15-vae", "--size", "1024x1024", "--vae-part", "encoder")
    assert [b["block"] for b in encoder["blocks"]] == ["encoder.mid_block.attentions.0"]


def test_the_tiny_vaes_measured_decode_peak_is_its_prediction(tmp_path):
    """tiny-vae decoding 512x512 on the CPU with naive attention: the measured forward peak (weights + inputs + the
    allocation trace's peak) within 3% of the planner's; the output within float32 tolerance of the reference."""
    sweep = Sweep(models=("tiny-vae",), sizes=((512, 512),), dtypes=("float32",), device="cpu", repeats=1, warmup=0,
                  backends=(("naive", ()),), out=str(tmp_path))
    cell = Run.open(execute(sweep, workers=False, progress=False).run_path).cells().iloc[0]
    assert cell["status"] == "ok" and cell["error_ok"] and cell["calls"] == 1
    ratio = cell["forward_peak_total_bytes"] / cell["predicted_forward_peak_bytes"]
    assert 0.97 <= ratio <= 1.03, ratio
    assert cell["forward_peak_mem_bytes"] > 2 * 4096 * 4096 * 4  # two float32 score tables of 4096 tokens


def test_ip_adapter_and_tome_in_the_plan(capsys):
    """IP-Adapter plus: each of SD 1.5's 16 cross-attentions gains an image-token call of 16 keys. ToMe 0.5: the
    finest level's self-attentions see 2048 tokens, every other call is as it was."""
    plain = _plan_json(capsys, "--model", "sd15", "--size", "512x512")["blocks"]
    ip = _plan_json(capsys, "--model", "sd15", "--size", "512x512", "--ip-adapter-tokens", "16")["blocks"]
    image = [b for b in ip if b["kind"] == "image"]
    assert len(image) == 16 and {b["tokens_k"] for b in image} == {16}
    assert [b["block"] for b in image] == [b["block"] + ".image" for b in plain if b["kind"] == "cross"]
    strip = lambda rows: [{k: v for k, v in r.items() if k != "call_index"} for r in rows]  # noqa: E731
    assert strip([b for b in ip if b["kind"] != "image"]) == strip(plain)  # the image calls come between
    tome = _plan_json(capsys, "--model", "sd15", "--size", "512x512", "--tome", "0.5")["blocks"]
    for before, after in zip(plain, tome, strict=True):
        merged = before["level"] == 0 and before["kind"] == "self"
        assert (after["tokens_q"], after["tokens_k"]) == ((2048, 2048) if merged else (before["tokens_q"],
                                                                                        before["tokens_k"]))


def test_tome_merges_and_unmerges_exactly_where_tokens_agree():
    """Tokens equal within each 2x2 cell merge without loss: unmerge(merge(x)) is x; N - r tokens are kept."""
    from profiler.unet.adapters import _Merge

    cell = torch.randn(1, 8, 8, 1, 16).expand(1, 8, 8, 4, 16)  # one value per 2x2 cell
    x = cell.reshape(1, 8, 8, 2, 2, 16).permute(0, 1, 3, 2, 4, 5).reshape(1, 256, 16)  # a 16 x 16 grid
    m = _Merge(x, 16, 16, 128, torch.Generator().manual_seed(0))
    merged = m.merge(x)
    assert merged.shape == (1, 128, 16)
    assert torch.allclose(m.unmerge(merged), x)


def test_settings_cells_measure_ok_and_meet_their_predictions(tmp_path):
    """tiny-sd15 with IP-Adapter (4 tokens) and ToMe, and with its ControlNet; each measured on the CPU within the
    fp32 tolerance, its calls recorded (the ControlNet's under controlnet.), its forward peak as predicted (the
    ControlNet with naive at 256, where attention sets the peak: at 128 its conditioning convolutions at full image
    resolution do, with the CPU's convolution workspaces, which no fake tensor shows)."""
    text = """models: [tiny-sd15]
sizes: [128x128]
dtypes: [float32]
backends: [naive, sdpa]
repeats: 1
warmup: 0
device: cpu
ip_adapter_tokens: [4]
tome: [0.5]
also:
  - {controlnet: [true], ip_adapter_tokens: [0], tome: [0], backends: [naive], sizes: [256x256]}
"""
    sweep = loads(text, "test")
    sweep = Sweep(**{**sweep.__dict__, "out": str(tmp_path)})
    run = Run.open(execute(sweep, workers=False, progress=False).run_path)
    cells, blocks = run.read()
    assert len(cells) == 3 and set(cells["status"]) == {"ok"} and cells["error_ok"].all()
    by = {json.loads(c["settings"]).get("controlnet", False): c for c in cells.to_dict("records")}
    assert by[True]["calls"] == 32 + 14 and by[False]["calls"] == 32 + 16
    for c in cells.to_dict("records"):
        gap = abs(c["forward_peak_total_bytes"] - c["predicted_forward_peak_bytes"])
        assert gap <= max(0.03 * c["predicted_forward_peak_bytes"], MiB), (c["settings"], c["backend"], gap)
    mine = blocks[blocks["cell_id"] == by[True]["cell_id"]]
    assert mine["block"].str.startswith("controlnet.").sum() == 14
    ip = blocks[(blocks["cell_id"] == cells["cell_id"].iloc[0]) & (blocks["kind"] == "image")]
    assert len(ip) == 16 and set(ip["tokens_k"]) == {4}


def test_bad_settings_are_one_line(capsys, tmp_path):
    for argv, message in ((["plan", "--model", "sd15-vae", "--tome", "0.5"], "setting tome is for a unet model"),
                          (["plan", "--model", "sd15", "--tome", "1.5"], "setting tome=1.5: use a merge ratio"),
                          (["plan", "--model", "sd15", "--vae-tiling"], "setting vae_tiling is for a vae model")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    with pytest.raises(Exception, match="key 'vae_tiling' is for vae models and this grid has none"):
        loads("models: [tiny-sd15]\nvae_tiling: [true]\n", "test")


def test_fit_a_whole_generation_names_the_phase_that_limits(capsys):
    """SD 1.5 under classifier-free guidance in 4 GiB: every phase's need at the answer fits, the next step does not
    for the phase named; at the answer, the denoise phase's need is the planner's for the U-Net at batch 2 plus the
    other models' weights."""
    assert main(["fit", "--pipeline", "sd15", "--budget", "4GiB", "--json", "--quiet"]) == 0
    f = json.loads(capsys.readouterr().out)
    needs = {ph["phase"]: ph for ph in f["phases"]}
    assert set(needs) == {"text", "denoise", "decode"} and f["limited_by"] in needs
    assert all(ph["need_bytes"] <= 4 * GiB for ph in f["phases"])
    assert needs[f["limited_by"]]["next_need_bytes"] > 4 * GiB
    w, h = f["largest"]
    unet = plan("sd15", w, h, 2, "float16", backend="sdpa")["totals"]
    others = needs["denoise"]["resident_bytes"] - unet["weights_bytes"]
    assert needs["denoise"]["need_bytes"] == unet["predicted_forward_peak_bytes"] + others
    assert main(["fit", "--pipeline", "sd15", "--budget", "4GiB", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert f"is {w}x{h}" in out and f"limited by: the {f['limited_by']} phase" in out


def test_fit_a_whole_generation_for_several_backends_and_a_forward_at_batch_1_names_guidance(capsys):
    """fit --pipeline takes several backends, as fit --model does: one answer each (the tiny pipeline in 256 MiB:
    naive's tables stop its U-Net long before sdpa's), a line per backend first; fit --model at batch 1 says that
    it holds no classifier-free guidance, and how to ask for it (a VAE's batch has none to say)."""
    from profiler.planner.fit import batch_text

    args = ["fit", "--pipeline", "tiny-sd15", "--budget", "256MiB", "--backend", "sdpa", "--backend", "naive"]
    assert main([*args, "--json", "--quiet"]) == 0
    f = json.loads(capsys.readouterr().out)
    sdpa, naive = f["backends"]
    assert (sdpa["backend"], naive["backend"]) == ("sdpa", "naive") and f["budget_given"].startswith("256MiB = ")
    assert naive["largest"][0] < sdpa["largest"][0] and naive["limited_by"] == "denoise"
    assert main([*args, "--quiet"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()[2:4]]
    assert rows == [["sdpa", "x".join(map(str, sdpa["largest"])), sdpa["limited_by"]],
                    ["naive", "x".join(map(str, naive["largest"])), "denoise"]]
    assert out.count("the largest image whose every phase fits 256.0 MiB") == 2
    assert main(["fit", "--model", "tiny-sd15", "--budget", "256MiB", "--backend", "sdpa", "--quiet"]) == 0
    assert "tiny-sd15, float16, batch 1 (no classifier-free guidance; --batch 2 for it) on cuda" in \
        capsys.readouterr().out
    assert batch_text({"batch": 2, "kind": "unet"}) == "batch 2" and batch_text({"batch": 1, "kind": "vae"}) == \
        "batch 1"


# A ControlNet for tiny-sd15 at a depth of its own: no attention at its finest level, two transformer layers a block
# at the next two (tiny-sd15: one, at three levels), as SDXL's small and mid ControlNets differ from their U-Net's
OWN_CONTROLNET = dict(in_channels=4, down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D",
                                                       "DownBlock2D"],
                      block_out_channels=[32, 64, 64, 64], layers_per_block=2, cross_attention_dim=32,
                      attention_head_dim=8, norm_num_groups=8, transformer_layers_per_block=[1, 2, 2, 1],
                      conditioning_embedding_out_channels=[8, 16, 32, 64])
SHAPE = ("block", "kind", "batch", "heads", "head_dim", "tokens_q", "tokens_k")


def _real_calls(folder) -> tuple[list[tuple], list[tuple]]:
    """The attention calls of a real forward at 64x64: the ControlNet loaded from its folder by diffusers, then
    tiny-sd15's U-Net with its residuals, as a pipeline's step runs them, each recorded call by call."""
    import diffusers

    from profiler.attention.recorder import Recorder
    from profiler.unet.models import resolve

    cn = diffusers.ControlNetModel.from_pretrained(folder).eval()
    unet = diffusers.UNet2DConditionModel(**resolve("tiny-sd15").config).eval()
    g = torch.Generator().manual_seed(0)
    inputs = {"sample": torch.randn(1, 4, 8, 8, generator=g), "timestep": torch.tensor([500]),
              "encoder_hidden_states": torch.randn(1, 77, 32, generator=g)}
    with torch.no_grad(), Recorder(cn) as rc, Recorder(unet) as ru:
        down, mid = cn(**inputs, controlnet_cond=torch.randn(1, 3, 64, 64, generator=g), return_dict=False)
        unet(**inputs, down_block_additional_residuals=down, mid_block_additional_residual=mid)
    return [tuple(r[k] for k in SHAPE) for r in rc.rows], [tuple(r[k] for k in SHAPE) for r in ru.rows]


def test_a_controlnet_of_ones_own_at_another_depth_plans_and_runs_with_its_own_calls(tmp_path, capsys):
    """A ControlNet folder saved by diffusers (ControlNetModel.save_pretrained: a config with no up blocks), at a
    depth other than its U-Net's: plan --model DIR gives its own 18 calls (a ControlNet built from the U-Net would
    make 14); beside the U-Net (--model tiny-sd15 --controlnet DIR) plan and run give its 18 and the U-Net's 32, in
    the order a step runs them, each held against a real forward of the models diffusers loads. A ControlNet whose
    residuals cannot fit the U-Net's blocks, or a model that is no ControlNet, is one line."""
    import diffusers

    from profiler.store import list_runs

    folder = tmp_path / "my-controlnet"
    torch.manual_seed(0)
    diffusers.ControlNetModel(**OWN_CONTROLNET).save_pretrained(folder)
    controlnet, unet = _real_calls(folder)
    assert len(controlnet) == 18 and len(unet) == 32

    def planned(*args) -> list[tuple]:
        assert main(["plan", *args, "--size", "64x64", "--json"]) == 0
        return [tuple(b[k] for k in SHAPE) for b in json.loads(capsys.readouterr().out)[0]["blocks"]]

    assert planned("--model", str(folder)) == controlnet
    beside = [(f"controlnet.{c[0]}", *c[1:]) for c in controlnet] + unet
    assert planned("--model", "tiny-sd15", "--controlnet", str(folder)) == beside
    assert main(["run", "--model", "tiny-sd15", "--controlnet", str(folder), "--size", "64x64", "--backend", "sdpa",
                 "--device", "cpu", "--dtype", "float32", "--repeats", "1", "--warmup", "0", "--in-process",
                 "--quiet", "--out", str(tmp_path / "runs")]) == 0
    cells, blocks = Run.open(list_runs(tmp_path / "runs")[0]).read()
    assert cells["status"].tolist() == ["ok"] and cells["settings_label"].tolist() == ["controlnet my-controlnet"]
    assert [tuple(b[k] for k in SHAPE) for b in blocks.sort_values("call_index").to_dict("records")] == beside
    capsys.readouterr()
    wide = json.loads((folder / "config.json").read_text()) | {"block_out_channels": [32, 64, 64, 128]}
    (tmp_path / "wide.json").write_text(json.dumps(wide))
    assert main(["plan", "--model", "tiny-sd15", "--controlnet", str(tmp_path / "wide.json")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"attnprof: error: --controlnet {tmp_path / 'wide.json'}: its block_out_channels [32, 64, 64, 128] differs "
        "from the U-Net's [32, 64, 64, 64]: a ControlNet's residuals add to the U-Net's down blocks, so they must "
        "match")
    assert main(["plan", "--model", "tiny-sd15", "--controlnet", "tiny-vae"]) == 2
    assert "--controlnet tiny-vae: a vae, not a ControlNet" in capsys.readouterr().err


def test_sdxl_tiled_decode_needs_less_at_2048():
    """SDXL's VAE (float32, as its config forces) at 2048x2048: tiled, the decode phase needs far less."""
    tiled, whole = (trace("sdxl-vae", 2048, 2048, 1, "float16", "cuda", ["sdpa"], settings=s)
                    for s in ((("vae_tiling", True),), ()))
    need = lambda t: t["backends"]["sdpa"]["predicted_forward_peak_bytes"]  # noqa: E731
    assert need(tiled) < need(whole) / 2 and len(tiled["rows"]) > 1 == len(whole["rows"])
    assert whole["weights_bytes"] == 83_653_863 * 4  # float32: force_upcast


@pytest.mark.slow
def test_fit_the_sdxl_pipeline_in_12_gib(capsys):
    assert main(["fit", "--pipeline", "sdxl", "--budget", "12GiB", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "limited by: the " in out and all(ph in out for ph in ("text ", "denoise ", "decode "))


@pytest.fixture(scope="module")
def pipeline_results(tmp_path_factory):
    """One run with a tiny VAE decode, tiny-sd15 with IP-Adapter and ToMe, and tiny-sd15 with its ControlNet."""
    root = tmp_path_factory.mktemp("pipeline") / "results"
    sweep = loads("""models: [tiny-vae]
sizes: [128x128]
dtypes: [float32]
backends: [naive, sdpa]
repeats: 1
warmup: 0
device: cpu
also:
  - {models: [tiny-sd15], ip_adapter_tokens: [4], tome: [0.5]}
  - {models: [tiny-sd15], controlnet: [true], backends: [sdpa]}
""", "test")
    execute(Sweep(**{**sweep.__dict__, "out": str(root)}), workers=False, progress=False)
    return root


def test_the_dashboard_filters_by_settings_and_maps_the_vae_and_the_image_calls(pipeline_results, monkeypatch):
    """The settings are a filter; the Run page draws a VAE cell as the VAE (one tile), an IP-Adapter cell with its
    image calls beside the cross-attentions, a ControlNet cell with its own columns; Compare matches within
    settings."""
    pytest.importorskip("streamlit", reason="the dashboard needs streamlit")
    from tests.test_dashboard_app import _app, _charts, _table

    at = _app(pipeline_results, monkeypatch, page="Run", settings_label="none")
    spec, layout = _charts(at)[0]
    assert list(layout["group_label"].unique()) == ["decoder mid"] and len(layout) == 1
    assert any("The VAE" in h.value for h in at.subheader)
    at = _app(pipeline_results, monkeypatch, page="Run", settings_label="ip-adapter 4 tokens, tome 0.5")
    _, layout = _charts(at)[0]
    assert sorted(layout["kind"].unique()) == ["cross", "image", "self"] and len(layout) == 48
    assert layout.groupby("group_label")["kind"].nunique().max() == 3  # image beside cross and self, per block
    at = _app(pipeline_results, monkeypatch, page="Run", settings_label="controlnet")
    _, layout = _charts(at)[0]
    assert layout["group_label"].str.startswith("controlnet ").sum() == 14
    at = _app(pipeline_results, monkeypatch, page="Compare", by="backend", baseline="naive")
    table = next(_table(at, i) for i in range(len(at.dataframe)) if "time_ratio" in _table(at, i))
    assert set(table["settings_label"]) == {"none", "ip-adapter 4 tokens, tome 0.5", "controlnet"}
    controlnet = table[table["settings_label"] == "controlnet"]
    assert (controlnet["time_ratio"] == "-").all()  # no naive cell with a ControlNet: no baseline across settings
