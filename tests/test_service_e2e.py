"""The service end to end on this machine, on one Ray head for the module: `attnprof serve` starts the head (token
auth on) and the dashboard, every socket of both on the loopback address; `attnprof submit` queues a sweep as a Ray
Job, `attnprof jobs` shows its progress and run, `--stop` stops one (its cells kept, its run resumable); a run lands in
--results, else the config's out:, else serve's folder (the whole order: tests/test_service.py); Ctrl-C on serve
(SIGINT to its whole process group) leaves the queue answering, and serve started again (now with --host 0.0.0.0)
carries on with it; the Queue page, in a real Chromium, bound beyond loopback, queues nothing without Ray's token,
rejects a bad config inline and queues a good one, whose run then appears on the Runs page."""
import csv
import io
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from profiler.store import Run
from tests.test_dashboard_e2e import OUT, _free_port, pytestmark as browser_marks

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


def _cli(*args, timeout=120, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "profiler", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=timeout, env={**os.environ, **(env or {})})


def _serve(service, host: tuple = ()) -> None:
    """Start attnprof serve (again) in a process group of its own, as a terminal would, and wait for the page."""
    log = open(service["root"] / "serve.log", "a")
    service["host"] = host
    service["proc"] = subprocess.Popen(
        [sys.executable, "-m", "profiler", "serve", "--results", str(service["results"]), "--port", service["port"],
         "--ray-port", service["ray_port"], "--jobs-port", service["jobs_port"], *host], cwd=REPO,
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    direct, deadline = urllib.request.build_opener(urllib.request.ProxyHandler({})), time.time() + 240
    while True:
        try:
            if direct.open(service["url"] + "/_stcore/health", timeout=2).read() == b"ok":
                return
        except OSError:
            pass
        if service["proc"].poll() is not None or time.time() > deadline:
            pytest.fail(f"attnprof serve did not come up:\n{(service['root'] / 'serve.log').read_text()}")
        time.sleep(0.5)


def _serve_again(service, host: tuple) -> None:
    """Ctrl-C to serve (the head keeps running), then serve again with these arguments."""
    os.killpg(service["proc"].pid, signal.SIGINT)
    service["proc"].wait(timeout=60)
    _serve(service, host)


def _ports(root: Path) -> dict:
    ports = set()
    while len(ports) < 3:
        ports.add(_free_port())
    port, jobs_port, ray_port = sorted(ports)
    return {"url": f"http://127.0.0.1:{port}", "results": root / "results", "root": root, "port": str(port),
            "jobs": f"http://127.0.0.1:{jobs_port}", "jobs_port": str(jobs_port), "ray_port": str(ray_port)}


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    service = _ports(tmp_path_factory.mktemp("service"))
    try:
        _serve(service)
        yield service
    finally:
        service["proc"].terminate()
        service["proc"].wait(timeout=30)
        subprocess.run([RAY, "stop", "--force"], capture_output=True, timeout=120)


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


def _sample_listeners(service, seen: set, stop: threading.Event) -> None:
    """Until stop: every TCP socket that the head's processes and serve's listen on, read from /proc every 0.5 s."""
    from tests.sockets import listeners_of, pid_listening_on, session_of

    head = pid_listening_on(int(service["ray_port"]))
    while not stop.wait(0.5):
        seen.update(listeners_of(session_of(head) + session_of(service["proc"].pid)))


def test_submit_jobs_stop_and_resume_from_the_command_line_all_on_loopback(service):
    """attnprof serve without --host: a sweep queued, listed while it runs (status, cells done / total, run), its log
    read, stopped after a cell or two (those kept, the run marked interrupted), then queued again with --resume (the
    first job landed by --results, this one by the config's out:, relative to where submit runs, in the same folder,
    not serve's): the same run finishes. Meanwhile every TCP socket that the head's processes (GCS, raylet, dashboard
    and its agents, Ray client server, metrics, the workers and the job's driver) and the dashboard listen on is on
    127.0.0.1, sampled from /proc as ss -ltnp reads it. First in this file: later, the Ctrl-C test starts serve again
    with --host 0.0.0.0."""
    from tests.sockets import pid_listening_on

    if service["host"]:  # run after the Ctrl-C test (-k, a rerun)
        _serve_again(service, ())
    assert pid_listening_on(int(service["ray_port"])) is not None, (service["root"] / "serve.log").read_text()
    queued = service["root"] / "queued"  # not serve's folder: each submit below lands here by its own rule
    config, with_out = service["root"] / "sweep.yaml", service["root"] / "sweep-out.yaml"
    # fault-slow-big: fast at 64x64, so that shape's cells land; at 256x256 0.3 s late on each of its 20 calls over 64
    # tokens, its shape's cells about 30 s, so the stop lands mid-run
    config.write_text(SMALL.replace("[sdpa, naive]", "[sdpa, fault-slow-big, naive]").replace(
        "[64x64]", "[64x64, 256x256]").replace("repeats: 1", "repeats: 4"))
    with_out.write_text(config.read_text() + f"out: {os.path.relpath(queued, REPO)}\n")  # relative to submit's folder
    slow = {"ATTNPROF_PLUGINS": "tests.faults"}
    p = _cli("submit", str(config), "--address", service["jobs"], "--results", str(queued), env=slow)
    assert p.returncode == 0 and f"its run lands in {queued}" in p.stderr, p.stderr
    sid = p.stdout.strip()
    assert sid.startswith("attnprof-") and f"attnprof jobs --stop {sid}" in p.stderr
    seen, stop = set(), threading.Event()
    sampler = threading.Thread(target=_sample_listeners, args=(service, seen, stop))
    sampler.start()
    try:
        row = _wait_job(service, sid, lambda r: (r["cells_done"] or 0) >= 1)
        listed = _cli("jobs", "--address", service["jobs"])
        assert listed.returncode == 0, listed.stderr
        line = next(ln for ln in listed.stdout.splitlines() if ln.startswith(sid))
        assert "RUNNING" in line and row["run"] in line and "/6" in line
        assert "sweep env:ATTNPROF_SWEEP_YAML --ray auto" in _cli("jobs", "--address", service["jobs"], "--logs",
                                                                  sid).stdout
    finally:
        stop.set()
        sampler.join()
    names = {name for _, _, _, name in seen}
    assert {"gcs_server", "raylet"} <= names and int(service["port"]) in {port for _, port, _, _ in seen}
    assert len(seen) >= 10, seen  # the head's own dozen: a listing that missed most of them proves nothing
    beyond = sorted(row for row in seen if row[0] not in ("127.0.0.1", "::1"))
    assert not beyond, f"listening beyond loopback: {beyond}"

    assert _cli("jobs", "--address", service["jobs"], "--stop", sid).returncode == 0
    row = _wait_job(service, sid, lambda r: r["status"] in ("STOPPED", "SUCCEEDED", "FAILED"))
    run = Run.open(queued / row["run"])
    assert row["status"] == "STOPPED" and run.manifest()["interrupted"] is True
    assert run.manifest()["environment"]["executor"] == "ray"
    kept = run.cells().set_index("cell_id")["recorded_at"]
    assert 1 <= len(kept) < 6
    unslowed = {"ATTNPROF_PLUGINS": "tests.faults,tests.fast_resume"}  # the stopped cell runs again, at once
    resumed = _cli("submit", str(with_out), "--address", service["jobs"], "--resume", env=unslowed)  # by its out:
    assert resumed.returncode == 0 and f"its run lands in {queued}" in resumed.stderr, resumed.stderr
    again = resumed.stdout.strip()
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


def test_ctrl_c_on_serve_leaves_the_queue_answering_and_serve_again_carries_on(service):
    """SIGINT to serve's whole process group, as a terminal's Ctrl-C: the dashboard ends, the head (its own
    session) does not; `attnprof jobs` answers; serve started again (with --host 0.0.0.0, for the Queue page's test
    that follows) finds the head, and a config without out: submitted with no --results runs to its end in serve's
    results folder."""
    os.killpg(service["proc"].pid, signal.SIGINT)
    service["proc"].wait(timeout=60)
    t0 = time.time()
    listed = _cli("jobs", "--address", service["jobs"], timeout=60)
    assert listed.returncode == 0 and time.time() - t0 < 30, listed.stderr
    _serve(service, host=("--host", "0.0.0.0"))
    assert "the Ray head already running here answers" in (service["root"] / "serve.log").read_text()
    config = service["root"] / "plain.yaml"
    config.write_text(SMALL.replace("[sdpa, naive]", "[sdpa]"))  # one cell: one Ray worker
    p = _cli("submit", str(config), "--address", service["jobs"])
    assert p.returncode == 0 and f"its run lands in {service['results']}" in p.stderr, p.stderr
    row = _wait_job(service, p.stdout.strip(), lambda r: r["status"] in ("SUCCEEDED", "FAILED", "STOPPED"))
    assert row["status"] == "SUCCEEDED" and row["folder"] == str(service["results"] / row["run"]), row
    assert Run.open(service["results"] / row["run"]).cells()["status"].tolist() == ["ok"]


@pytest.mark.skipif(any(m.args and m.args[0] for m in browser_marks), reason="no browser: see test_dashboard_e2e")
def test_the_queue_page_queues_a_sweep_whose_run_appears_on_the_runs_page(service, browser):
    """The dashboard bound beyond loopback: as the Ctrl-C test before it leaves serve (started again here if this
    test runs alone)."""
    if not service["host"]:
        _serve_again(service, ("--host", "0.0.0.0"))
    OUT.mkdir(parents=True, exist_ok=True)
    page = browser.new_page(viewport={"width": 1500, "height": 1200}, accept_downloads=True)
    try:
        page.goto(service["url"] + "/?page=Queue")
        page.get_by_text("Paste YAML").click()
        box = page.get_by_label("Sweep config (the keys of configs/sweeps/*.yaml)")
        box.fill(SMALL.replace("[sdpa, naive]", "[subquad]"))
        box.press("Control+Enter")
        before = len(_jobs(service))
        page.get_by_role("button", name="Validate and submit").click()  # bound beyond loopback, no token yet
        page.get_by_text("nothing queued: enter Ray's token above first").wait_for(timeout=60_000)
        assert page.get_by_role("button", name="Stop this job").count() == 0
        time.sleep(3)
        assert len(_jobs(service)) == before
        secret = page.get_by_label("Ray's token", exact=False)
        secret.fill("not-the-token")
        secret.press("Enter")
        page.get_by_text("that is not the cluster's token").wait_for(timeout=60_000)
        from profiler.service.jobs import token

        secret.fill(token())
        secret.press("Enter")
        page.get_by_text("token accepted for this browser session").wait_for(timeout=60_000)
        box.fill(SMALL.replace("[sdpa, naive]", "[sdpa, flashy]"))
        box.press("Control+Enter")
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
        page.close()


def _silent_server() -> tuple[str, list[list[float]], "socket.socket"]:
    """A port that accepts connections and never answers (a job server stuck or half dead): its URL, per connection
    [accepted at, closed by the client at], timed here as each happens, and the listening socket (to close)."""
    import socket
    import threading

    listener, held = socket.socket(), []
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)

    def hold(conn, times):
        try:
            while conn.recv(4096):
                pass
        except OSError:  # reset rather than closed: gone all the same
            pass
        times.append(time.time())
        conn.close()

    def accept():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # closed by the test
                return
            held.append([time.time()])
            threading.Thread(target=hold, args=(conn, held[-1]), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}", held, listener


def test_a_job_server_that_does_not_answer_is_one_line_after_its_10_s(tmp_path):
    """One line, exit 2, once the 10 s the command waits are up: each command's wait timed on the server's side,
    from its first connection to its last close, so that the load does not move it (a command's start does not
    count)."""
    (tmp_path / "s.yaml").write_text(SMALL)
    servers = [_silent_server() for _ in range(2)]
    commands = [("jobs", "--address", servers[0][0]),
                ("submit", str(tmp_path / "s.yaml"), "--results", str(tmp_path / "r"), "--address", servers[1][0])]
    started = [subprocess.Popen([sys.executable, "-m", "profiler", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=REPO) for args in commands]
    for proc, (url, held, listener) in zip(started, servers):
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 2 and err.strip().splitlines() == [
            f"attnprof: error: the Ray job server at {url} did not answer within 10 s: if attnprof serve was stopped "
            "uncleanly, run ray stop, then attnprof serve again"], err
        time.sleep(0.2)  # the holding thread sees the close
        assert held and all(len(t) == 2 for t in held), held
        waited = max(t[1] for t in held) - min(t[0] for t in held)
        assert 9.5 <= waited < 12, (waited, held)  # accepted here a moment after the command connected
        listener.close()


def test_serve_names_a_head_whose_job_server_is_gone_in_one_line(tmp_path):
    """Something holds the head's port (a head whose job server died) and this machine's serve did not start it:
    one line with the fix, exit 2, and no second head started."""
    import socket

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    ray_port, jobs_port = holder.getsockname()[1], _free_port()
    p = _cli("serve", "--results", str(tmp_path), "--ray-port", str(ray_port), "--jobs-port", str(jobs_port),
             "--port", str(_free_port()), timeout=60)
    holder.close()
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.strip().splitlines() == [
        f"attnprof: error: a Ray head runs at 127.0.0.1:{ray_port} but no job server answers at "
        f"http://127.0.0.1:{jobs_port}: stop it with ray stop, then run attnprof serve again (or give --address of "
        "a cluster whose job server answers)"]
