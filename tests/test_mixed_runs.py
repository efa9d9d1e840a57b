"""Issue 20 on real runs (conftest's mixed_results): backends named with their options in every text output, and
attnprof diff on one-repeat runs."""
import json
import shutil
from pathlib import Path

import pandas as pd

from profiler.attention import backends
from profiler.cli import main
from profiler.store import find_run


def test_label_takes_options_in_every_stored_form():
    for options in ('{"slice_size": 4}', {"slice_size": 4}, (("slice_size", 4),)):
        assert backends.label("sliced", options) == "sliced(slice_size=4)"
    assert backends.label("sliced", '{"slice_size": 1}') == backends.label("sliced", None) == "sliced"  # default


def test_the_sweeps_status_table_names_each_backend_with_its_options(mixed_results):
    lines = mixed_results.sweep_output.splitlines()
    rows = {" ".join(line.split()[:2]): line.split()[2:] for line in lines[2:8]}  # two models: each row names its
    assert lines[0].split() == ["backend", "64x64"]
    assert rows == {f"{m} {b}": ["ok"] for m in ("tiny-sd15", "tiny-sdxl")
                    for b in ("sdpa", "sliced", "sliced(slice_size=4)")}


def test_show_and_runs_name_backends_with_their_options(mixed_results, capsys):
    assert main(["show", mixed_results.mixed, "--results", str(mixed_results.root), "--wide"]) == 0
    out = capsys.readouterr().out
    table = next(part for part in out.split("\n\n") if part.startswith("model ")).splitlines()
    at = table[0].index(" backend ") + 1  # the family column before it holds spaces ("fused exact")
    named = [line[at:].split()[0] for line in table[2:]]
    assert sorted(named) == sorted(["sdpa", "sliced", "sliced(slice_size=4)"] * 2)
    assert {line[:at].split(maxsplit=4)[4].strip() for line in table[2:]} == {"chunked", "fused exact"}
    largest = out.split("largest measured per-call peaks:")[1].splitlines()[3:]
    assert largest and all(line.split()[0] in ("sdpa", "sliced", "sliced(slice_size=4)") for line in largest)
    assert main(["runs", "--results", str(mixed_results.root)]) == 0
    capsys.readouterr()
    from profiler.report.show import runs_index

    index = runs_index(mixed_results.root).set_index("run_id")
    assert index.loc[mixed_results.mixed, "backends"] == "sdpa, sliced, sliced(slice_size=4)"
    assert index.loc[mixed_results.bf16, "backends"] == "sliced(slice_size=4)"


def test_diffs_left_out_list_names_backends_with_their_options(mixed_results, capsys):
    assert main(["diff", mixed_results.mixed, mixed_results.bf16, "--results", str(mixed_results.root)]) == 0
    out = capsys.readouterr().out
    only_a = next(line for line in out.splitlines() if line.startswith(f"left out, only in {mixed_results.mixed}"))
    only_b = next(line for line in out.splitlines() if line.startswith(f"left out, only in {mixed_results.bf16}"))
    assert only_a.count("sliced(slice_size=4)") == 2 and only_a.count("float32 sliced,") + only_a.endswith(
        "float32 sliced") == 2
    assert only_b.endswith("tiny-sd15 64x64 b1 bfloat16 sliced(slice_size=4), "
                           "tiny-sd15 128x128 b1 bfloat16 sliced(slice_size=4)")


def test_the_sweeps_progress_label_names_the_options():
    from profiler.execute.groups import label
    from profiler.spec import CellSpec

    cell = CellSpec("tiny-sd15", 64, 64, 1, "float32", "sliced", "cpu", (("slice_size", 4),))
    assert label(cell) == "tiny-sd15 64x64 b1 float32 sliced(slice_size=4)"


def test_diff_of_two_one_repeat_runs_judges_nothing_and_says_why(mixed_results, capsys):
    root, a, b = str(mixed_results.root), mixed_results.bf16, mixed_results.again
    assert main(["diff", a, b, "--results", root]) == 3  # nothing judged: not a pass
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("tiny-sd15")]
    assert len(rows) == 2 and all(line.endswith("not judged  too few samples: 1 in A, 1 in B") for line in rows)
    assert out.rstrip().endswith("2 cells matched: 0 regressions, 0 improvements, 0 within noise, 2 not judged (too "
                                 "noisy, too few samples, timed by different clocks, or the machine's own speed "
                                 "moved as much: see their notes); 2 with too few samples (a verdict needs 3 per cell in each run: repeats 3 "
                                 "or more)")
    assert "a time is not judged where a run holds fewer than 3 samples of the cell" in out.splitlines()[0]
    assert main(["diff", a, b, "--results", root, "--json"]) == 3
    data = json.loads(capsys.readouterr().out)
    assert data["summary"]["too_few_samples"] == 2 and data["summary"]["regressions"] == 0
    assert {m["time_verdict"] for m in data["matched"]} == {"not judged"}
    assert {m["time_note"] for m in data["matched"]} == {"too few samples: 1 in A, 1 in B"}
    times = [(m["time_a_ms"], m["time_b_ms"]) for m in data["matched"]]
    assert all(x != y for x, y in times)  # real, different timings: only the rule keeps them from a verdict
    assert find_run(mixed_results.root, a).cells()["attention_time_samples_ms"].map(len).tolist() == [1, 1]


NEWER = {"cells.parquet": ["settings", "device_name", "device_peak_flops_per_s", "device_peak_bytes_per_s"],
         "blocks.parquet": ["settings", "upcast", "achieved_flops_per_s", "arithmetic_intensity"]}  # since runs began
DERIVED = ["size", "pixels", "aspect", "backend_label", "settings_label", "family"]


def _as_old(src: Path, root: Path, resumed: bool = False) -> Path:
    """A copy of a stored run under root (same id) as runs were written before NEWER's columns existed; resumed:
    then resumed by today's profiler, its first cell recorded again in today's schema beside the old rows."""
    import pyarrow.parquet as pq

    from profiler.store import Run

    dst = root / src.name
    shutil.copytree(src, dst)
    raw = {name: pq.read_table(src / name).to_pandas() for name in NEWER}
    for name, columns in NEWER.items():
        table = pq.read_table(dst / name)
        pq.write_table(table.drop_columns(columns), dst / name)
    if not resumed:
        return dst
    cell = raw["cells.parquet"].iloc[0].to_dict()
    blocks = raw["blocks.parquet"][raw["blocks.parquet"]["cell_id"] == cell["cell_id"]]
    stamps = ["run_id", "recorded_at", "blocks_version"]
    Run.open(dst).record({k: v for k, v in cell.items() if k not in stamps},
                         blocks.drop(columns=stamps[::2]).to_dict("records"))
    return dst


def test_a_run_of_an_older_schema_reads_and_prints_as_todays(mixed_results, tmp_path, capsys):
    """Every reader sees one schema (profiler/report/frame.py): an old run's missing columns filled with what their
    absence meant (no settings, the upcast its 4-byte scores tell, the device as its name), the display columns
    derived, and show (with its findings), diff and the dashboard's tables print what they print for today's run;
    also where old rows and new ones mix in one run (an old run resumed)."""
    from dashboards import transforms as T
    from profiler.store import Run

    new_root, old_root = mixed_results.root, tmp_path / "results"
    runs = (mixed_results.mixed, mixed_results.bf16, mixed_results.again)
    for run_id in runs:
        _as_old(new_root / run_id, old_root)
        path = _as_old(new_root / run_id, tmp_path / "resumed", resumed=True)
        (nc, nb), (oc, ob) = Run.open(new_root / run_id).read(), Run.open(path).read()
        for new, was in ((nc, oc), (nb, ob)):
            assert len(was) == len(new) and set(new.columns) <= set(was.columns) | {"device_uuid", "pci_bus_id"}
            new, was = (f.sort_values(["cell_id", *(["call_index"] if "call_index" in f else [])]).reset_index(
                drop=True) for f in (new, was))
            pd.testing.assert_frame_equal(was[DERIVED + ["settings", "backend_options"]],
                                          new[DERIVED + ["settings", "backend_options"]])
        assert ob.sort_values(["cell_id", "call_index"])["upcast"].tolist() == \
            nb.sort_values(["cell_id", "call_index"])["upcast"].tolist()  # as recorded: the rule holds
        assert oc["device_name"].notna().all() and set(oc["device_name"]) <= set(nc["device_name"]) | {"cpu"}
        pd.testing.assert_frame_equal(T.scaling_table(ob), T.scaling_table(nb))
        pd.testing.assert_frame_equal(T.largest_ok(oc), T.largest_ok(nc))
    for argv in (["show", mixed_results.mixed], ["show", mixed_results.bf16],
                 ["diff", mixed_results.mixed, mixed_results.bf16], ["diff", mixed_results.bf16, mixed_results.again],
                 ["diff", mixed_results.bf16, mixed_results.again, "--json"]):
        printed = []
        for root in (new_root, old_root):
            assert main([*argv, "--results", str(root)]) in (0, 1, 3)
            printed.append(capsys.readouterr().out.replace(str(root), "RESULTS"))
        assert printed[1] == printed[0]


def test_old_rows_get_the_upcast_their_scores_tell_and_the_default_options():
    """Rows stored before `upcast` existed say it only through their scores' bytes: 4-byte scores of a 2-byte dtype
    are U-Net rows upcasting their attention (the memory models' rule); float32 rows upcast nothing worth naming.
    Rows stored before backend_options existed ran the backend's defaults."""
    from profiler.report.frame import normalised

    rows = pd.DataFrame({"dtype": ["float16", "bfloat16", "float32", "float16"], "score_elements": [10] * 4,
                         "score_bytes": [40, 20, 40, 40], "upcast": [None, None, None, "softmax"],
                         "call_index": range(4), "backend": "sliced", "width": 64, "height": 128})
    out = normalised(rows)
    assert out["upcast"].tolist() == ["attention", "", "", "softmax"]
    assert normalised(rows.drop(columns="upcast"))["upcast"].tolist() == ["attention", "", "", "attention"]
    assert out["backend_label"].tolist() == ["sliced"] * 4 and out["settings_label"].tolist() == ["none"] * 4
    assert (out["size"].iloc[0], out["aspect"].iloc[0], out["family"].iloc[0]) == ("64x128", "1:2", "chunked")
