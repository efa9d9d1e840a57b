"""End to end: `attnprof dashboard` serves the real app on a free port; a real headless Chromium (Debian's, driven by
Playwright) sees a chart render, changes a filter, finds it in the URL, and downloads a table as CSV.
The screenshot lands in test-output/dashboard-e2e/ (git-ignored)."""
import contextlib
import csv
import io
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest

from profiler.store import list_runs

pytest.importorskip("streamlit", reason="the dashboard needs streamlit (not on the lent GPU machine)")

try:
    from playwright.sync_api import sync_playwright
except ImportError:
    sync_playwright = None

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--no-proxy-server"]
OUT = REPO / "test-output" / "dashboard-e2e"

# On CI (.ci/run installs both) a missing browser is a failure, not a skip.
_MISSING = None if os.environ.get("CI") else True
pytestmark = [
    pytest.mark.skipif(_MISSING and sync_playwright is None,
                       reason="playwright is not installed: pip install playwright "
                              "(it drives Debian's chromium; `playwright install` is not needed)"),
    pytest.mark.skipif(_MISSING and not os.access(CHROMIUM, os.X_OK),
                       reason=f"no {CHROMIUM}: apt-get install -y chromium"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server(dashboard_results, tmp_path):
    """The dashboard as a user starts it, over the real run; its URL once /_stcore/health answers."""
    with _dashboard(dashboard_results, tmp_path) as url:
        yield url


@contextlib.contextmanager
def _dashboard(results: Path, tmp_path: Path):
    port = _free_port()
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "profiler", "dashboard", "--results", str(results),
                                 "--port", str(port)], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback only, never a proxy
    deadline = time.time() + 90
    try:
        while True:
            try:
                if direct.open(url + "/_stcore/health", timeout=2).read() == b"ok":
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                pytest.fail(f"the dashboard did not come up (exit {proc.poll()}):\n{log_path.read_text()}")
            time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _query(url: str) -> dict[str, list[str]]:
    return parse_qs(urlparse(url).query)


def test_chart_renders_and_a_filter_changes_the_url(server, dashboard_results):
    run_id = list_runs(dashboard_results)[0].name
    OUT.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1100}, accept_downloads=True)
            messages = []
            page.on("console", lambda m: messages.append(m.text))
            page.goto(server + "/?page=Run")
            unet = page.get_by_test_id("stVegaLiteChart").first
            unet.locator("canvas, svg").first.wait_for(state="visible", timeout=90_000)
            box = unet.bounding_box()
            assert box["width"] > 300 and box["height"] > 150, box
            page.wait_for_url(lambda u: "run=" in u, timeout=30_000)
            before = _query(page.url)
            assert before["page"] == ["Run"] and before["run"] == [run_id] and "backend" not in before

            page.get_by_test_id("stMultiSelect").filter(has_text="Backend").click()
            page.get_by_role("option", name="sdpa", exact=True).click()
            page.keyboard.press("Escape")
            page.wait_for_url(lambda u: "backend=sdpa" in u, timeout=30_000)
            after = _query(page.url)
            assert after["backend"] == ["sdpa"] and after["cell"] != before["cell"]  # the drawn cell follows
            page.get_by_text("Cells", exact=True).wait_for(timeout=30_000)
            unet.locator("canvas, svg").first.wait_for(state="visible", timeout=30_000)
            time.sleep(1)  # let the charts finish drawing
            page.screenshot(path=str(OUT / "run-page-sdpa.png"))

            with page.expect_download(timeout=30_000) as download:
                page.get_by_role("button", name="Download cells.csv").click()
            rows = list(csv.DictReader(io.StringIO(Path(download.value.path()).read_text())))
            assert [r["backend_label"] for r in rows] == ["sdpa", "sdpa"]
            assert {r["size"] for r in rows} == {"64x64", "128x128"} and {r["status"] for r in rows} == {"ok"}
            assert float(rows[0]["attention_peak_mem_bytes"]) > 0  # raw bytes in the CSV, units in the names
            assert [m for m in messages if "Dropping" in m] == []  # every tooltip entry and channel kept
        finally:
            browser.close()
    assert (OUT / "run-page-sdpa.png").stat().st_size > 10_000


def test_runs_gathered_under_other_folder_names_open_on_every_page(dashboard_results, tmp_path):
    """Runs gathered from two machines: two renamed copies of one run (their files still say the original id) in a
    results folder that holds nothing else. Every page opens with both, told apart by folder, and no exception."""
    import shutil

    original = list_runs(dashboard_results)[0]
    gathered = tmp_path / "gathered"
    for name in ("h100-run", "a100-run"):
        shutil.copytree(original, gathered / name)
    with _dashboard(gathered, tmp_path) as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            for name in ("Runs", "Run", "Compare", "Scaling", "Planner", "Queue"):
                page.goto(f"{url}/?page={name}&run=h100-run&run=a100-run&by=run&baseline=h100-run")
                page.get_by_test_id("stHeading").or_(page.get_by_test_id("stVegaLiteChart")).or_(
                    page.get_by_test_id("stTable")).first.wait_for(timeout=90_000)
                time.sleep(2)  # let the page finish its run
                assert page.get_by_test_id("stException").count() == 0, (name, page.inner_text("body")[:2000])
                text = page.inner_text("body")
                assert "Traceback" not in text and "is not a run folder" not in text, name
                if name == "Compare":
                    page.get_by_text("a100-run against h100-run").wait_for(timeout=30_000)
                page.screenshot(path=str(tmp_path / f"{name}.png"))
        finally:
            browser.close()
