"""Run against run: the matching and the noise rule on constructed tables whose verdicts are worked out by hand;
attnprof diff's exit codes."""
import json

import pandas as pd
import pytest

from profiler.cli import main
from profiler.report.compare import (IMPROVEMENT, MIN_SAMPLES, REGRESSION, SAME, compare, peak_verdict, quartiles,
                                     summary, time_verdict)
from profiler.store import Run, list_runs

MiB = 2**20


def cell(backend: str, samples: list[float], peak: float = 10 * MiB, status: str = "ok", size: int = 512,
         options: str = "{}") -> dict:
    return {"model": "sd15", "width": size, "height": size, "batch": 1, "dtype": "float16", "backend": backend,
            "backend_options": options, "status": status, "attention_time_samples_ms": samples,
            "attention_peak_mem_bytes": peak, "cell_id": f"{backend}{size}{options}"}


def test_quartiles_of_the_samples():
    assert quartiles([10.0, 12.0, 11.0, 13.0, 9.0]) == (10.0, 11.0, 12.0)
    assert quartiles([4.0]) == (4.0, 4.0, 4.0)


@pytest.mark.parametrize("a, b, ratio, verdict", [
    # 10% slower, B's IQR [10.9, 11.1] above A's [9.9, 10.1]: a regression
    ([9.8, 9.9, 10.0, 10.1, 10.2], [10.8, 10.9, 11.0, 11.1, 11.2], 1.1, REGRESSION),
    # 10% slower but the spreads overlap (A's Q3 10.5 > B's Q1 10.25): within noise
    ([9.0, 9.5, 10.0, 10.5, 11.0], [10.0, 10.25, 11.0, 11.75, 12.0], 1.1, SAME),
    # 3% slower, spreads apart: under the 5% threshold, within noise
    ([10.0, 10.0, 10.0], [10.3, 10.3, 10.3], 1.03, SAME),
    # 20% faster, spreads apart: an improvement
    ([10.0, 10.1, 10.2], [8.0, 8.08, 8.16], 0.8, IMPROVEMENT),
])
def test_the_noise_rule(a, b, ratio, verdict):
    got_ratio, got, note = time_verdict(a, b, 0.05)
    assert got_ratio == pytest.approx(ratio) and got == verdict and note == ""


@pytest.mark.parametrize("a, b", [([10.0], [5.0]), ([10.0], [20.0]), ([10.0, 10.1], [20.0, 20.1]),
                                  ([10.0, 10.1, 10.2], [20.0, 20.1])])
def test_too_few_samples_are_within_noise_and_say_so(a, b):
    """One sample has an interquartile range of zero, so any change would pass the rule: a CI gate would flap."""
    ratio, verdict, note = time_verdict(a, b, 0.05)
    assert ratio == pytest.approx(sum(b) / len(b) / (sum(a) / len(a))) and verdict == SAME
    assert note == f"too few samples: {len(a)} in A, {len(b)} in B" and MIN_SAMPLES == 3


@pytest.mark.parametrize("a, b, verdict", [
    (10 * MiB, 12 * MiB, REGRESSION),  # +20%, +2 MiB
    (10 * MiB, 10.4 * MiB, SAME),  # +4%: under the threshold
    (1 * MiB, 1.5 * MiB, SAME),  # +50% but 0.5 MiB: under the 1 MiB floor (CPU sdpa's per-thread scratch)
    (100 * MiB, 80 * MiB, IMPROVEMENT),
])
def test_the_peak_rule(a, b, verdict):
    assert peak_verdict(a, b, 0.05) == (pytest.approx(b / a), verdict)


def test_cells_are_matched_on_their_spec_and_the_unmatched_are_listed():
    a = pd.DataFrame([cell("naive", [10.0, 10.1, 10.2]), cell("sdpa", [5.0, 5.0, 5.0]),
                      cell("sliced", [20.0, 20.0], options='{"slice_size": 1}'),
                      cell("split", [7.0, 7.0]), cell("subquad", [9.0, 9.0], status="oom"),
                      cell("naive", [40.0, 40.0], size=1024)])
    b = pd.DataFrame([cell("naive", [12.0, 12.1, 12.2]),  # 19% slower, apart: regression
                      cell("sdpa", [5.0, 5.0, 5.0], peak=12 * MiB),  # same time, 20% more memory: regression
                      cell("sliced", [20.0, 20.0], options='{"slice_size": 4}'),  # other options: unmatched
                      cell("split", [7.0, 7.0], status="oom"),  # ran in A, not in B: regression
                      cell("subquad", [9.0, 9.0]),  # oom in A, ok in B: improvement
                      cell("naive", [40.5, 40.5], size=1024, peak=9 * MiB)])  # 1% slower, 10% less memory
    r = compare(a, b, 0.05)
    m = r["matched"].set_index(["backend", "width"])
    assert m.loc[("naive", 512), ["time_verdict", "peak_verdict", "verdict"]].tolist() == [REGRESSION, SAME,
                                                                                           REGRESSION]
    assert m.loc[("naive", 512), "time_ratio"] == pytest.approx(12.1 / 10.1)
    assert m.loc[("sdpa", 512), ["time_verdict", "peak_verdict", "verdict"]].tolist() == [SAME, REGRESSION,
                                                                                          REGRESSION]
    assert m.loc[("split", 512), "verdict"] == REGRESSION and m.loc[("subquad", 512), "verdict"] == IMPROVEMENT
    assert m.loc[("naive", 1024), ["time_verdict", "peak_verdict", "verdict"]].tolist() == [SAME, IMPROVEMENT,
                                                                                           IMPROVEMENT]
    assert r["only_a"]["backend_options"].tolist() == ['{"slice_size": 1}']
    assert r["only_b"]["backend_options"].tolist() == ['{"slice_size": 4}']
    assert summary(r) == {"matched": 5, "regressions": 3, "improvements": 2, "within_noise": 0,
                          "too_few_samples": 1, "only_a": 1, "only_b": 1}  # naive 1024: two samples


def _run(root, run_id, cells):
    run = Run.create(root, {"command": "test", "cells": [], "environment": {"torch_threads": 1}}, run_id=run_id)
    for c in cells:
        run.record(c, [])
    return run


def test_diff_exits_1_on_a_regression_and_0_otherwise(tmp_path, capsys):
    _run(tmp_path, "a", [cell("naive", [10.0, 10.1, 10.2]), cell("sdpa", [5.0, 5.0, 5.0])])
    _run(tmp_path, "b", [cell("naive", [12.0, 12.1, 12.2]), cell("sdpa", [5.0, 5.0, 5.0])])
    assert main(["diff", "a", "b", "--results", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "2 cells matched: 1 regressions, 0 improvements, 1 within noise" in out and "regression" in out
    assert main(["diff", "a", "a", "--results", str(tmp_path)]) == 0
    assert "0 regressions" in capsys.readouterr().out
    assert main(["diff", "b", "a", "--results", str(tmp_path), "--json"]) == 0  # faster: no regression
    data = json.loads(capsys.readouterr().out)
    assert data["summary"]["improvements"] == 1 and data["matched"][0]["verdict"] in (IMPROVEMENT, SAME)
    assert main(["diff", "a", "b", "--results", str(tmp_path), "--threshold", "0.5"]) == 0  # 19% < 50%
    assert main(["diff", "a", "nope", "--results", str(tmp_path)]) == 2


def test_report_bad_input_gets_one_line_and_no_traceback(dashboard_results, tmp_path, capsys):
    pytest.importorskip("vl_convert", reason="the report embeds vl-convert-python's Vega bundle")
    run_id = list_runs(dashboard_results)[0].name
    args = ["--results", str(dashboard_results), "--html"]
    assert main(["report", "nope", *args, str(tmp_path / "r.html")]) == 2
    assert "no run named 'nope'" in capsys.readouterr().err
    (tmp_path / "afile").write_text("")
    assert main(["report", run_id, *args, str(tmp_path / "afile" / "r.html")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "choose another --html path" in err  # one line, no traceback
    out = tmp_path / "r.html"
    assert main(["report", run_id, *args, str(out)]) == 0
    text = out.read_text()
    assert 'data-charts="7"' in text  # the U-Net, Compare, the roofline, Scaling's tokens, score tables, time, peaks
    assert text.count('<table class="cells">') == 1 and run_id in text
    assert "<h3>Roofline: each call against the device&#x27;s measured limits</h3>" in text
    assert "<h2>Findings</h2>" in text and "was the fastest" in text  # the run's findings, as attnprof show states
    assert "<script src" not in text and "<link" not in text  # nothing to fetch
    assert not [p for p in tmp_path.rglob(".*.part")]  # no partial file left


def test_report_tables_show_a_cells_list_of_trace_files():
    """A CUDA cell run with --trace lists two files; a NaN (a cell without) is an empty cell."""
    import numpy as np

    from dashboards.report import _table

    df = pd.DataFrame({"trace_files": [np.array(["traces/a.trace.json", "traces/a.memory.pickle"]), float("nan")]})
    assert "<td>traces/a.trace.json, traces/a.memory.pickle</td>" in _table(df) and "<td></td>" in _table(df)
