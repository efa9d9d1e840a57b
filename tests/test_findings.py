"""Findings first: the plain sentences `attnprof show`, the end of a sweep and the dashboard state first, computed
from a real run (conftest's dashboard_results: tiny-sd15 at 64x64 and 128x128, naive skipped at 128 by the memory
budget, xformers unavailable; traced_results: a CLI run's closing output)."""
import pandas as pd

from profiler.cli import main
from profiler.report.findings import findings
from profiler.report.frame import normalised
from profiler.store import Run, list_runs


def _findings_block(out: str) -> str:
    """The findings as printed, their lines joined back into sentences."""
    first = out.split("\n\n")[0].splitlines()
    return " ".join(line[2:] for line in first[1:])


def _named_fastest(at, size: str) -> str:
    """What the findings must say of a size's fastest backend: it, where its lead over the runner-up exceeds their
    summed IQRs (numpy's linear quartiles: statistics' inclusive method), else that none is clearly the fastest.
    The cells' samples are this machine's, so either may come."""
    import numpy as np

    ordered = at.sort_values("attention_time_ms")
    if len(ordered) < 2:
        return f"At {size} {ordered.index[0]} was the fastest: "
    iqr = [float(np.subtract(*np.percentile(list(ordered.iloc[i]["attention_time_samples_ms"]), [75, 25])))
           for i in (0, 1)]
    gap = ordered.iloc[1]["attention_time_ms"] - ordered.iloc[0]["attention_time_ms"]
    return f"At {size} {ordered.index[0]} was the fastest: " if gap > sum(iqr) else \
        f"At {size} no backend is clearly the fastest: {ordered.index[0]} "


def test_show_starts_with_the_fastest_backend_per_size_and_its_speedup_against_naive(dashboard_results, capsys,
                                                                                       monkeypatch):
    """Judged as a steady run (whether the machine moved while this real one ran is the next test's, injected)."""
    from profiler.report import compare

    monkeypatch.setattr(compare, "unsteady", lambda manifest: None)
    run = Run.open(list_runs(dashboard_results)[0])
    assert main(["show", "latest", "--results", str(dashboard_results)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"findings ({run.id}):"
    text = _findings_block(out)
    cells = run.cells()
    ok = cells[cells["status"] == "ok"].assign(size=lambda d: d["width"].astype(str) + "x" + d["height"].astype(str))
    at64 = ok[ok["size"] == "64x64"].set_index("backend")
    fast = at64["attention_time_ms"].idxmin()
    naive_ms = at64.loc["naive", "attention_time_ms"]
    speedup = f", {naive_ms / at64.loc[fast, 'attention_time_ms']:.2f}x faster than naive's" if fast != "naive" else ""
    assert _named_fastest(at64, "64x64") in text and (speedup in text or "clearly" in _named_fastest(at64, "64x64"))
    at128 = ok[ok["size"] == "128x128"].set_index("backend")
    assert _named_fastest(at128, "128x128") in text
    assert "(naive skipped here)" in text  # no naive to compare with at 128
    smallest = at64["attention_peak_mem_bytes"].idxmin()
    assert f"{smallest} needed the least memory" in text and "less than naive's" in text
    assert "naive stopped fitting at 128x128 (skipped: predicted forward peak" in text and "it ran up to 64x64" in text
    blocks = run.blocks()
    top = blocks.loc[blocks["peak_mem_bytes"].idxmax()]
    assert f"The largest call was {top['block']} under {top['backend']} at {top['width']}x{top['height']}" in text
    assert "Not available here: xformers (xformers is not installed" in text
    assert out.index("findings") < out.index(f"run {run.id}")  # before the run's header and tables


def test_doubtful_figures_are_named(dashboard_results):
    cells, blocks = Run.open(list_runs(dashboard_results)[0]).read()
    ok = cells.index[cells["status"] == "ok"]
    cells.loc[ok, ["error_ok", "noisy"]] = [True, False]  # every cell as good as can be ...
    assert "No figure is doubtful: every cell that ran is within its error tolerance and none is noisy." in \
        findings(cells, blocks)
    cells.loc[ok[0], ["error_ok", "max_rel_err"]] = [False, 0.25]  # ... but two
    cells.loc[ok[1], "noisy"] = True
    found = findings(cells, blocks)
    first, second = cells.loc[ok[0]], cells.loc[ok[1]]
    assert f"Doubtful: {first['backend']} at {first['width']}x{first['height']} is 2.5e-01 off the fp32 reference, " \
           "over the float32 tolerance." in found
    assert f"Noisy times (IQR over 10% of the median), so doubtful: at {second['width']}x{second['height']}: " \
           f"{second['backend']}." in found
    cells.loc[ok, "noisy"] = True  # many noisy cells: one clause per size
    noisy = next(s for s in findings(cells, blocks) if s.startswith("Noisy times"))
    assert noisy.count(" at ") == cells.loc[ok].groupby(["width", "height"]).ngroups


def test_findings_name_the_settings_that_tell_apart_cells_of_one_size(dashboard_results):
    """A run with ControlNet cells beside plain ones: every finding says which cells it means."""
    cells, blocks = Run.open(list_runs(dashboard_results)[0]).read()
    ok = cells[(cells["status"] == "ok") & (cells["width"] == 64)]
    plain = ok.assign(noisy=False, error_ok=True)
    controlnet = normalised(ok.assign(settings='{"controlnet": true}', noisy=True, error_ok=True))  # as read
    text = " ".join(findings(pd.concat([plain, controlnet], ignore_index=True), blocks))
    assert "At 64x64 (no settings) " in text and "At 64x64 (controlnet) " in text
    assert f"so doubtful: at 64x64 (controlnet): {', '.join(controlnet['backend'])}." in text


def test_a_run_ends_with_its_findings(traced_results):
    _, printed = traced_results
    status, rest = printed.split("findings", 1)
    judged = "was the fastest" if "was the fastest" in rest else "no backend is named the fastest"  # a machine
    assert "naive" in status and "At 64x64 " in rest and judged in rest  # that moved while it ran: the second
    assert rest.index(judged) < rest.index("results: ")


def test_a_run_made_while_the_machine_slowed_is_named_judged_by_no_one_and_weighted_down(tmp_path, monkeypatch,
                                                                                          capsys):
    """The machine's speed injected 1.5x slower at the run's end calibration than at its start (the calibrations read
    10 ms and 15 ms): show says so first and names no fastest backend, and the time model weights the run down by
    1/1.5^2 and says why."""
    from profiler.measure import calibrate as measured
    from profiler.measure.limits import device_key
    from profiler.planner import calibration, timing

    def slowed(device, when):
        ms = 15.0 if when == "end" else 10.0
        return {"when": when, "at": "injected", "median_ms": ms, "samples_ms": [ms], "workload": measured.WORKLOAD}

    monkeypatch.setattr(measured, "calibrate", slowed)
    assert main(["run", "--model", "tiny-sd15", "--size", "64x64", "--backend", "naive", "--backend", "sdpa",
                 "--device", "cpu", "--dtype", "float32", "--repeats", "1", "--warmup", "0", "--in-process",
                 "--quiet", "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    (path,) = list_runs(tmp_path)
    ratio = 1.5
    assert main(["show", "latest", "--results", str(tmp_path)]) == 0
    text = _findings_block(capsys.readouterr().out)
    assert text.startswith("Times not judged: the machine's speed moved") and "was the fastest" not in text
    assert "At 64x64 no backend is named the fastest (the machine moved: above)" in text
    c = calibration.calibrate(tmp_path, device_key("cpu", kept=True), write=False)
    assert c["passed_over"][path.name].startswith(f"weighted 1/{ratio ** 2:.2f}: the machine's speed moved")
    assert "weighted down 1 run (" in timing.passed_text(c["passed_over"])


def test_show_fits_120_columns_unless_wide(dashboard_results, capsys, monkeypatch):
    """show's table and notes fit $COLUMNS (120 here), the columns it left out named; --wide gives them all."""
    monkeypatch.setenv("COLUMNS", "120")
    assert main(["show", "latest", "--results", str(dashboard_results)]) == 0
    out = capsys.readouterr().out
    body = out.split("\n\n", 1)[1]  # after the findings
    table = [line for line in body.splitlines() if not line.startswith(("command:", "run ", "device "))]
    assert max(map(len, table)) <= 120, max(table, key=len)
    assert "--wide shows them" in out
    assert main(["show", "latest", "--results", str(dashboard_results), "--wide"]) == 0
    wide = capsys.readouterr().out
    assert "fwd predicted" in wide and max(map(len, wide.splitlines())) > 120


def test_a_call_that_beats_its_roofline_bound_is_named(dashboard_results):
    """Issue 44: a call measured at over 110% of its roofline bound (the limits' own noise) is named doubtful, with
    its backend and how far; none of this real run's calls is (its highest share is printed)."""
    cells, blocks = Run.open(list_runs(dashboard_results)[0]).read()
    print(f"highest share of a bound: {blocks['pct_of_peak'].max():.1f}%")
    assert not any(s.startswith("Doubtful roofline") for s in findings(cells, blocks))
    subquad = blocks.index[blocks["backend_label"] == "subquad"]
    blocks.loc[subquad[:3], "pct_of_peak"] = [105.0, 140.0, 156.0]  # the tour's sliced: 119-156% of memory
    line = next(s for s in findings(cells, blocks) if s.startswith("Doubtful roofline"))
    b = blocks.loc[subquad[2]]
    assert line.startswith("Doubtful roofline: 2 calls ran faster than the bound allows (subquad 2), up to 156% of "
                           f"it ({b['block']} under subquad at {b['width']}x{b['height']})"), line
