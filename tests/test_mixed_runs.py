"""Issue 20 on real runs (conftest's mixed_results): backends named with their options in every text output, and
attnprof diff on one-repeat runs."""
import json

from profiler import backends
from profiler.cli import main
from profiler.store import find_run


def test_label_takes_options_in_every_stored_form():
    for options in ('{"slice_size": 4}', {"slice_size": 4}, (("slice_size", 4),)):
        assert backends.label("sliced", options) == "sliced(slice_size=4)"
    assert backends.label("sliced", '{"slice_size": 1}') == backends.label("sliced", None) == "sliced"  # default


def test_the_sweeps_status_table_names_each_backend_with_its_options(mixed_results):
    lines = mixed_results.sweep_output.splitlines()
    rows = {" ".join(line.split()[:2]): line.split()[2:] for line in lines[2:8]}  # two models: each row names its
    assert lines[0].split() == ["backend", "64x64", "128x128"]
    assert rows == {f"{m} {b}": ["ok"] * 2 for m in ("tiny-sd15", "tiny-sdxl")
                    for b in ("sdpa", "sliced", "sliced(slice_size=4)")}


def test_show_and_runs_name_backends_with_their_options(mixed_results, capsys):
    assert main(["show", mixed_results.mixed, "--results", str(mixed_results.root)]) == 0
    out = capsys.readouterr().out
    table = next(part for part in out.split("\n\n") if part.startswith("model ")).splitlines()
    at = table[0].index(" backend ") + 1  # the family column before it holds spaces ("fused exact")
    named = [line[at:].split()[0] for line in table[2:]]
    assert sorted(named) == sorted(["sdpa", "sliced", "sliced(slice_size=4)"] * 4)
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
    assert only_a.count("sliced(slice_size=4)") == 4 and only_a.count("float32 sliced,") + only_a.endswith(
        "float32 sliced") == 4
    assert only_b.endswith("tiny-sd15 64x64 b1 bfloat16 sliced(slice_size=4), "
                           "tiny-sd15 128x128 b1 bfloat16 sliced(slice_size=4)")


def test_the_sweeps_progress_label_names_the_options():
    from profiler.execute.groups import label
    from profiler.spec import CellSpec

    cell = CellSpec("tiny-sd15", 64, 64, 1, "float32", "sliced", "cpu", (("slice_size", 4),))
    assert label(cell) == "tiny-sd15 64x64 b1 float32 sliced(slice_size=4)"


def test_diff_of_two_one_repeat_runs_judges_nothing_and_says_why(mixed_results, capsys):
    root, a, b = str(mixed_results.root), mixed_results.bf16, mixed_results.again
    assert main(["diff", a, b, "--results", root]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("tiny-sd15")]
    assert len(rows) == 2 and all(line.endswith("within noise  too few samples: 1 in A, 1 in B") for line in rows)
    assert out.rstrip().endswith("2 cells matched: 0 regressions, 0 improvements, 2 within noise; the time of 2 "
                                 "could not be judged: too few samples (a verdict needs 3 per cell in each run: "
                                 "repeats 3 or more)")
    assert "each run holding at least 3 samples of the cell" in out.splitlines()[0]
    assert main(["diff", a, b, "--results", root, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["summary"]["too_few_samples"] == 2 and data["summary"]["regressions"] == 0
    assert {m["time_verdict"] for m in data["matched"]} == {"within noise"}
    assert {m["time_note"] for m in data["matched"]} == {"too few samples: 1 in A, 1 in B"}
    times = [(m["time_a_ms"], m["time_b_ms"]) for m in data["matched"]]
    assert all(x != y for x, y in times)  # real, different timings: only the rule keeps them from a verdict
    assert find_run(mixed_results.root, a).cells()["attention_time_samples_ms"].map(len).tolist() == [1, 1]
