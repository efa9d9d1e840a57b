"""The service end to end on this machine: `attnprof serve` starts a Ray head (token auth on) and the dashboard;
`attnprof submit` queues a sweep as a Ray Job, `attnprof jobs` shows its progress and run, `--stop` stops one (its
cells kept, its run resumable); the Queue page, in a real Chromium, rejects a bad config inline and queues a good
one, whose run then appears on the Runs page."""
import csv
import io
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from profiler.store import Run
from tests.test_dashboard_e2e import CHROMIUM, CHROMIUM_ARGS, OUT, _free_port, pytestmark as browser_marks

pytest.importorskip("ray")
REPO = Path(__file__).resolve().parent.parent
RAY = str(Path(sys.executable).with_name("ray"))
SMALL = """models: [tiny-sd15]
sizes: [64x64]
dtypes: [float32]
backends: [sdpa, naive]
repeats: 1
warmup: 0
device: cpu
"""


def _cli(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "profiler", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=timeout)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    root = tmp_path_factory.mktemp("service")
    ports = set()
    while len(ports) < 3:
        ports.add(_free_port())
    port, jobs_port, ray_port = sorted(ports)
    results = root / "results"
    log = open(root / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "profiler", "serve", "--results", str(results), "--port", str(port),
                             "--ray-port", str(ray_port), "--jobs-port", str(jobs_port)], cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT)
    url, direct = f"http://127.0.0.1:{port}", urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.time() + 240
    try:
        while True:
            try:
                if direct.open(url + "/_stcore/health", timeout=2).read() == b"ok":
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                pytest.fail(f"attnprof serve did not come up:\n{(root / 'serve.log').read_text()}")
            time.sleep(0.5)
        yield {"url": url, "results": results, "jobs": f"http://127.0.0.1:{jobs_port}", "root": root}
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        subprocess.run([RAY, "stop", "--force"], capture_output=True, timeout=120)
        log.close()


def _jobs(service) -> dict[str, dict]:
    from profiler.service import jobs

    return {r["job"]: r for r in jobs.jobs(service["jobs"])}


def _wait_job(service, sid: str, until, timeout=240) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        row = _jobs(service).get(sid)
        if row and until(row):
            return row
        time.sleep(1)
    raise AssertionError(f"job {sid} never got there: {_jobs(service).get(sid)}")


def test_submit_jobs_stop_and_resume_from_the_command_line(service):
    """Queued, listed while it runs (status, cells done / total, run), its log read, stopped after a cell or two
    (those kept, the run marked interrupted), then queued again with --resume: the same run finishes."""
    config = service["root"] / "sweep.yaml"
    config.write_text(SMALL.replace("[64x64]", "[64x64, 256x256, 384x384]").replace("repeats: 1", "repeats: 2"))
    p = _cli("submit", str(config), "--address", service["jobs"], "--results", str(service["results"]))
    assert p.returncode == 0, p.stderr
    sid = p.stdout.strip()
    assert sid.startswith("attnprof-") and f"attnprof jobs --stop {sid}" in p.stderr
    row = _wait_job(service, sid, lambda r: (r["cells_done"] or 0) >= 1)
    listed = _cli("jobs", "--address", service["jobs"])
    assert listed.returncode == 0, listed.stderr
    line = next(ln for ln in listed.stdout.splitlines() if ln.startswith(sid))
    assert "RUNNING" in line and row["run"] in line and "/6" in line
    assert "sweep env:ATTNPROF_SWEEP_YAML --ray auto" in _cli("jobs", "--address", service["jobs"], "--logs",
                                                              sid).stdout
    assert _cli("jobs", "--address", service["jobs"], "--stop", sid).returncode == 0
    row = _wait_job(service, sid, lambda r: r["status"] in ("STOPPED", "SUCCEEDED", "FAILED"))
    run = Run.open(service["results"] / row["run"])
    assert row["status"] == "STOPPED" and run.manifest()["interrupted"] is True
    assert run.manifest()["environment"]["executor"] == "ray"
    kept = run.cells().set_index("cell_id")["recorded_at"]
    assert 1 <= len(kept) < 6
    again = _cli("submit", str(config), "--address", service["jobs"], "--results", str(service["results"]),
                 "--resume").stdout.strip()
    row = _wait_job(service, again, lambda r: r["status"] in ("STOPPED", "SUCCEEDED", "FAILED"), timeout=400)
    assert row["status"] == "SUCCEEDED" and row["run"] == run.id  # the same run, finished
    cells = run.cells().set_index("cell_id")
    assert len(cells) == 6 and set(cells["status"]) == {"ok"}
    assert cells.loc[kept.index, "recorded_at"].tolist() == kept.tolist()  # the stopped job's cells kept as they were
    assert run.manifest()["job_ids"] == [sid, again]


def test_bad_configs_are_refused_before_anything_is_queued(service, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(SMALL.replace("[sdpa, naive]", "[sdpa, flashy]"))
    before = len(_jobs(service))
    p = _cli("submit", str(bad), "--address", service["jobs"])
    assert p.returncode == 2 and "unknown backend 'flashy'" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert len(_jobs(service)) == before
    p = _cli("jobs", "--address", "http://127.0.0.1:9")
    assert p.returncode == 2 and "no Ray job server answers at http://127.0.0.1:9" in p.stderr


@pytest.mark.skipif(any(m.args and m.args[0] for m in browser_marks), reason="no browser: see test_dashboard_e2e")
def test_the_queue_page_queues_a_sweep_whose_run_appears_on_the_runs_page(service):
    from playwright.sync_api import sync_playwright

    OUT.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1200}, accept_downloads=True)
            page.goto(service["url"] + "/?page=Queue")
            page.get_by_text("Paste YAML").click()
            box = page.get_by_label("Sweep config (the keys of configs/sweeps/*.yaml)")
            box.fill(SMALL.replace("[sdpa, naive]", "[sdpa, flashy]"))
            box.press("Control+Enter")
            before = len(_jobs(service))
            page.get_by_role("button", name="Validate and submit").click()
            page.get_by_text("unknown backend 'flashy'").wait_for(timeout=60_000)  # inline, nothing queued
            assert len(_jobs(service)) == before
            box.fill(SMALL.replace("[sdpa, naive]", "[subquad]"))
            box.press("Control+Enter")
            page.get_by_role("button", name="Validate and submit").click()
            page.get_by_text("queued attnprof-").wait_for(timeout=60_000)
            sid = page.get_by_text("queued attnprof-").inner_text().split()[1].rstrip(":")
            row = _wait_job(service, sid, lambda r: r["status"] in ("SUCCEEDED", "FAILED", "STOPPED"))
            assert row["status"] == "SUCCEEDED", row
            page.get_by_text(f"{sid}: SUCCEEDED").wait_for(timeout=60_000)  # the page follows the job
            page.screenshot(path=str(OUT / "queue-page.png"))

            page.goto(service["url"] + "/?page=Runs")
            with page.expect_download(timeout=60_000) as download:
                page.get_by_role("button", name="Download runs.csv").click()
            runs = list(csv.DictReader(io.StringIO(Path(download.value.path()).read_text())))
            assert row["run"] in [r["run_id"] for r in runs]
            mine = next(r for r in runs if r["run_id"] == row["run"])
            assert mine["ok"] == "1" and mine["backends"] == "subquad"
        finally:
            browser.close()
