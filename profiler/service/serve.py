"""attnprof serve: a Ray head on this machine (or the cluster at --address) and the dashboard with its Queue page.

The head is started with `ray start --head` and token authentication on (RAY_AUTH_MODE=token; the token in
~/.ray/auth_token, made if missing), in a session of its own: Ctrl-C in serve's terminal (SIGINT to the whole
foreground process group) ends the dashboard only, and queued jobs and their runs survive a restart of `attnprof
serve`, which then finds the head running. A head found running whose job server does not answer is restarted where
this command started it, else named in one line with the fix. `ray stop` ends it. Everything binds to 127.0.0.1
unless --host says otherwise; beyond the loopback address the Queue page asks for Ray's token before it queues,
stops or shows logs.

On the loopback address the head is a single-node cluster: Ray turns a loopback --node-ip-address into the machine's
own address (services.resolve_ip_for_localhost) and binds the GCS and raylet to every interface, unless
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (LOOPBACK_ENV), Ray's single-node mode of macOS and Windows, where the node's
address is 127.0.0.1 and every listener of the head (GCS, raylet, object manager, dashboard and its agents, runtime
env agent, metrics export, Ray client server, and the workers and job drivers it starts, which inherit the
variable) binds to it; no other node can join."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from ..env import dashboard_app
from ..spec import InputError


LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def _answers(url: str) -> bool:
    from .jobs import jobs

    try:
        jobs(url)
        return True
    except InputError:
        return False


def _listening(host: str, port: int) -> bool:
    """Whether something holds host:port (a Ray head's GCS, for one): it accepts connections, or it lets them wait
    (a listener whose queue is full drops the handshake, which times out; nothing there refuses at once)."""
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except TimeoutError:
        return True
    except OSError:
        return False


def _started_here(url: str) -> bool:
    """Whether an earlier `attnprof serve` on this machine started the head whose job server is url."""
    import json

    from .jobs import SERVED

    try:
        return bool(json.loads(SERVED.read_text())[url]["started_head"])
    except (OSError, ValueError, KeyError, TypeError):
        return False


def start_head(host: str, ray_port: int, jobs_port: int, say=print) -> tuple[str, bool]:
    """The job server of a Ray head on this machine, starting one if none answers: (its URL, whether this command
    started it or an earlier serve did)."""
    client_host = "127.0.0.1" if host in ("127.0.0.1", "localhost", "0.0.0.0") else host
    url = f"http://{client_host}:{jobs_port}"
    ray = str(Path(sys.executable).with_name("ray"))
    if _answers(url):
        say(f"attnprof serve: the Ray head already running here answers at {url}")
        return url, _started_here(url)
    if _listening(client_host, ray_port):  # a head runs, but its job server is gone
        if not _started_here(url):
            raise InputError(f"a Ray head runs at {client_host}:{ray_port} but no job server answers at {url}: stop "
                             "it with ray stop, then run attnprof serve again (or give --address of a cluster whose "
                             "job server answers)")
        say(f"attnprof serve: the Ray head that attnprof serve started here no longer answers at {url}: restarting "
            "it (ray stop, ray start --head)", flush=True)
        subprocess.run([ray, "stop", "--force"], capture_output=True, start_new_session=True)
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    subprocess.run([ray, "get-auth-token", "--generate"], env=env, capture_output=True, check=False)
    cmd = [ray, "start", "--head", f"--port={ray_port}", f"--dashboard-host={host}", f"--dashboard-port={jobs_port}",
           "--include-dashboard=true", "--disable-usage-stats"]
    if client_host == "127.0.0.1" and host != "0.0.0.0":
        cmd.append("--node-ip-address=127.0.0.1")
        env.update(LOOPBACK_ENV)
    say(f"attnprof serve: starting a Ray head (ray start --head --port {ray_port}, jobs at {url}, token auth on)",
        flush=True)
    # a session of its own: the terminal's Ctrl-C reaches serve's process group, never the head's processes
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, start_new_session=True)
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
    return url, True


def serve(results: str, address: str | None, port: int, host: str, ray_port: int, jobs_port: int) -> None:
    from . import jobs

    if address:
        url, started = jobs.address(address), False
        jobs.jobs(url)  # one line if it does not answer
    else:
        url, started = start_head(host, ray_port, jobs_port)
    folder = Path(results).resolve()
    jobs.remember_served(url, folder, started)  # where attnprof submit on this machine lands runs by default
    print(f"attnprof serve: dashboard http://{host}:{port} (Queue page: submit and watch profiles), jobs at {url}, "
          f"results {folder}; Ctrl-C stops the dashboard, the Ray head keeps running (ray stop ends it)", flush=True)
    dashboard(results, port, host, {"ATTNPROF_JOBS_ADDRESS": url,
                                    "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token")})


def dashboard(results: str, port: int, host: str, env: dict | None = None) -> None:
    """Replace this process with the Streamlit dashboard over the results folder."""
    if not 0 < port < 65536:
        raise InputError(f"--port {port} is not a TCP port: use 1 to 65535")
    os.execve(sys.executable, [sys.executable, "-m", "streamlit", "run", str(dashboard_app()), "--server.address", host,
                               "--server.port", str(port), "--server.headless", "true",
                               "--browser.gatherUsageStats", "false", "--client.toolbarMode", "viewer",
                               "--", "--results", str(Path(results).resolve())], {**os.environ, **(env or {})})


def dashboard_command(results: str, port: int, host: str) -> None:
    """attnprof dashboard: the Streamlit dashboard over the results folder (this process becomes it)."""
    from ..store import results_folder

    results_folder(results)
    print(f"attnprof dashboard: http://{host}:{port}  (results: {Path(results).resolve()}; Ctrl-C "
          "stops it)", flush=True)
    dashboard(results, port, host)


def serve_command(results: str, address: str | None, port: int, host: str, ray_port: int, jobs_port: int) -> None:
    """attnprof serve: a Ray head (or address's cluster) and the dashboard with its Queue page."""
    from ..store import results_folder

    results_folder(results)
    serve(results, address, port, host, ray_port, jobs_port)


def submit_command(config: str, address: str | None, results: str | None, resume: bool) -> int:
    """attnprof submit: a sweep config queued as a Ray Job; its id printed."""
    from . import jobs

    path = Path(config)
    if not path.is_file():
        raise InputError(f"sweep config {path} does not exist: see configs/sweeps/ for examples")
    sid, results = jobs.submit(path.read_text(), str(path), results, address, resume=resume)
    print(sid)
    print(f"queued at {jobs.address(address)}; its run lands in {results} (on the machine the job runs on): "
          f"attnprof jobs (progress), attnprof jobs --logs {sid}, attnprof jobs --stop {sid}", file=sys.stderr)
    return 0


def jobs_command(address: str | None, stop: str | None, logs: str | None) -> int:
    """attnprof jobs: the cluster's attnprof jobs, newest first; or stop one, or print one's log."""
    from ..fmt import table
    from . import jobs

    if stop:
        jobs.stop(stop, address)
        print(f"stopping {stop}: its finished cells stay stored; attnprof submit CONFIG --resume (or attnprof "
              "sweep CONFIG --resume --out RESULTS) finishes the run")
        return 0
    if logs:
        print(jobs.logs(logs, address), end="")
        return 0
    rows = jobs.jobs(address)
    if not rows:
        print(f"no attnprof jobs at {jobs.address(address)}: queue one with attnprof submit CONFIG")
        return 0
    for r in rows:
        r["cells"] = f"{r['cells_done']}/{r['cells_total']}" if r["cells_total"] is not None else "-"
    print(table(rows, [(c, c) for c in ("job", "status", "submitted", "source", "cells", "folder")]))
    return 0
