"""Issue 11 end to end: two real CPU runs of one grid, one with OMP_NUM_THREADS=1 and one with the machine's default
threads, made by `attnprof run` as a user runs it. The Compare page shows them as two series side by side by
torch_threads; `attnprof diff` flags the one-thread run's cells as regressions (exit 1) and finds none in a run
against itself (exit 0); `attnprof report` writes one HTML file that headless Chromium renders with every network
request blocked. The screenshot lands in test-output/report-e2e/ (git-ignored)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_dashboard_app import _app, _charts, _table
from tests.test_dashboard_e2e import _MISSING, CHROMIUM, CHROMIUM_ARGS, sync_playwright

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "test-output" / "report-e2e"
GRID = ["--model", "tiny-sd15", "--size", "256x256", "--dtype", "float32", "--backend", "naive", "--backend", "sdpa",
        "--device", "cpu", "--repeats", "7", "--warmup", "1", "--in-process", "--quiet"]

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one CPU: one thread is the default")


def attnprof(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "profiler", *args], cwd=REPO, capture_output=True, text=True,
                          env=env, timeout=600)


def _pair(root: Path) -> tuple[str, str]:
    """(the default-threads run's id, the one-thread run's id), made one after the other into root."""
    default = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    ids = []
    for env in (default, {**default, "OMP_NUM_THREADS": "1"}):
        done = attnprof("run", *GRID, "--out", str(root), env=env)
        assert done.returncode == 0, done.stderr
        ids.append(next(line.split("/")[-1] for line in done.stdout.splitlines() if line.startswith("results:")))
    return ids[0], ids[1]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """(results folder, the default-threads run's id, the one-thread run's id). Where other work on the machine
    hid the second thread's gain (no regression found), the pair is measured once more, as a user would rerun."""
    for _ in range(2):
        root = tmp_path_factory.mktemp("threads") / "results"
        many, one = _pair(root)
        found = json.loads(attnprof("diff", many, one, "--results", str(root), "--json").stdout)
        if found["summary"]["regressions"] >= 1:
            break
    return root, many, one


def test_diff_flags_the_one_thread_run_and_not_a_run_against_itself(two_runs):
    root, many, one = two_runs
    envs = [json.loads((root / r / "manifest.json").read_text())["environment"]["torch_threads"] for r in (many, one)]
    assert envs[0] >= 2 and envs[1] == 1
    done = attnprof("diff", many, one, "--results", str(root), "--json")
    data = json.loads(done.stdout)
    assert data["summary"]["matched"] == 2 and not data["only_a"] and not data["only_b"]
    # The one-thread run is slower wherever the noise rule can tell: at least one cell, and never faster.
    assert done.returncode == 1 and data["summary"]["regressions"] >= 1, done.stdout
    assert {m["time_verdict"] for m in data["matched"]} <= {"regression", "within noise"}
    assert all(m["time_ratio"] > 1 for m in data["matched"] if m["time_verdict"] == "regression")

    done = attnprof("diff", one, one, "--results", str(root))
    assert done.returncode == 0 and "2 cells matched: 0 regressions, 0 improvements, 2 within noise" in done.stdout


def test_the_compare_page_shows_the_runs_side_by_side_by_threads(two_runs, monkeypatch):
    root, many, one = two_runs
    threads = json.loads((root / many / "manifest.json").read_text())["environment"]["torch_threads"]
    at = _app(root, monkeypatch, page="Compare", run=[many, one])
    by = at.sidebar.selectbox(key="by")
    assert by.value == "run" and "torch_threads" in by.options  # offered because the runs differ in it
    at = _app(root, monkeypatch, page="Compare", run=[many, one], by="torch_threads", baseline=many)
    spec, points = _charts(at)[0]
    assert spec["encoding"]["xOffset"]["field"] == "series"
    assert sorted(set(points["series"])) == sorted({f"torch_threads={threads}", "torch_threads=1"})
    diff = _table(at, 0)
    assert len(diff) == 2 and "regression" in set(diff["verdict"])  # the one-thread run judged against the other


@pytest.mark.skipif(_MISSING and sync_playwright is None, reason="playwright is not installed: pip install playwright")
@pytest.mark.skipif(_MISSING and not os.access(CHROMIUM, os.X_OK), reason=f"no {CHROMIUM}: apt-get install -y chromium")
def test_the_report_renders_in_chromium_with_the_network_blocked(two_runs):
    root, many, one = two_runs
    out = OUT / "report.html"
    OUT.mkdir(parents=True, exist_ok=True)
    done = attnprof("report", many, one, "--results", str(root), "--html", str(out))
    assert done.returncode == 0 and "opens in a browser with no server and no network" in done.stdout, done.stderr
    requested = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})

            def block(route):
                requested.append(route.request.url)
                if route.request.url.startswith("file://"):
                    route.continue_()
                else:
                    route.abort()

            page.route("**/*", block)
            page.goto(out.as_uri())
            charts = int(page.locator("body").get_attribute("data-charts"))
            assert charts >= 3  # each run's U-Net map, Compare, Scaling
            page.wait_for_function("document.body.dataset.rendered === document.body.dataset.charts", timeout=60_000)
            svg = page.locator(".chart svg").first
            box = svg.bounding_box()
            assert box["width"] > 200 and box["height"] > 100, box
            assert page.locator(".chart svg .mark-rect path, .chart svg .mark-symbol path").count() > 0
            rows = page.locator("table.cells tbody tr")
            assert rows.count() == 4  # two runs by two backends
            text = rows.all_inner_texts()
            assert sum("naive" in t for t in text) == 2 and all("ok" in t for t in text)
            assert page.locator("table.env").inner_text().count("torch_threads") == 1
            page.screenshot(path=str(OUT / "report.png"), full_page=True)
        finally:
            browser.close()
    assert [u for u in requested if not u.startswith("file://")] == []  # it asked for nothing off the file
    assert (OUT / "report.png").stat().st_size > 10_000
