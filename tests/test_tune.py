"""The processor map (a file as a backend, its cell, bad maps), profiler.apply on a real tiny-sd15 U-Net, and bad
input to attnprof tune and profiler.tune: each refused in one line before anything is timed. The tunes themselves:
tests/test_tune_e2e.py."""
import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from profiler.attention import backends
from profiler.cli import main
from profiler.spec import CellSpec, InputError

SIZE = "128x128"  # tiny-sd15 at 128x128: 32 calls, 8 distinct shapes (256, 64, 16 and 4 query tokens)


def _cli(argv: list[str], code: int = 0) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == code, (argv, out.getvalue())
    return out.getvalue()


def _map(tmp_path: Path, blocks: dict, default=None, name="m.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps({"blocks": blocks, **({"default": default} if default else {})}))
    return path


def test_a_map_file_is_a_backend_whose_cell_carries_what_runs(tmp_path):
    a = _map(tmp_path, {"down_blocks.0.attentions.0.transformer_blocks.0.attn1": {"backend": "naive"}},
             {"backend": "split", "options": {"budget_bytes": 4096}})
    name, options = backends.cell_backend(str(a), {})
    assert name == "tuned" and options["file"] == "m.json"
    assert backends.label(name, options) == "tuned (m.json)" == backends.label(str(a), {})
    assert backends.family(name) == "mixed"
    # per block: its entry, else the default (options checked and filled)
    row = {"block": "down_blocks.0.attentions.0.transformer_blocks.0.attn1"}
    assert backends.for_call(name, options, row) == ("naive", {})
    assert backends.for_call(name, options, {"block": "mid_block.attentions.0.transformer_blocks.0.attn1"}) == \
        ("split", {"budget_bytes": 4096})
    # the cell's id: the same map the same id wherever the file is; another map another id
    spec = lambda o: CellSpec("tiny-sd15", 64, 64, 1, "float32", name, "cpu", tuple(sorted(o.items())))  # noqa: E731
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    (moved / "m.json").write_text(a.read_text())
    assert spec(backends.cell_backend(str(moved / "m.json"), {})[1]).cell_id == spec(options).cell_id
    b = _map(tmp_path, {"down_blocks.0.attentions.0.transformer_blocks.0.attn1": {"backend": "sdpa"}},
             {"backend": "split", "options": {"budget_bytes": 4096}}, "m2.json")
    assert spec(backends.cell_backend(str(b), {})[1]).cell_id != spec(options).cell_id
    # a processor made for a map is placed per block; called as one, it says how to place it
    with pytest.raises(InputError, match="profiler.apply"):
        backends.make_processor(name, **options)(None, None)


def test_a_map_tuned_for_another_model_or_size_warns_in_one_line_naming_both(tmp_path, capsys):
    """Issue 64's tour: a tuned.json made for tiny-sd15 at 128x128 ran under sd15 (or at another size) with no word.
    attnprof run says so in one line, naming both; the model and size it was made for, nothing."""
    from profiler.cli import _sweep_from_args, build_parser

    path = tmp_path / "tuned.json"
    path.write_text(json.dumps({"attnprof": "processor map (attnprof tune)", "model": "tiny-sd15", "width": 128,
                                "height": 128, "blocks": {}, "default": {"backend": "sdpa"}}))
    for model, size, asked in (("sd15", "512x512", "sd15 at 512x512"), ("tiny-sd15", "64x64", "tiny-sd15 at 64x64"),
                               ("tiny-sd15", SIZE, None)):
        args = build_parser().parse_args(["run", "--model", model, "--size", size, "--backend", str(path),
                                          "--device", "cpu"])
        sweep = _sweep_from_args(args)
        assert sweep.backends[0][0] == "tuned"
        err = capsys.readouterr().err.splitlines()
        if asked is None:
            assert err == [], "a map run on the model and size it was made for warned"
            continue
        assert err == [f"attnprof run: warning: processor map {path} was made for tiny-sd15 at 128x128; this is "
                       f"{asked}: its blocks' choices were timed on other shapes (attnprof tune --model {model} "
                       "--size WxH for these)"]
    # a sweep config: the same line for each of its models the map was not made for, naming the config
    from profiler.execute.grid import loads

    sweep = loads(f"models: [sd15, tiny-sd15]\nsizes: [\"{SIZE}\"]\nbackends: [{path}]\ndevice: cpu\n", "s.yaml")
    assert sweep.backends[0][0] == "tuned"
    assert capsys.readouterr().err.splitlines() == [
        f"attnprof sweep: s.yaml: warning: processor map {path} was made for tiny-sd15 at 128x128; this is sd15 at "
        f"{SIZE}: its blocks' choices were timed on other shapes (attnprof tune --model sd15 --size WxH for these)"]
    # profiler.tune's map of a user's pipeline names its classes: at its own size no warning, at another one
    path.write_text(json.dumps({"model": "StableDiffusionPipeline UNet2DConditionModel", "width": 128, "height": 128,
                                "blocks": {}, "default": {"backend": "sdpa"}}))
    for size, warned in ((SIZE, False), ("64x64", True)):
        _sweep_from_args(build_parser().parse_args(["run", "--model", "tiny-sd15", "--size", size, "--backend",
                                                    str(path), "--device", "cpu"]))
        assert bool(capsys.readouterr().err) is warned, size


@pytest.mark.parametrize("doc, says", [
    ("not json", "not valid JSON"),
    ({"default": {"backend": "sdpa"}}, 'no "blocks" mapping'),
    ({"blocks": {"b": {"backend": "nope"}}}, "unknown backend 'nope'"),
    ({"blocks": {"b": {"backend": "split", "options": {"budget_bytes": 0}}}}, "use a whole number >= 1"),
    ({"blocks": {"b": {"backend": "other.json"}}}, "names another map"),
    ({"blocks": {"a": {"backend": "split"}, "b": {"backend": "split", "options": {"budget_bytes": 9}}}},
     "two sets of options"),
    ({"blocks": {}}, "names no block and no default"),
])
def test_a_bad_map_is_one_line_naming_the_file(tmp_path, doc, says):
    path = tmp_path / "bad.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["run", "--model", "tiny-sd15", "--size", "64x64", "--backend", str(path), "--out",
                     str(tmp_path / "r")]) == 2
    line = err.getvalue().strip()
    assert "\n" not in line and "bad.json" in line and says in line, line
    assert not (tmp_path / "r").exists()  # nothing run or written


def test_a_missing_map_file_is_one_line(tmp_path):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["run", "--model", "tiny-sd15", "--backend", str(tmp_path / "gone.json")]) == 2
    assert "gone.json: cannot be read" in err.getvalue() and err.getvalue().count("\n") == 1


@pytest.mark.parametrize("argv, says", [
    (["--size", "64x64", "--size", "128x128"], "tune takes one --size"),
    (["--backend", "nope"], "unknown backend 'nope'"),
    (["--backend", "tuned.json"], "tune times backends by name"),
    (["--rounds", "1"], "--rounds 1 is too small"),
    (["--option", "slice_size=4"], "--option slice_size=4 needs --backend NAME"),
    (["--proof-rounds", "2"], "--proof-rounds 2 is too small: the noise rule judges 3 samples at least"),
    (["--budget", "24"], "has no unit"),
    (["--budget", "1MiB"], "whatever the backends"),  # the weights alone: found by the planner, nothing timed
    (["--budget", "14MiB", "--backend", "naive"], "no backend keeps the forward within the budget 14.0 MiB at"),
])
def test_bad_input_to_tune_is_one_line_and_stores_nothing(tmp_path, argv, says):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["tune", "--model", "tiny-sd15", "--device", "cpu", "--out", str(tmp_path / "t"), "--quiet",
                     *(["--size", "128x128"] if "--size" not in argv else []), *argv]) == 2
    line = err.getvalue().strip()
    assert "\n" not in line and says in line, line
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("under", ["", "sub"])
def test_tune_with_out_a_file_fails_before_any_timing(tmp_path, monkeypatch, under):
    """issue 64 (3): --out a file (or a folder under one) is one line before the trace and the first timing, as run
    and record say it; it was said only once every shape and the whole proof were timed."""
    from profiler.tuning import search

    def timed(*args, **kwargs):
        raise AssertionError("a shape was timed before --out was checked")

    monkeypatch.setattr(search, "measure_shapes", timed)
    (tmp_path / "afile").write_text("")
    out = tmp_path / "afile" / under if under else tmp_path / "afile"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["tune", "--model", "tiny-sd15", "--size", "256x256", "--device", "cpu", "--out", str(out),
                     "--quiet"]) == 2
    line = err.getvalue().strip()
    assert line == f"attnprof: error: cannot write the results folder {out} (Not a directory): choose another " \
                   "with --out", line
    assert (tmp_path / "afile").read_text() == ""


def test_a_map_tuned_for_another_model_warns_once_where_profiler_apply_puts_it(tmp_path, tiny_sd15):
    """Issue 64 (4): a map whose blocks' head dims are another model's (SD 1.5's 40, on tiny-sd15's 4 and 8) or that
    lists blocks the model lacks warns in one line naming the first; tiny-sd15's own head dims, nothing."""
    import warnings

    import profiler

    block = "down_blocks.0.attentions.0.transformer_blocks.0.attn1"
    mine = tiny_sd15.get_submodule(block)
    for blocks, says in (({block: {"backend": "naive", "head_dim": 40}}, f"({block}: head dim 40 there, "
                                                                           f"{mine.inner_dim // mine.heads} here)"),
                         ({"down_blocks.9.attn1": {"backend": "naive"}}, "(down_blocks.9.attn1: not in this model)"),
                         ({block: {"backend": "naive", "head_dim": mine.inner_dim // mine.heads}}, None)):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            profiler.apply(tiny_sd15, _map(tmp_path, blocks, {"backend": "sdpa"}))
        profiler.apply(tiny_sd15, None)
        said = [str(w.message) for w in seen if "processor map" in str(w.message)]
        if says is None:
            assert said == []
            continue
        assert len(said) == 1 and says in said[0] and said[0].startswith("processor map m.json: 1 of its 1 blocks "
                                                                          "are not this model's"), said
    # record --backend and profiler.profile(backend=...): the session that swaps the map in says the same
    from profiler.record.session import Session

    path = _map(tmp_path, {block: {"backend": "naive", "head_dim": 40}}, {"backend": "sdpa"})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        Session(tiny_sd15, backend=str(path))
    assert [str(w.message) for w in seen if "processor map" in str(w.message)] == [
        f"processor map m.json: 1 of its 1 blocks are not this model's ({block}: head dim 40 there, "
        f"{mine.inner_dim // mine.heads} here): it was tuned for another model, its choices timed on other shapes "
        "(profiler.tune this one)"]


def test_a_bad_map_applied_changes_nothing_and_tune_asks_for_what_it_lacks(tmp_path, tiny_sd15):
    import profiler

    own = dict(tiny_sd15.attn_processors)
    block = "down_blocks.0.attentions.0.transformer_blocks.0.attn1"
    for path, says in ((_map(tmp_path, {block: {"backend": "nope"}}), "unknown backend 'nope'"),
                       (_map(tmp_path, {block: {"backend": "naive"}}, name="p.json"),
                        "not in it and it has no default"),
                       (tmp_path / "gone.json", "cannot be read")):
        with pytest.raises(InputError, match=says):
            profiler.apply(tiny_sd15, path)
        assert all(a is b for a, b in zip(tiny_sd15.attn_processors.values(), own.values()))
    assert list(profiler.processors(tmp_path / "p.json")) == [f"{block}.processor"]  # the map's blocks alone
    with pytest.raises(InputError, match="not a processor map"):
        profiler.apply(tiny_sd15, 42)
    with pytest.raises(InputError, match="give the module's forward inputs"):
        profiler.tune(tiny_sd15)
    with pytest.raises(InputError, match="attnprof tune --model NAME --size WxH --budget"):
        profiler.tune(tiny_sd15, budget="1GiB")
    with pytest.raises(InputError, match="profiler.tune: proof_rounds 2 is too small: the noise rule judges 3"):
        profiler.tune(tiny_sd15, torch.zeros(1), proof_rounds=2)


def test_each_block_says_why_its_backend_was_chosen():
    """search.choose on figures given (its rule, not a timing): the fastest beyond noise, within noise of its
    runner-up, the fastest that fits the budget (naming what the faster would need), the only one that runs the
    shape within tolerance (naming the others and why), and a faster one off the fp32 reference left out."""
    from profiler.measure.replay import SHAPE
    from profiler.tuning import search

    def row(block, tokens, kind="self"):
        return {"block": block, "batch": 1, "heads": 8, "head_dim": 40, "tokens_q": tokens,
                "tokens_k": tokens if kind == "self" else 77, "kind": kind, "upcast": ""}

    def fig(ms, spread=0.01, ok=True):
        return {"time_ms": ms, "iqr_ms": spread, "time_samples_ms": [ms - spread, ms, ms + spread] * 2,
                "max_rel_err": 1e-6 if ok else 0.5, "error_ok": ok}

    naive, sdpa, split = (search.key_of(n, backends.check_options(n, {})) for n in ("naive", "sdpa", "split"))
    rows = [row("a", 4096), row("b", 1024), row("c", 256), row("d", 64), row("e", 64, "cross")]
    figures = {"a": {naive: fig(1.0), sdpa: fig(2.0)}, "b": {naive: fig(1.0, 0.3), sdpa: fig(1.02, 0.3)},
               "c": {naive: fig(1.0), sdpa: fig(3.0)}, "d": {sdpa: fig(2.0)}, "e": {naive: fig(0.5, ok=False),
                                                                                   sdpa: fig(0.9)}}
    refused = {"d": {naive: "naive cannot run this call (made up for the test)"}}
    shapes = {tuple(r[k] for k in SHAPE): {"row": r, "figures": figures[r["block"]],
                                           "refused": refused.get(r["block"], {})} for r in rows}
    fits = lambda r, key: not (r["block"] == "c" and key == naive)  # noqa: E731
    need = lambda r, key: 3 * 2**30  # noqa: E731
    chosen = search.choose(rows, shapes, fits, need, 2 * 2**30)
    assert {b: e["backend"] for b, e in chosen.items()} == {"a": "naive", "b": "naive", "c": "sdpa", "d": "sdpa",
                                                            "e": "sdpa"}
    assert chosen["a"]["why"] == "fastest" and chosen["a"]["runner_up"] == "sdpa" and chosen["a"]["runner_up_ms"] == 2
    assert chosen["b"]["why"] == "fastest (within noise of sdpa)"
    assert chosen["c"]["why"] == "fits the budget: naive (1.000 ms) would take the forward to 3.0 GiB, over 2.0 GiB"
    assert chosen["d"]["why"] == ("the only one that runs this shape within tolerance (naive: naive cannot run this "
                                  "call (made up for the test))")
    assert chosen["e"]["why"] == "the only one that runs this shape within tolerance (naive 5.0e-01 off the fp32 " \
                                 "reference)"


def _figure(ms: float, spread: float = 0.01, ok: bool = True) -> dict:
    """A shape's figures as measure_shapes gives them (time, samples, memory, kernel, error), made up for a rule's
    test: no timing decides it."""
    return {"time_ms": ms, "iqr_ms": spread, "noisy": False, "time_samples_ms": [ms - spread, ms, ms + spread] * 2,
            "rounds_ms": [ms, ms], "peak_mem_bytes": 2**20, "kernel": "made up", "sdpa_kernel": "",
            "max_rel_err": 1e-6 if ok else 0.5, "error_ok": ok}


def test_under_a_budget_no_single_backend_over_it_is_ever_kept():
    """No single backend keeps tiny-sd15's forward within the budget (each one's planned peak over it), the mix does
    (naive where its tables fit, sdpa elsewhere): best_single names none, so the proof has no single backend to
    keep where the mix is no faster than the others, and the map stays the mix, within the budget; its last line says
    why it was not proved against a single backend."""
    from profiler.measure.replay import shape_of
    from profiler.planner.forward import trace
    from profiler.tuning import search, tuner

    GiB = 2**30
    rows = trace("tiny-sd15", 128, 128, 1, "float32", "cpu", [])["rows"]
    naive, sdpa = (search.key_of(n, backends.check_options(n, {})) for n in ("naive", "sdpa"))
    shapes = {shape_of(r): {"row": r, "refused": {}, "figures": {naive: _figure(1.0), sdpa: _figure(2.0)}}
              for r in rows}
    budget, planned = 2 * GiB, {naive: 3 * GiB, sdpa: 5 * GiB // 2}
    blocks = search.choose(rows, shapes, lambda r, k: k == sdpa or r["tokens_q"] <= 64, lambda r, k: 3 * GiB, budget)
    single, total, note = search.best_single(rows, shapes, [naive, sdpa], planned.get, budget)
    assert single is None and total is None
    assert note == ("no single backend keeps the forward within the budget 2.0 GiB (naive 3.0 GiB, sdpa 2.5 GiB): the "
                    "map is not proved against one"), note
    base = CellSpec("tiny-sd15", 128, 128, 1, "float32", "sdpa", "cpu")
    found = tuner.Search(base, rows, [naive, sdpa], shapes, blocks, single, {}, note, budget,
                         {"mix": 3 * GiB // 2, "naive": planned[naive], "sdpa": planned[sdpa]})
    contenders = tuner._contenders(found)
    assert set(contenders) == {"mix", "sdpa"}
    same = {"samples_ms": [10.0, 10.1, 9.9, 10.0], "max_rel_err": 1e-7, "error_ok": True}
    tuned = tuner._finish(found, {name: dict(same) for name in contenders}, "U-Net forward", None, "", print)
    assert {e["backend"] for e in tuned.map["blocks"].values()} == {"naive", "sdpa"}
    assert not tuned.map["kept_single"] and tuned.map["single"] is None
    assert tuned.map["planned_forward_peak_bytes"]["mix"] <= budget
    last = str(tuned).strip().splitlines()[-1]
    assert last.startswith("tuned: no single backend keeps the forward within the budget 2.0 GiB") and \
        "against sdpa's" in last, last


def _found(rows, shapes, keys, blocks, single, note="", budget=None, planned=None):
    from profiler.tuning import tuner

    base = CellSpec("tiny-sd15", 128, 128, 1, "float32", "sdpa", "cpu")
    return tuner.Search(base, rows, keys, shapes, blocks, single, {}, note, budget, planned or {})


def test_a_map_whose_forward_is_off_the_reference_is_not_kept_and_says_so():
    """The mixed forward faster beyond noise but off the fp32 reference (its whole forward's error over float32's
    tolerance) where the single backend's is not: the map keeps the single backend, each block and the last line
    saying why. With no single backend to fall back on, the map is the mix and its last line warns."""
    from profiler.measure.replay import shape_of
    from profiler.planner.forward import trace
    from profiler.tuning import proof, search, tuner

    rows = trace("tiny-sd15", 128, 128, 1, "float32", "cpu", [])["rows"]
    naive, sdpa = (search.key_of(n, backends.check_options(n, {})) for n in ("naive", "sdpa"))
    shapes = {shape_of(r): {"row": r, "refused": {}, "figures": {
        naive: _figure(1.0 if r["kind"] == "self" else 4.0), sdpa: _figure(2.0)}} for r in rows}
    blocks = search.choose(rows, shapes)
    single, _, _ = search.best_single(rows, shapes, [naive, sdpa])
    assert single == sdpa and {e["backend"] for e in blocks.values()} == {"naive", "sdpa"}
    fast = {"samples_ms": [10.0, 10.1, 9.9, 10.0], "max_rel_err": 0.5, "error_ok": False}
    slow = {"samples_ms": [20.0, 20.1, 19.9, 20.0], "max_rel_err": 1e-7, "error_ok": True}
    tuned = tuner._finish(_found(rows, shapes, [naive, sdpa], blocks, single), {proof.MIX: fast, "sdpa": slow},
                          "U-Net forward", None, "", print)
    assert tuned.map["kept_single"] and {e["backend"] for e in tuned.map["blocks"].values()} == {"sdpa"}
    assert tuned.map["proof"]["single"]["faster"]  # faster, and still not kept
    kept = next(e for e in tuned.map["blocks"].values() if e["proposed"] == "naive")
    assert kept["why"] == ("kept sdpa: the mixed U-Net forward was 5.0e-01 off the fp32 reference, beyond the float32 "
                           "tolerance (the mix's pick here: naive)"), kept["why"]
    assert tuned.cell["error_ok"] is True  # what the map runs: sdpa's forward
    last = str(tuned).strip().splitlines()[-1]
    assert last.endswith("; 5.0e-01 off the fp32 reference, beyond the float32 tolerance, so the map keeps sdpa in "
                         "every block."), last
    # nothing to fall back on (no single backend runs every call): the mix, said to be off
    tuned = tuner._finish(_found(rows, shapes, [naive, sdpa], blocks, None, "no single backend runs every call "
                                 "within tolerance"), {proof.MIX: fast}, "U-Net forward", None, "", print)
    assert {e["backend"] for e in tuned.map["blocks"].values()} == {"naive", "sdpa"}
    last = str(tuned).strip().splitlines()[-1]
    assert "BEWARE: the map's U-Net forward is 5.0e-01 off the fp32 reference, beyond the float32 tolerance" in last


def test_a_kernel_that_refuses_a_shape_is_left_out_of_it_and_a_bug_is_not(faults):
    """search.measure_shapes on tiny-sd15's 256-token self-attention: a backend raising an allocation failure or a
    kernel's RuntimeError there is left out of the shape with what it said; one raising a TypeError (a bug of ours,
    not a refusal) stops the tune with its traceback rather than reading as "refused"."""
    from profiler.planner.forward import trace
    from profiler.tuning import search

    row = next(r for r in trace("tiny-sd15", 128, 128, 1, "float32", "cpu", [])["rows"] if r["tokens_q"] == 256)
    base = CellSpec("tiny-sd15", 128, 128, 1, "float32", "sdpa", "cpu")
    keys = [search.key_of(n, {}) for n in ("sdpa", "fault-error", "fault-torch-oom")]
    found = search.measure_shapes([row], keys, base, repeats=1, warmup=0)
    m = next(iter(found.values()))
    assert set(m["figures"]) == {keys[0]}
    assert m["refused"][keys[1]] == "RuntimeError: kernel exploded"
    assert m["refused"][keys[2]].startswith("OutOfMemoryError: CUDA out of memory. Tried to allocate 3.16 GiB")
    with pytest.raises(TypeError, match="unsupported operand"):
        search.measure_shapes([row], [keys[0], search.key_of("fault-bug", {})], base, repeats=1, warmup=0)
