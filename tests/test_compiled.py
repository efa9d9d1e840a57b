"""Compiled U-Nets (the `compile` setting): one real run holding tiny-sd15 at 64x64 with sdpa eager and compiled
(regional), float32 on the CPU, in process (its one compile takes 20-60 s here), read by every test of the run;
the matching of ops to calls, the compile report, diff's and the findings' handling of compiled cells on tables
built by hand."""
import json

import pandas as pd
import pytest
import torch

from profiler.cli import main
from profiler.measure.compiled import compile_report, dynamo_counts, matched
from profiler.report.compare import compare
from profiler.report.findings import compiled_effect, findings
from profiler.spec import InputError
from profiler.store import Run, list_runs
from profiler.unet.workload import check_settings

REGIONAL = json.dumps({"compile": "regional"})


@pytest.fixture(scope="module")
def compiled_run(compiled_results):
    root = compiled_results  # conftest's: made once for the suite
    run = Run.open(list_runs(root)[0])
    cells, blocks = run.read()
    by = {json.loads(s).get("compile", "none"): c for s, c in zip(cells["settings"], cells.to_dict("records"))}
    return root, run, by, blocks


def test_a_compiled_cell_is_measured_apart_from_its_compile(compiled_run):
    _, _, by, blocks = compiled_run
    c = by["regional"]
    assert c["status"] == "ok", c["error"]
    assert c["compile_s"] > 0 and c["compile_cache"].split(":")[0] in ("cold", "warm", "partly warm")
    assert c["graph_breaks"] == 0 and c["graph_break_reasons"] == ""
    assert c["compiled_graphs"] >= 4  # a BasicTransformerBlock graph per level's shapes (64, 16, 4 tokens, mid 1)
    assert len(c["forward_time_samples_ms"]) == 3 and c["forward_time_ms"] > 0
    assert c["error_ok"] and c["max_rel_err"] < 1e-3  # the compiled output against the eager fp32 reference
    assert c["attention_note"] == "" and c["calls"] == 32


def test_each_compiled_call_has_its_sdpa_op_time_and_memory(compiled_run):
    _, _, by, blocks = compiled_run
    mine = blocks[blocks["cell_id"] == by["regional"]["cell_id"]]
    eager = blocks[blocks["cell_id"] == by["none"]["cell_id"]]
    assert len(mine) == 32 and list(mine["block"]) == list(eager["block"])  # the eager recorder's calls, in order
    assert set(mine["kernel"]) == {"aten::_scaled_dot_product_flash_attention_for_cpu"}
    assert set(mine["sdpa_kernel"]) == {"flash"} and set(mine["status"]) == {"ok"}
    assert all(len(s) == 3 and min(s) > 0 for s in mine["time_samples_ms"])
    out_bytes = mine["batch"] * mine["heads"] * mine["tokens_q"] * mine["head_dim"] * 4  # the op's fp32 output
    assert (mine["peak_mem_bytes"] >= out_bytes).all()
    c = by["regional"]
    per_forward = [sum(r) for r in zip(*mine["time_samples_ms"])]  # the attention time: the median of these
    assert c["attention_time_ms"] == pytest.approx(sorted(per_forward)[1])
    assert c["attention_op_time_ms"] == c["attention_time_ms"]
    assert c["attention_peak_mem_bytes"] == mine["peak_mem_bytes"].max()
    assert c["forward_peak_mem_bytes"] > c["attention_peak_mem_bytes"]


def test_the_eager_cell_keeps_its_id_and_gets_its_op_time(compiled_run):
    _, _, by, _ = compiled_run
    e = by["none"]
    assert e["settings"] == "{}"  # compile: none is the default: not stored, the cell id of before
    assert e["attention_op_time_ms"] > 0  # its probe forward's 32 SDPA ops, one per call (else None)
    assert "attention_note" not in e or not isinstance(e["attention_note"], str) or e["attention_note"] == ""


def test_the_findings_and_show_set_the_compiled_cell_beside_the_eager_one(compiled_run, capsys):
    root, run, by, blocks = compiled_run
    c, e = by["regional"], by["none"]
    text = " ".join(findings(run.cells(), blocks))
    a, b = (100 * r["attention_op_time_ms"] / r["forward_time_ms"] for r in (e, c))
    ms = lambda v: f"{v:,.0f} ms" if v >= 100 else f"{v:.2f} ms"  # noqa: E731
    assert (f"At 64x64 compiled (regional), sdpa's forward took {ms(c['forward_time_ms'])} against "
            f"{ms(e['forward_time_ms'])} eager; its attention share (the attention op's time over the forward's) "
            f"went from {a:.1f}% to {b:.1f}%") in text
    assert main(["show", "latest", "--results", str(root)]) == 0
    out = capsys.readouterr().out
    assert "eager forward" in out and "compiled (regional)" in out and f"{c['compile_s']:.1f} s" in out


def test_diff_lines_up_a_compiled_run_with_an_eager_one(compiled_run):
    _, run, by, _ = compiled_run
    cells = run.cells()
    eager, comp = cells[cells["settings"] == "{}"], cells[cells["settings"] == REGIONAL]
    m = compare(eager, comp)["matched"]
    assert len(m) == 1 and (m.iloc[0]["compile_a"], m.iloc[0]["compile_b"]) == ("none", "regional")
    assert m.iloc[0]["time_a_ms"] == pytest.approx(by["none"]["forward_time_ms"])  # the forwards, not attention
    assert m.iloc[0]["peak_b_bytes"] == by["regional"]["forward_peak_mem_bytes"]
    assert "eager against compiled (regional)" in m.iloc[0]["note"]
    both = compare(cells, cells)["matched"]  # a run against itself: each cell with its own
    assert len(both) == 2 and (both["compile_a"] == both["compile_b"]).all()


def test_a_backend_with_no_attention_op_of_its_own_gets_no_per_call_time():
    row = {"call_index": 0, "block": "down_blocks.0.attentions.0.transformer_blocks.0.attn1", "batch": 1, "heads": 8,
           "tokens_q": 64, "tokens_k": 64, "head_dim": 4}
    assert "naive's attention is several ops" in matched([row], [], "naive")
    op = {"name": "aten::_scaled_dot_product_flash_attention_for_cpu", "shapes": [[1, 8, 64, 4], [1, 8, 64, 4]]}
    assert matched([row], [op], "sdpa") == ""
    assert matched([row], [op, op], "sdpa") == "the compiled forward ran 2 attention ops for 1 calls: no per-call time"
    assert "is not call 0" in matched([{**row, "tokens_k": 77}], [op], "sdpa")


def test_graph_breaks_and_the_cache_are_read_from_dynamos_counters():
    def broken(x):
        y = x + 1
        torch._dynamo.graph_break()
        return y * 2

    torch._dynamo.reset()
    before = dynamo_counts()
    torch.compile(broken, backend="eager")(torch.ones(2))  # Dynamo only: no Inductor, no cache
    report = compile_report(before, dynamo_counts())
    assert report["graph_breaks"] == 1 and "graph_break" in report["graph_break_reasons"]
    assert report["compiled_graphs"] == 2 and report["compile_cache"] == "cold"
    base = {"breaks": {}, "graphs": 0, "hit": 0, "miss": 0, "bypass": 0}
    assert compile_report(base, {**base, "hit": 3})["compile_cache"] == "warm"
    assert compile_report(base, {**base, "hit": 1, "miss": 2})["compile_cache"] == \
        "partly warm: 1 of 3 graphs from Inductor's cache"


def _cell(settings: str, forward: float, op: float | None, **extra) -> dict:
    return {"model": "sd15", "width": 512, "height": 512, "batch": 1, "dtype": "float16", "backend": "naive",
            "backend_options": "{}", "status": "ok", "settings": settings, "cell_id": settings + "naive",
            "forward_time_ms": forward, "forward_time_samples_ms": [forward] * 3, "forward_peak_mem_bytes": 100,
            "attention_time_ms": op if op is not None else float("nan"),
            "attention_time_samples_ms": [op] * 3 if op is not None else [], "attention_peak_mem_bytes": 50,
            "attention_op_time_ms": op, "noisy": False, "error_ok": True, "max_rel_err": 0.0, "compile_s": 30.0,
            "compile_cache": "cold", "attention_note": "", "graph_breaks": 0, "graph_break_reasons": "", **extra}


def test_a_fused_compiled_cell_keeps_its_forward_and_says_why_it_has_no_share():
    note = "naive's attention is several ops (matmuls, a softmax) that Inductor compiles together: no op"
    cells = pd.DataFrame([_cell("{}", 200.0, None, compile_s=None),
                          _cell(REGIONAL, 120.0, None, attention_note=note, graph_breaks=2,
                                graph_break_reasons="2x builtin print")])
    from profiler.report.frame import normalised

    cells = normalised(cells)  # as Run.cells() gives them
    (line,) = compiled_effect(cells)
    assert line == ("At 512x512 compiled (regional), naive's forward took 120 ms against 200 ms eager; no attention "
                    "share: naive's attention is several ops (matmuls, a softmax) that Inductor compiles together; "
                    "Dynamo broke its graph 2 times (2x builtin print) (compiled in 30.0 s, Inductor's cache cold).")
    text = " ".join(findings(cells, pd.DataFrame()))
    assert "nan" not in text


def test_the_compile_setting_is_checked_and_a_sweep_key():
    assert check_settings("tiny-sd15", {"compile": "full"}) == (("compile", "full"),)
    assert check_settings("tiny-sd15", {"compile": "none"}) == ()
    with pytest.raises(InputError, match="setting compile='max': use none, regional"):
        check_settings("tiny-sd15", {"compile": "max"})
    with pytest.raises(InputError, match="setting compile is for a unet model"):
        check_settings("sd15-vae", {"compile": "full"})
    from profiler.execute.grid import loads

    sweep = loads("models: [tiny-sd15]\ncompile: [none, regional, full]\n", "test")
    assert sorted(dict(c.settings).get("compile", "none") for c in sweep.cells("cpu")) == ["full", "none", "regional"]


def test_the_cached_model_is_eager_again_after_a_compiled_cell():
    """A group's cells share one built model: a compiled cell must leave it as it found it (compiling is lazy, so
    no forward is needed to see what compile_repeated_blocks and Module.compile set)."""
    from profiler.measure.cell import ModelCache
    from profiler.measure.compiled import compiled

    unet = ModelCache().get("tiny-sd15", "float32", "cpu")[1]
    for mode, expected in (("regional", {"BasicTransformerBlock"}), ("full", {"UNet2DConditionModel"})):
        with compiled(unet, mode):
            assert {type(m).__name__ for m in unet.modules() if m._compiled_call_impl is not None} == expected
        assert all(m._compiled_call_impl is None for m in unet.modules())
