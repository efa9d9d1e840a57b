"""attnprof serve: a Ray head on this machine (or the cluster at --address) and the dashboard with its Queue page.

The head is started with `ray start --head` and token authentication on (RAY_AUTH_MODE=token; the token in
~/.ray/auth_token, made if missing); it outlives the dashboard, so queued jobs and their runs survive a restart of
`attnprof serve`, which then finds the head already running. `ray stop` ends it. Everything binds to 127.0.0.1
unless --host says otherwise."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from ..spec import InputError


def _answers(url: str) -> bool:
    from .jobs import client

    try:
        client(url).list_jobs()
        return True
    except InputError:
        return False


def start_head(host: str, ray_port: int, jobs_port: int, say=print) -> str:
    """The job server of a Ray head on this machine, starting one if none answers; its URL."""
    client_host = "127.0.0.1" if host in ("127.0.0.1", "localhost", "0.0.0.0") else host
    url = f"http://{client_host}:{jobs_port}"
    if _answers(url):
        say(f"attnprof serve: the Ray head already running here answers at {url}")
        return url
    ray = str(Path(sys.executable).with_name("ray"))
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    subprocess.run([ray, "get-auth-token", "--generate"], env=env, capture_output=True, check=False)
    cmd = [ray, "start", "--head", f"--port={ray_port}", f"--dashboard-host={host}", f"--dashboard-port={jobs_port}",
           "--include-dashboard=true", "--disable-usage-stats"]
    if client_host == "127.0.0.1" and host != "0.0.0.0":
        cmd.append("--node-ip-address=127.0.0.1")
    say(f"attnprof serve: starting a Ray head (ray start --head --port {ray_port}, jobs at {url}, token auth on)",
        flush=True)
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode:
        lines = [ln for ln in (p.stderr + p.stdout).strip().splitlines() if ln.strip()]
        last = [ln for ln in lines if "rror" in ln][-1:] or lines[-1:] or ["no output"]
        raise InputError(f"ray start --head failed ({last[0][:200]}): is port {ray_port} or {jobs_port} taken? "
                         "choose others with --ray-port / --jobs-port")
    deadline = time.time() + 120
    while not _answers(url):
        if time.time() > deadline:
            raise InputError(f"the Ray head started but its job server never answered at {url}: see ray status")
        time.sleep(1)
    return url


def serve(results: str, address: str | None, port: int, host: str, ray_port: int, jobs_port: int) -> None:
    from . import jobs

    url = jobs.address(address) if address else start_head(host, ray_port, jobs_port)
    if address and not _answers(url):
        jobs.client(url)  # raises the one-line error
    print(f"attnprof serve: dashboard http://{host}:{port} (Queue page: submit and watch profiles), jobs at {url}, "
          f"results {Path(results).resolve()}; Ctrl-C stops the dashboard, the Ray head keeps running (ray stop "
          "ends it)", flush=True)
    dashboard(results, port, host, {"ATTNPROF_JOBS_ADDRESS": url,
                                    "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token")})


def dashboard(results: str, port: int, host: str, env: dict | None = None) -> None:
    """Replace this process with the Streamlit dashboard over the results folder."""
    if not 0 < port < 65536:
        raise InputError(f"--port {port} is not a TCP port: use 1 to 65535")
    app = Path(__file__).resolve().parent.parent.parent / "dashboards" / "app.py"
    os.execve(sys.executable, [sys.executable, "-m", "streamlit", "run", str(app), "--server.address", host,
                               "--server.port", str(port), "--server.headless", "true",
                               "--browser.gatherUsageStats", "false", "--client.toolbarMode", "viewer",
                               "--", "--results", str(Path(results).resolve())], {**os.environ, **(env or {})})
