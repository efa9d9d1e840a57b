"""profiler.profile on a user's own generation: diffusers pipelines as diffusers builds them (docs/examples/generate.py's
tiny ones: SD 1.5's real block topology), with PAG, InstructPix2Pix, an IP-Adapter and a LoRA loaded through
diffusers' own loaders. Every call recorded with its true batch and step, the output bitwise the unprofiled one's, the
user's processors the same objects after (IP-Adapter's still registered modules during), the stored run read by
attnprof show; a compiled U-Net named in the notes rather than left out silently; a backend swapped in and out."""
import importlib.util
import itertools
import math
import re
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from profiler import profile
from profiler.spec import InputError

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("generate", REPO / "docs" / "examples" / "generate.py")
gen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen)
CALLS = 32  # SD 1.5's attention calls per U-Net forward (16 self, 16 cross)


def _profiled(pipe, out=None, **kwargs):
    """(the images of an unprofiled run, of a profiled one, the profile, the processors before, after, and the
    names of the U-Net's modules during the profiled run)."""
    plain = gen.generate(pipe, steps=3, **kwargs)
    before = dict(pipe.unet.attn_processors)
    with profile(pipe, out=out) as prof:
        images = gen.generate(pipe, steps=3, **kwargs)
        during = [n for n, _ in pipe.unet.named_modules()]
    return plain, images, prof, before, dict(pipe.unet.attn_processors), during


def _same_processors(before: dict, after: dict) -> bool:
    return before.keys() == after.keys() and all(after[k] is before[k] for k in before)


def ip_adapter(pipe, tokens_dim: int = 16, seed: int = 1) -> list[torch.Tensor]:
    """An IP-Adapter (base: 4 image tokens) loaded through diffusers' load_ip_adapter from a state dict of the
    shapes this U-Net takes, random values; the image embeddings to pass (negative and positive, for guidance)."""
    unet, g = pipe.unet, torch.Generator().manual_seed(seed)
    cross = unet.config.cross_attention_dim
    proj = {"proj.weight": torch.randn(cross * 4, tokens_dim, generator=g) * 0.1, "proj.bias": torch.zeros(cross * 4),
            "norm.weight": torch.ones(cross), "norm.bias": torch.zeros(cross)}
    layers, key = {}, 1
    for name in unet.attn_processors:
        if not name.endswith("attn1.processor"):  # diffusers numbers the cross-attentions 1, 3, 5, ...
            attn = unet.get_submodule(name.removesuffix(".processor"))
            for w in ("k", "v"):
                layers[f"{key}.to_{w}_ip.weight"] = torch.randn(getattr(attn, f"to_{w}").out_features, cross,
                                                                generator=g) * 0.1
            key += 2
    pipe.load_ip_adapter({"image_proj": proj, "ip_adapter": layers}, subfolder="", weight_name="ip-adapter.bin",
                         image_encoder_folder=None)
    return [torch.randn(2, 1, tokens_dim, generator=g)]


def test_a_generation_is_recorded_call_by_call_and_its_images_do_not_change(tmp_path, capsys):
    """3 steps at guidance 7.5: 3 x 32 U-Net calls of batch 2 (the prompt and the negative one), steps 0, 1, 2, the
    VAE decode's attention, the CLIP text encoder's (transformers' CLIPAttention: one call a layer in each of its two
    forwards, the prompt's and the negative one's), a time on every call; the images bitwise the unprofiled run's;
    the stored run shown by attnprof show, with the components' share of the generation."""
    from profiler.cli import main

    pipe = gen.tiny_pipeline()
    plain, images, prof, before, after, _ = _profiled(pipe, out=tmp_path)
    assert np.array_equal(plain, images) and _same_processors(before, after)
    unet = prof.calls[prof.calls["component"] == "unet"]
    assert len(unet) == 3 * CALLS and set(unet["batch"]) == {2}
    assert unet.groupby("step").size().to_dict() == {0: CALLS, 1: CALLS, 2: CALLS}
    vae = prof.calls[prof.calls["component"] == "vae"]
    assert len(vae) == 1 and vae["block"].iloc[0] == "vae.decoder.mid_block.attentions.0" and vae["step"].isna().all()
    assert vae["tokens_q"].iloc[0] == (64 // 8) ** 2 and prof.calls["time_ms"].gt(0).all()
    clip = prof.calls[prof.calls["component"] == "text_encoder"]
    assert clip["block"].tolist() == [f"text_encoder.encoder.layers.{i}.self_attn" for i in (0, 1)] * 2
    assert set(zip(clip["kind"], clip["batch"], clip["heads"], clip["head_dim"], clip["tokens_q"],
                   clip["tokens_k"])) == {("self", 1, 4, 8, 77, 77)} and clip["step"].isna().all()
    comps = prof.components.set_index("component")
    assert comps.loc["text_encoder", "attention_calls"] == 4
    assert comps.loc["text_encoder", "attention_ms"] == pytest.approx(clip["time_ms"].sum())
    assert comps.loc["unet", "forwards"] == 3 and comps.loc["text_encoder", "forwards"] == 2
    assert comps.loc["vae", "forwards"] == 1 and comps["time_ms"].sum() <= prof.wall_s * 1e3
    text = str(prof)
    assert "unet" in text and "attention share" in text and prof.run_dir and prof.run_dir.parent == tmp_path
    assert main(["show", str(prof.run_dir)]) == 0
    shown = capsys.readouterr().out
    assert "StableDiffusionPipeline (loaded, 3 steps at 64x64, batch 2) took" in shown
    assert "AttnProcessor2_0 x34" in shown
    assert re.search(r"text_encoder +CLIPTextModel +2 +[\d.]+ ms +[\d.]+% +4 +[\d.]+ ms", shown), shown


def test_each_pipeline_call_in_one_block_is_a_generation_with_its_own_steps_time_and_size(tmp_path, capsys):
    """Three pipeline calls in one `profile` block (3 then 2 steps at 64x64, 2 at 48x48): generations 0, 1 and 2,
    the U-Net's steps 0..N-1 each, each call's own wall time and size; stored as a cell per size (the 64x64 one with
    its two generations and 5 denoiser forwards, the 48x48 one with its own calls only), which show, the findings,
    diff (each size against its own) and the time model's reader (calibration.record_samples) read apart; show's
    legend only with --legend."""
    import json

    import pandas as pd

    from profiler.cli import main
    from profiler.fmt import generations_text
    from profiler.planner import calibration
    from profiler.store import Run

    pipe = gen.tiny_pipeline()
    runs = []
    for _ in range(2):  # a second run to diff the first against
        with profile(pipe, out=tmp_path) as prof:
            gen.generate(pipe, steps=3)
            gen.generate(pipe, steps=2)
            gen.generate(pipe, steps=2, size=48)
        runs.append(prof)
    unet = prof.calls[prof.calls["component"] == "unet"]
    assert unet.groupby("generation")["step"].agg(lambda s: sorted(set(s))).to_dict() == \
        {0: [0, 1, 2], 1: [0, 1], 2: [0, 1]}
    assert unet.groupby("generation").size().to_dict() == {0: 3 * CALLS, 1: 2 * CALLS, 2: 2 * CALLS}
    g = prof.generations
    assert g["steps"].tolist() == [3, 2, 2] and g["width"].tolist() == [64, 64, 48] and set(g["batch"]) == {2}
    walls = g["wall_s"].tolist()
    assert all(w > 0 for w in walls) and sum(walls) <= prof.wall_s and prof.facts["generations"] == 3
    assert "64x64, batch 2 and 48x48, batch 2 (a cell each)" in str(prof)
    run = Run.open(prof.run_dir)
    cells = run.cells().set_index("size")
    assert sorted(cells.index) == ["48x48", "64x64"]
    big, small = cells.loc["64x64"], cells.loc["48x48"]
    assert list(big["generation_times_s"]) == walls[:2] and list(big["generation_steps"]) == [3, 2]
    assert list(small["generation_times_s"]) == walls[2:] and small["steps"] == 2 and small["generations"] == 1
    assert len(big["forward_time_samples_ms"]) == 5 and len(small["forward_time_samples_ms"]) == 2
    assert big["generation_s"] == pytest.approx(sum(walls[:2])) and small["generation_s"] == pytest.approx(walls[2])
    for cell, tokens, n in ((big, 64, 2), (small, 36, 1)):
        calls = run.read_frame(f"calls-{cell['cell_id']}")
        vae = calls[calls["component"] == "vae"]
        assert vae["tokens_q"].tolist() == [tokens] * n and sorted(set(calls["generation"])) == list(range(n))
        comps = {c["component"]: c for c in json.loads(cell["components"])}
        assert comps["unet"]["forwards"] == (5 if n == 2 else 2) and comps["vae"]["attention_calls"] == n
    _, blocks = run.read()
    finest = blocks[blocks["block"] == "down_blocks.0.attentions.0.transformer_blocks.0.attn1"].set_index("size")
    assert finest.loc["64x64", "tokens_q"] == 64 and finest.loc["48x48", "tokens_q"] == 36
    said = generations_text([3, 2], walls[:2])
    assert main(["show", str(prof.run_dir), "--results", str(tmp_path)]) == 0
    shown = " ".join(capsys.readouterr().out.split())  # unwrapped
    assert f"StableDiffusionPipeline (loaded at 64x64, batch 2): {said} ({sum(walls[:2]):.2f} s in all); 5 " \
           "denoiser forwards of" in shown  # the findings
    assert f"StableDiffusionPipeline (loaded, 2 steps at 48x48, batch 2) took {walls[2]:.2f} s; 2 denoiser " \
           "forwards of" in shown
    assert f"StableDiffusionPipeline, loaded (AttnProcessor2_0 x34): {said}, scheduler DDIMScheduler" in shown
    assert "(attnprof show --legend says what each column is)" in shown and "Rows by family" not in shown
    assert main(["show", str(prof.run_dir), "--legend"]) == 0 and "Rows by family" in capsys.readouterr().out
    main(["diff", runs[0].run_dir.name, prof.run_dir.name, "--results", str(tmp_path), "--json"])
    matched = json.loads(capsys.readouterr().out)["matched"]
    assert sorted(m["width"] for m in matched) == [48, 64]  # each size against its own
    assert next(m for m in matched if m["width"] == 48)["time_note"] == "too few samples: 2 in A, 2 in B"
    calls, rests = calibration.record_samples(run, run.manifest())  # two samples of the pipeline's own work
    overheads = sorted((r["pixels"], r["steps"]) for r in rests if r["component"] == "generation")
    assert overheads == [(48.0 * 48, 2.0), (64.0 * 64, 3.0)]
    per_cell = pd.Series([c["cell_id"] for c in calls if c["component"] == "unet"]).value_counts().to_dict()
    assert per_cell == {big["cell_id"]: CALLS, small["cell_id"]: CALLS}  # each held against the walk at its size


@pytest.mark.parametrize("kind", ["pag", "pix2pix"])
def test_pag_and_instructpix2pix_are_recorded_with_their_batch_of_three(kind):
    """Perturbed-attention guidance with guidance (PAG sets its own processors on its layers mid-call) and
    InstructPix2Pix (image and text guidance) both run the U-Net on a batch of 3."""
    pipe = gen.tiny_pipeline(kind)
    plain, images, prof, before, after, _ = _profiled(pipe)
    unet = prof.calls[prof.calls["component"] == "unet"]
    assert np.array_equal(plain, images) and _same_processors(before, after)
    assert len(unet) == 3 * CALLS and set(unet["batch"]) == {3}


def test_an_ip_adapter_stays_loaded_and_its_image_tokens_are_counted():
    """IP-Adapter's processors are modules (their projections are parameters): they stay registered children of
    their attention modules during the profiled run and after, the same objects; each cross-attention call counts
    the adapter's 4 image tokens beside the text's."""
    pipe = gen.tiny_pipeline()
    embeds = ip_adapter(pipe)
    modules = [n for n, _ in pipe.unet.named_modules()]
    plain, images, prof, before, after, during = _profiled(pipe, ip_adapter_image_embeds=embeds)
    assert np.array_equal(plain, images) and _same_processors(before, after)
    assert during == modules == [n for n, _ in pipe.unet.named_modules()] and any(".processor.to_k_ip" in n
                                                                                  for n in modules)
    unet = prof.calls[prof.calls["component"] == "unet"]
    cross = unet[unet["kind"] == "cross"]
    assert len(unet) == 3 * CALLS and set(unet["batch"]) == {2} and set(cross["ip_tokens_k"]) == {4}
    assert "IPAdapterAttnProcessor2_0 x16" in prof.facts["processors"]


@pytest.mark.parametrize("fused", [False, True])
def test_a_lora_loaded_through_diffusers_fused_or_not(fused):
    """A LoRA on to_q, to_k, to_v and to_out, saved by one pipeline and loaded by another with load_lora_weights
    (peft's layers in the attention modules), then fused or not: every call recorded, the images unchanged."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    source, pipe = gen.tiny_pipeline(seed=3), gen.tiny_pipeline()
    source.unet.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights=False,
                                       target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    with tempfile.TemporaryDirectory() as folder:
        type(source).save_lora_weights(folder, unet_lora_layers=get_peft_model_state_dict(source.unet))
        pipe.load_lora_weights(folder, adapter_name="style")
    if fused:
        pipe.fuse_lora()
    assert any("lora_A" in n for n, _ in pipe.unet.named_parameters()) or fused
    plain, images, prof, before, after, _ = _profiled(pipe)
    assert np.array_equal(plain, images) and _same_processors(before, after)
    assert len(prof.calls[prof.calls["component"] == "unet"]) == 3 * CALLS


def test_a_backend_is_swapped_in_for_the_generation_and_the_users_processors_come_back():
    """sliced's processors (diffusers' SlicedAttnProcessor, taking the VAE's temb) give the images diffusers' own
    give, with no warning on any call (diffusers' warns that it drops temb at every VAE decode)."""
    import logging

    from diffusers.models.attention_processor import SlicedAttnProcessor

    said = []
    heard = logging.Handler(logging.WARNING)
    heard.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("diffusers").addHandler(heard)  # diffusers' root logger does not propagate
    try:
        pipe = gen.tiny_pipeline()
        before = dict(pipe.unet.attn_processors)
        with profile(pipe, out=None, backend="sliced") as prof:
            images = gen.generate(pipe, steps=3)
        assert not [m for m in said if "temb" in m] and _same_processors(before, pipe.unet.attn_processors)
        for part in (pipe.unet, pipe.vae):
            part.set_attn_processor(SlicedAttnProcessor(1))
        assert np.array_equal(images, gen.generate(pipe, steps=3)) and [m for m in said if "temb" in m]
    finally:
        logging.getLogger("diffusers").removeHandler(heard)
    assert prof.facts["processors"] == "SlicedAttnProcessor x34" and prof.facts["backend"] == "sliced"
    assert len(prof.calls[prof.calls["component"] == "text_encoder"]) == 4  # CLIP's, run as transformers runs it
    assert any(n.startswith("text_encoder's attention (CLIP's, x2) runs as transformers runs it") for n in prof.notes)
    ip = gen.tiny_pipeline()
    ip_adapter(ip)
    with pytest.raises(InputError, match="backend='sdpa' would replace unet's IPAdapterAttnProcessor2_0"):
        with profile(ip, out=None, backend="sdpa"):
            pass
    assert all(type(p).__name__ != "SlicedAttnProcessor" for p in ip.unet.attn_processors.values())


def test_a_bare_unet_and_a_compiled_one(tmp_path, capsys):
    """A module rather than a pipeline is the component `model`, its forwards the steps. A compiled U-Net keeps its
    graph: torch.compile's wrapper gets its forwards timed, module.compile() (its hooks would run inside the graph)
    nothing, and the notes say why no call is recorded one by one; no hook of ours breaks either graph. The first's
    stored run, with no attention call recorded, is read by show, diff (the forwards' times where a side has no
    attention time; 'not judged (no samples ...)' where one has none at all), the report and the time model's
    reader, as a user runs them; the second's size is unknown (no forward seen): nothing stored, a note says so."""
    import pandas as pd
    from torch._dynamo.utils import counters

    from profiler.cli import main
    from profiler.planner import calibration
    from profiler.report import compare
    from profiler.store import Run

    pipe = gen.tiny_pipeline()
    unet = pipe.unet
    inputs = {"sample": torch.randn(2, 4, 8, 8), "timestep": 10, "encoder_hidden_states": torch.randn(2, 77, 32)}
    with torch.no_grad(), profile(unet, out=tmp_path) as eager:
        plain = [unet(**inputs).sample for _ in range(2)]
    assert eager.calls.groupby("step").size().to_dict() == {0: CALLS, 1: CALLS}
    assert eager.facts["width"] == 64 and eager.facts["batch"] == 2
    small = {**inputs, "sample": torch.randn(1, 4, 6, 6), "encoder_hidden_states": torch.randn(1, 77, 32)}
    with torch.no_grad(), profile(unet, out=None) as prof:  # a module's forwards at another shape: a generation
        unet(**inputs), unet(**small), unet(**small)
    g = prof.generations
    assert g[["steps", "width", "batch"]].values.tolist() == [[1, 64, 2], [2, 48, 1]] and g["wall_s"].gt(0).all()
    assert prof.calls.groupby("generation")["step"].agg(lambda s: sorted(set(s))).to_dict() == {0: [0], 1: [0, 1]}
    counters.clear()
    wrapped = torch.compile(unet, backend="eager")  # Dynamo's graph capture, without Inductor's compile time
    with torch.no_grad(), profile(wrapped, out=tmp_path) as prof:
        out = wrapped(**inputs).sample
    assert torch.allclose(out, plain[0]) and not len(prof.calls)
    comp = prof.components.set_index("component").loc["model"]
    assert comp["forwards"] == 1 and math.isnan(comp["attention_calls"]) and math.isnan(comp["attention_ms"])
    assert comp["not_recorded"] == "Attention x32" and any("runs compiled" in n for n in prof.notes)
    assert re.search(r"model +1 .* not recorded \(Attention x32\) +- +-", str(prof))  # never "0 calls, 0.0 ms"
    assert prof.facts["pipeline"] == "UNet2DConditionModel" and prof.facts["steps"] == 1  # by its forwards
    compiled_run = prof.run_dir
    unet.compile(backend="eager")
    with torch.no_grad(), profile(unet, out=tmp_path) as prof:
        assert torch.allclose(unet(**inputs).sample, plain[0])
    assert not len(prof.calls) and prof.components.set_index("component").loc["model", "forwards"] == 0
    assert prof.components.set_index("component").loc["model", "not_recorded"] == "Attention x32"
    assert any("module.compile()" in n for n in prof.notes) and not counters["graph_break"]
    assert prof.run_dir is None and any(n.startswith("nothing stored: no forward of the denoiser") for n in
                                        prof.notes)  # its size unknown: no 0x0 cell for every reader to trip on
    runs = [eager.run_dir.name, compiled_run.name]
    assert main(["show", runs[1], "--results", str(tmp_path)]) == 0
    assert "their attention not recorded (compiled" in " ".join(capsys.readouterr().out.split())
    assert main(["diff", *runs, "--results", str(tmp_path)]) == 3  # not judged: one forward in B
    assert "the forwards' times: a side's attention has no time of its own" in capsys.readouterr().out
    html = tmp_path / "r.html"
    assert main(["report", *runs, "--results", str(tmp_path), "--html", str(html)]) == 0
    assert html.read_text().count("No attention call of this generation was recorded") == 1
    compiled = Run.open(compiled_run)
    calls, rests = calibration.record_samples(compiled, compiled.manifest())
    assert not calls and [(r["component"], r["steps"]) for r in rests] == [("generation", 1.0)]
    cell = compiled.cells().iloc[0].to_dict()  # a cell with no sample at all (a run of before): not judged, no error
    bare = {**cell, "forward_time_samples_ms": []}
    row = compare.compare(pd.DataFrame([cell]), pd.DataFrame([bare]))["matched"].iloc[0]
    assert (row["time_verdict"], row["time_note"]) == ("not judged", "not judged (no samples in B)")


def test_not_a_pipeline_is_one_line():
    with pytest.raises(InputError, match="is neither a diffusers pipeline nor a torch module"):
        with profile("sd15"):
            pass


def test_the_readmes_from_python_section_runs_as_written(tmp_path, monkeypatch):
    """Every code block of README's "From Python", run in order as a user pastes them, in a folder of their own
    (its docs/ the repository's): the stored run lands under ./results there."""
    import re

    section = (REPO / "README.md").read_text().split("## From Python", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 3
    (tmp_path / "docs").symlink_to(REPO / "docs")
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), scope)
    assert len(list((tmp_path / "results").iterdir())) == 2 and scope["prof"].run_dir.is_dir()  # and the tune's
    assert scope["tuned"].path.parent.parent.resolve() == tmp_path / "results" and scope["tuned"].path.is_file()
    assert list(scope["f"].backends["backend"]) == ["naive", "sdpa"] and scope["p"].totals["predicted_forward_peak_bytes"]


def test_plan_and_fit_from_python_predict_the_times_the_commands_print(capsys):
    """plan(gpu=) and fit(gpu=) give the times attnprof plan --gpu and fit --gpu print (one front door,
    planner/predict.py), SDXL at 1024x1024 on an A100; without a GPU to predict for, none."""
    import json

    from profiler import cli, fit, plan

    p = plan("sdxl-base", "1024x1024", batch=2, backend="sdpa", gpu="A100-80GB")
    assert cli.main(["plan", "--model", "sdxl-base", "--size", "1024x1024", "--batch", "2", "--backend", "sdpa",
                     "--gpu", "A100-80GB", "--json"]) == 0
    (want,) = json.loads(capsys.readouterr().out)
    for key in ("predicted_forward_time_ms", "predicted_forward_low_ms", "predicted_forward_high_ms", "bound"):
        assert p.totals[key] == want["totals"][key]
    assert 50 < p.totals["predicted_forward_time_ms"] < 1000
    assert "predicted_forward_time_ms" not in plan("sdxl-base", "1024x1024", backend="sdpa").totals
    f = fit("sd15", "A100-40GB", backends=["naive", "sdpa"], gpu="A100-40GB")
    assert cli.main(["fit", "--model", "sd15", "--budget", "A100-40GB", "--backend", "naive", "--backend", "sdpa",
                     "--gpu", "A100-40GB", "--all", "--json"]) == 0
    want = {b["backend"]: b["predicted_forward_time_ms"] for b in json.loads(capsys.readouterr().out)["backends"]}
    assert dict(zip(f.backends["backend"], f.backends["predicted_forward_time_ms"])) == want
    assert want["naive"] < want["sdpa"]  # naive's largest image is the smaller


def test_a_trace_names_each_attention_call_by_its_component_block_and_shape(tmp_path):
    """trace=True: a Chrome / Perfetto trace of the generation stored in the run, listed in its cell; each attention
    call a range named by its component, block and shape, as many ranges as calls."""
    import json

    from profiler.store import Run

    pipe = gen.tiny_pipeline()
    with profile(pipe, out=tmp_path, trace=True) as prof:
        gen.generate(pipe, steps=2)
    cell = Run.open(prof.run_dir).cells().iloc[0]
    (name,) = list(cell["trace_files"])
    events = json.loads((prof.run_dir / name).read_text())["traceEvents"]
    ranges = [e["name"] for e in events if e.get("name", "").startswith(("unet.", "vae.", "text_encoder."))]
    assert len(ranges) == len(prof.calls) == 2 * CALLS + 1 + 4
    assert "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1 2x64x64" in ranges
    assert "vae.decoder.mid_block.attentions.0 1x64x64" in ranges
    assert "text_encoder.encoder.layers.1.self_attn 1x77x77" in ranges
    forwards = [e["name"].split(" (call")[0] for e in events if " forward" in e.get("name", "")]  # a repeated
    assert forwards.count("unet forward") == 2 and forwards.count("vae forward") == 1  # name gets its call's key


def test_on_cuda_a_generations_calls_are_ranged_for_their_kernels_host_timed_and_synchronized_once(monkeypatch):
    """The meter of calls profile uses on CUDA (faked call by call: tests/test_devices.py): each call a profiler range
    (its kernels are read from the generation's trace, as attnprof run's are) and the host's clock, no CUDA event
    (events around a call of a host-bound forward time the host, and the kernels say what the GPU did); the
    allocator's statistics read on the device's own index; nothing synchronizes until the end, once."""
    import itertools

    from profiler.record.session import meter as profile_meter
    from tests.test_devices import _Recorder

    fake = _Recorder(monkeypatch, reserved=itertools.repeat(0))
    monkeypatch.setattr(torch.cuda, "Event", lambda **kw: pytest.fail("a CUDA event per call"))
    meter = profile_meter("cuda:1")
    for uid in range(5):
        meter.before({"uid": uid, "block": "b", "component": "unet", "batch": 2, "tokens_q": 4096, "tokens_k": 77})
        meter.after({"uid": uid, "block": "b", "component": "unet", "batch": 2, "tokens_q": 4096, "tokens_k": 77})
    assert not [c for c in fake.calls if c[0] == "synchronize"] and len(meter.peak) == 5
    assert {c[1] for c in fake.calls if c[0] in ("reset_peak_memory_stats", "memory_allocated")} == \
        {torch.device("cuda", 1)}
    assert sorted(meter.ranges.values()) == list(range(5)) and meter.meter == "host"
    meter.collect()
    assert [c for c in fake.calls if c[0] == "synchronize"] == [("synchronize", torch.device("cuda", 1))]
    assert sorted(meter.samples) == list(range(5)) and all(v[0] >= 0 for v in meter.samples.values())


def test_attention_of_a_kind_the_recorder_has_no_hook_for_is_named_not_recorded():
    """T5's attention (SD 3's third text encoder; transformers' T5Attention, neither diffusers' nor CLIP's): its
    forward timed, its attention named 'not recorded (T5Attention x2)' in the table and the notes, never 0 calls."""
    from transformers import T5Config, T5EncoderModel

    class Encoder(torch.nn.Module):  # a module holding it, as a pipeline's component holds its model
        def __init__(self):
            super().__init__()
            self.t5 = T5EncoderModel(T5Config(vocab_size=32, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2))

        def forward(self, ids):
            return self.t5(input_ids=ids)

    torch.manual_seed(0)
    encoder = Encoder()
    with torch.no_grad(), profile(encoder, out=None) as prof:
        encoder(torch.zeros(1, 5, dtype=torch.long))
    comp = prof.components.iloc[0]
    assert comp["forwards"] == 1 and comp["time_ms"] > 0 and not len(prof.calls)
    assert math.isnan(comp["attention_calls"]) and comp["not_recorded"] == "T5Attention x2"
    assert re.search(r"model +1 .* not recorded \(T5Attention x2\) +- +-", str(prof)), str(prof)
    assert any(n.startswith("model's attention modules T5Attention x2 are not recorded") for n in prof.notes)


def test_on_the_cpu_each_calls_time_is_its_attention_core_and_its_projections(tmp_path, capsys, monkeypatch):
    """On the CPU each call's host time is split: proj_kernel_ms its projection modules' own time (hooks on to_q,
    to_k, to_v, to_out[0]; CLIP's q_proj, k_proj, v_proj, out_proj), attn_kernel_ms the rest (its core). With the
    meter's clock injected (a tick of 1 ms at every read) every call reads it 10 times: at its start, before and
    after each of its 4 projections, at its end: 9 ms, 4 of them projections, 5 core. print(prof) and attnprof show
    name both per component and per cell; with the real clock the two add up to the call's time, both > 0."""
    from profiler.cli import main
    from profiler.record import session

    ticks, real_meter = itertools.count(), session.meter

    def ticking(device, trace=False):
        m = real_meter(device, trace)
        m.clock = lambda: next(ticks) / 1e3  # seconds, as time.perf_counter's
        return m

    pipe = gen.tiny_pipeline()
    monkeypatch.setattr(session, "meter", ticking)
    with profile(pipe, out=tmp_path) as prof:
        gen.generate(pipe, steps=2)
    monkeypatch.setattr(session, "meter", real_meter)
    calls = prof.calls
    assert len(calls) == 2 * CALLS + 4 + 1 and set(calls["component"]) == {"unet", "text_encoder", "vae"}
    for column, ms in (("time_ms", 9.0), ("proj_kernel_ms", 4.0), ("attn_kernel_ms", 5.0)):
        assert calls[column].tolist() == pytest.approx([ms] * len(calls)), column
    text = str(prof)
    assert re.search(r"unet +2 +[\d.]+ ms +[\d.]+% +64 +576\.0 ms +320\.0 ms +256\.0 ms", text), text
    assert re.search(r"\nblock +calls +time +core +projections", text) and "q/k/v and output projections" in text
    assert len(re.findall(r"\n\S+attn\S* +2 +18\.0 ms +10\.0 ms +8\.0 ms ", text)) == 5, text  # 2 calls each
    assert main(["show", str(prof.run_dir), "--wide"]) == 0
    shown = capsys.readouterr().out
    assert re.search(r"attention +core +projections", shown) and re.search(r" 288\.0 ms +160\.0 ms +128\.0 ms", shown)
    assert re.search(r"unet +UNet2DConditionModel +2 +[\d.]+ ms +[\d.]+% +64 +576\.0 ms +320\.0 ms +256\.0 ms", shown)

    with profile(pipe, out=None) as prof:  # the real clock: the projections' time, less than the call's
        gen.generate(pipe, steps=2)
        hooked = [m for m in pipe.unet.modules() if isinstance(m, torch.nn.Linear) and m._forward_hooks]
    calls = prof.calls
    assert len(hooked) == 4 * 16 * 2  # to_q, to_k, to_v, to_out[0] of each of the U-Net's 32 attention modules
    assert calls["attn_kernel_ms"].gt(0).all() and calls["proj_kernel_ms"].gt(0).all()
    assert (calls["proj_kernel_ms"] < calls["time_ms"]).all()
    assert (calls["attn_kernel_ms"] + calls["proj_kernel_ms"]).tolist() == pytest.approx(calls["time_ms"].tolist())
    assert not [m for m in pipe.unet.modules() if m._forward_hooks or m._forward_pre_hooks]  # all removed


def test_a_ctrl_c_in_the_block_keeps_the_steps_that_ended_as_a_partial_cell(tmp_path, capsys):
    """A Ctrl-C in the block goes on up as a KeyboardInterrupt, and what ended is kept: raised from the pipeline's
    step callback after the second of 4 steps, the run holds those two steps' U-Net calls (and the text encoder's;
    no VAE decode ran), its cell partial, the run interrupted, one line on stderr naming it and the steps; raised
    inside the second step's U-Net forward (a hook on an attention module), the step under way is dropped, the
    first kept. Every hook is removed after either, and show names the cell partial."""
    from profiler.cli import main
    from profiler.store import Run

    pipe = gen.tiny_pipeline()

    def after_second(pipe, step, t, kwargs):
        if step == 1:
            raise KeyboardInterrupt
        return kwargs

    with pytest.raises(KeyboardInterrupt), profile(pipe, out=tmp_path / "a") as prof:
        gen.generate(pipe, steps=4, callback_on_step_end=after_second)
    said = [line for line in capsys.readouterr().err.splitlines() if "interrupted" in line]
    assert said == [f"profile: interrupted: the 2 steps that ended kept as a partial cell of run {prof.run_dir.name} "
                    f"under {tmp_path / 'a'}, marked interrupted (attnprof show {prof.run_dir})"]
    run = Run.open(prof.run_dir)
    cell = run.cells().iloc[0]
    assert run.manifest()["interrupted"] is True and bool(cell["partial"]) and cell["steps"] == 2
    calls = run.read_frame(f"calls-{cell['cell_id']}")
    assert calls.groupby("component").size().to_dict() == {"unet": 2 * CALLS, "text_encoder": 4}
    assert sorted(set(calls.query("component == 'unet'")["step"])) == [0, 1] and calls["time_ms"].gt(0).all()
    assert len(cell["forward_time_samples_ms"]) == 2 and len(cell["attention_time_samples_ms"]) == 2
    assert main(["show", str(prof.run_dir), "--wide"]) == 0
    shown = capsys.readouterr().out
    assert "(interrupted)" in shown and "(partial: a Ctrl-C stopped the profile block; its steps that ended)" in shown

    attn, seen = pipe.unet.down_blocks[1].attentions[0].transformer_blocks[0].attn1, []

    def in_the_second_step(module, args):
        seen.append(1)
        if len(seen) == 2:
            raise KeyboardInterrupt

    hook = attn.register_forward_pre_hook(in_the_second_step)
    try:
        with pytest.raises(KeyboardInterrupt), profile(pipe, out=tmp_path / "b") as prof:
            gen.generate(pipe, steps=4)
    finally:
        hook.remove()
    assert "the 1 step that ended kept as a partial cell" in capsys.readouterr().err
    calls = Run.open(prof.run_dir).read_frame(f"calls-{Run.open(prof.run_dir).cells()['cell_id'].iloc[0]}")
    assert calls.groupby("component").size().to_dict() == {"unet": CALLS, "text_encoder": 4}
    assert list(prof.generations["steps"]) == [1] and len(prof.forwards.query("component == 'unet'")) == 1
    assert not [m for m in pipe.components.values() if isinstance(m, torch.nn.Module)
                for m in m.modules() if m._forward_hooks or m._forward_pre_hooks]  # all removed
    assert np.array_equal(gen.generate(pipe, steps=1), gen.generate(pipe, steps=1))  # the pipeline as it was


def test_with_nvtx_ranges_a_generation_shows_each_component_forward_each_step_and_each_call(monkeypatch):
    """profile with NVTX ranges on (injected: tests/test_devices.py's FakeNvtx), one step: the text encoder's two
    forwards (`text_encoder forward 0`, `... 1`), the U-Net's `unet step 0`, the VAE's decode `vae forward 0`, each
    holding a range per attention call named as prof.calls names its block (the U-Net's under `unet.`); off (neither
    ATTNPROF_NVTX nor nsys), not one NVTX call."""
    from profiler import devices
    from tests.test_devices import FakeNvtx, nvtx_on

    fake = nvtx_on(monkeypatch)
    pipe = gen.tiny_pipeline()
    with profile(pipe, out=None) as prof:
        gen.generate(pipe, steps=1)
    assert [name for name, _ in fake.ranges] == ["text_encoder forward 0", "text_encoder forward 1", "unet step 0",
                                                 "vae forward 0"] and fake.open == [fake.ranges]
    named = [name for _, calls in fake.ranges for name, _ in calls]
    blocks = prof.calls["block"].where(prof.calls["component"] != "unet", "unet." + prof.calls["block"])
    assert named == blocks.tolist() and len(named) == 4 + CALLS + 1
    assert all(inside == [] for _, calls in fake.ranges for _, inside in calls)
    monkeypatch.setattr(devices, "NVTX", off := FakeNvtx())
    monkeypatch.delenv(devices.NVTX_ENV)
    monkeypatch.delenv("NSYS_PROFILING_SESSION_ID", raising=False)
    with profile(pipe, out=None):
        gen.generate(pipe, steps=1)
    assert off.ranges == []
