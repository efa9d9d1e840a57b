"""attnprof tune, profiler.tune, the processor map and profiler.apply (issue 54): real tiny-sd15 U-Nets (SD 1.5's
block topology), real processors; speed differences injected by plugins (tests/faults.py: fault-slow-at, much slower
at one shape only; fault-paced, a set wait on every call), so that no verdict depends on the machine's load."""
import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from profiler.attention import backends, mix
from profiler.cli import main
from profiler.spec import CellSpec, InputError
from profiler.store import Run, list_runs

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


def _blocks_of(run_dir: Path, label: str) -> list[dict]:
    cells, blocks = Run.open(run_dir).read()
    cell = cells[cells["backend_label"] == label].iloc[0]
    assert cell["status"] == "ok", cell["error"]
    return blocks[blocks["cell_id"] == cell["cell_id"]].sort_values("call_index").to_dict("records")


def test_tune_avoids_a_backend_where_it_is_slow_and_only_there_and_run_measures_the_map(tmp_path, faults):
    """fault-slow-at is SDPA but 60 ms late on one shape (self-attention over 64 tokens: 5 of the 32 calls);
    fault-paced is SDPA 10 ms late on every call. The map runs fault-paced on exactly those 5 blocks, fault-slow-at
    on the 27 others; the proof (the whole forward, interleaved) finds it faster than the best single backend; `run
    --backend MAP` measures it as a cell of its own, the slow shape's calls paced, the others not."""
    out = _cli(["tune", "--model", "tiny-sd15", "--size", SIZE, "--device", "cpu", "--backend", "fault-slow-at",
                "--backend", "fault-paced", "--proof-rounds", "3", "--out", str(tmp_path / "t"), "--quiet"])
    last = out.strip().splitlines()[-1]
    assert last.startswith("tuned: the mixed U-Net forward took") and "faster by the noise rule" in last, last
    run_dir = list_runs(tmp_path / "t")[0]
    doc = json.loads((run_dir / "tuned.json").read_text())
    slow = {b for b, e in doc["blocks"].items() if e["kind"] == "self" and e["tokens_q"] == faults.SLOW_AT_TOKENS}
    assert len(slow) == 5 and len(doc["blocks"]) == 32
    assert {b for b, e in doc["blocks"].items() if e["backend"] == "fault-paced"} == slow
    assert all(doc["blocks"][b]["why"].startswith("fastest") for b in doc["blocks"])
    single = doc["proof"]["single"]
    assert single["faster"] and single["speedup"] > 1.2 and single["speedup_low"] > 1, single
    # the map measured: a cell of its own, each call its block's backend
    _cli(["run", "--model", "tiny-sd15", "--size", SIZE, "--device", "cpu", "--backend", str(run_dir / "tuned.json"),
          "--repeats", "1", "--warmup", "0", "--in-process", "--out", str(tmp_path / "r"), "--quiet"])
    calls = _blocks_of(list_runs(tmp_path / "r")[0], "tuned (tuned.json)")
    paced = sorted(c["time_ms"] for c in calls if c["block"] in slow)
    others = sorted(c["time_ms"] for c in calls if c["block"] not in slow)
    assert faults.PACED_MS <= paced[len(paced) // 2] < faults.SLOW_AT_MS, paced
    assert others[len(others) // 2] < faults.PACED_MS, others


def test_under_a_budget_the_map_mixes_and_its_planned_peak_is_the_measured_one(tmp_path, faults):
    """naive is the fastest at every shape (fault-paced waits 10 ms a call) but its whole forward does not fit the
    budget; fault-paced fits (SDPA's memory) but is slower: no single backend both fits and is fastest. The map mixes
    them, its planned forward peak within the budget; a measured CPU run of it peaks where the plan says."""
    from profiler.planner.forward import trace
    from profiler.tuning.tuner import tune_model

    traced = trace("tiny-sd15", 128, 128, 1, "float32", "cpu", ["naive", "fault-paced"])
    fat, lean = (traced["backends"][n]["predicted_forward_peak_bytes"] for n in ("naive", "fault-paced"))
    budget = (fat + lean) // 2
    assert lean < budget < fat
    tuned = tune_model("tiny-sd15", 128, 128, 1, "float32", "cpu", budget, ["naive", "fault-paced"],
                       proof_rounds=3, out=tmp_path / "t")
    doc = tuned.map
    chosen = {e["backend"] for e in doc["blocks"].values()}
    assert chosen == {"naive", "fault-paced"}, chosen
    assert doc["single"] == "fault-paced" and not doc["kept_single"]  # the only one that fits, and slower
    assert lean <= doc["planned_forward_peak_bytes"]["mix"] <= budget
    budgeted = [e for e in doc["blocks"].values() if e["backend"] == "fault-paced"]
    assert all(e["why"].startswith("fits the budget: naive") for e in budgeted)
    assert tuned.cell["verdict"] == "improvement"
    _cli(["run", "--model", "tiny-sd15", "--size", SIZE, "--device", "cpu", "--backend", str(tuned.path),
          "--repeats", "1", "--warmup", "0", "--in-process", "--out", str(tmp_path / "r"), "--quiet"])
    cells = Run.open(list_runs(tmp_path / "r")[0]).cells()
    cell = cells.iloc[0]
    assert cell["status"] == "ok" and cell["predicted_forward_peak_bytes"] == doc["planned_forward_peak_bytes"]["mix"]
    assert abs(cell["forward_peak_total_bytes"] / cell["predicted_forward_peak_bytes"] - 1) < 0.01, \
        (cell["forward_peak_total_bytes"], cell["predicted_forward_peak_bytes"])
