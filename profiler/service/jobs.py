"""Profiles queued as Ray Jobs (Ray's own job queue): submit a sweep config, list the jobs with their progress and
run, stop one, read its logs. Each job runs `attnprof sweep` with --ray on the cluster; its run lands (on the machine
the job runs on: the head) in the folder that --results names, else the config's `out:`, else the folder that
`attnprof serve`'s dashboard shows, with the job's id in its manifest.

Ray's token authentication stays on: every request carries the token from ~/.ray/auth_token (or $RAY_AUTH_TOKEN),
as `attnprof serve` or `ray get-auth-token --generate` left it. Every request has a timeout (TIMEOUT_S): a job
server that does not answer is one line, never a hang."""
from __future__ import annotations

import datetime as dt
import json
import logging
import os
import secrets
import shlex
import sys
from pathlib import Path

from ..spec import InputError
from ..env import REPO
from ..store import Run, list_runs

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
PREFIX = "attnprof-"
TIMEOUT_S = 10  # per request to the job server: connect and read
SERVED = Path.home() / ".attnprof" / "serve.json"  # what each `attnprof serve` here serves: job server -> results
EXCLUDES = ["results", "test-output", ".whl", "*.parquet", "**/__pycache__"]


def address(given: str | None = None) -> str:
    """The job server's URL: --address, else $ATTNPROF_JOBS_ADDRESS (attnprof serve sets it), else the local one.
    A bare host:port (a cluster's GCS address) means that host's job server on Ray's port 8265."""
    value = given or os.environ.get("ATTNPROF_JOBS_ADDRESS") or DEFAULT_ADDRESS
    if value.startswith(("http://", "https://")):
        return value.rstrip("/")
    return f"http://{value.rsplit(':', 1)[0]}:8265"


def token() -> str | None:
    """Ray's token, where Ray looks for it: $RAY_AUTH_TOKEN, the file $RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    return path.read_text().strip() if path.is_file() else None


def client(addr: str | None = None):
    """A job client that sends the token itself (Ray's own client only does where RAY_AUTH_MODE was set before Ray
    was first imported in the process) and gives every request TIMEOUT_S; errors come out as one-line InputErrors
    (call it through `_ask`)."""
    from ray.job_submission import JobSubmissionClient

    class Client(JobSubmissionClient):
        def _do_request(self, method, endpoint, **kwargs):
            kwargs.setdefault("timeout", TIMEOUT_S)
            return super()._do_request(method, endpoint, **kwargs)

    for name in [n for n in logging.root.manager.loggerDict if n.startswith("ray")]:  # not Ray's notes on packaging
        logging.getLogger(name).setLevel(logging.ERROR)
    url, secret = address(addr), token()
    return _ask(url, lambda: Client(url, headers={"Authorization": f"Bearer {secret}"} if secret else None))


def _ask(url: str, call, refused: str | None = None):
    """call() against the job server at url; a server that does not answer (in TIMEOUT_S) or is not there is one
    line that says what to do, and so is any other failure (`refused`, else the server's first line)."""
    import requests

    try:
        return call()
    except requests.Timeout:
        raise InputError(f"the Ray job server at {url} did not answer within {TIMEOUT_S} s: if attnprof serve was "
                         "stopped uncleanly, run ray stop, then attnprof serve again") from None
    except InputError:
        raise
    except Exception as e:  # ConnectionError, AuthenticationError, RuntimeError with the server's text, ...
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        if refused and not isinstance(e, requests.ConnectionError):
            raise InputError(refused) from None
        raise InputError(f"no Ray job server answers at {url} ({first}): start one with attnprof serve, or give "
                         "--address") from None


def new_id() -> str:
    return PREFIX + dt.datetime.now().strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(2)


def served_results(url: str) -> Path | None:
    """The results folder that `attnprof serve` on this machine shows for the job server at url, if any."""
    try:
        return Path(json.loads(SERVED.read_text())[url]["results"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def remember_served(url: str, results: Path, started_head: bool) -> None:
    """Written by `attnprof serve`: its job server's URL -> the results folder its dashboard shows."""
    from ..store import write_json

    try:
        known = json.loads(SERVED.read_text())
    except (OSError, ValueError):
        known = {}
    SERVED.parent.mkdir(parents=True, exist_ok=True)
    write_json(SERVED, {**known, url: {"results": str(results), "started_head": started_head}})


def results_folder(text: str, url: str, results: str | Path | None = None, fallback: Path | None = None) -> Path:
    """Where a queued sweep's run lands: `results` (--results) where given, else the config's out: (relative to this
    folder, as attnprof sweep reads it), else `fallback` (the Queue page: its dashboard's folder), else the folder of
    the attnprof serve on this machine whose job server this is."""
    import yaml

    out = (yaml.safe_load(text) or {}).get("out")
    chosen = results or out or fallback or served_results(url)
    if chosen is None:
        raise InputError(f"where should the run land? no attnprof serve on this machine serves {url}: give "
                         "--results DIR (a folder on the machine the job runs on), or out: in the config")
    return Path(chosen).expanduser().resolve()


def submit(text: str, source: str, results: str | Path | None = None, addr: str | None = None,
           resume: bool = False, fallback: Path | None = None) -> tuple[str, Path]:
    """Validate the config as `attnprof sweep` would (InputError, nothing queued), then queue it: (the job's id, the
    folder its run lands in)."""
    from ..execute.grid import loads

    loads(text, source)
    url = address(addr)
    c = client(url)
    results = results_folder(text, url, results, fallback)
    sid = new_id()
    entrypoint = (f"{shlex.quote(sys.executable)} -m profiler sweep env:ATTNPROF_SWEEP_YAML --ray auto "
                  f"--out {shlex.quote(str(results))} --quiet" + (" --resume" if resume else ""))
    excludes = EXCLUDES + ([os.path.relpath(results, REPO)] if str(results).startswith(str(REPO) + os.sep) else [])
    env_vars = {"ATTNPROF_SWEEP_YAML": text, "ATTNPROF_JOB_ID": sid,
                "ATTNPROF_PLUGINS": os.environ.get("ATTNPROF_PLUGINS", "")}
    _ask(url, lambda: c.submit_job(entrypoint=entrypoint, submission_id=sid, metadata={
        "attnprof": "sweep", "source": source, "results": str(results)},
        runtime_env={"working_dir": str(REPO), "excludes": excludes, "env_vars": env_vars}))
    return sid, results


def find_run(results: str | Path, job_id: str) -> Run | None:
    for path in reversed(list_runs(Path(results))):
        try:
            run = Run.open(path)
            if job_id in run.manifest().get("job_ids", []):
                return run
        except (OSError, ValueError, InputError):
            continue
    return None


def jobs(addr: str | None = None) -> list[dict]:
    """The attnprof jobs of the cluster, newest first: id, status, what was queued, its run and its folder, cells
    done / total."""
    url = address(addr)
    c, rows = client(url), []
    for job in _ask(url, c.list_jobs):
        meta = job.metadata or {}
        if meta.get("attnprof") != "sweep" or not job.submission_id:
            continue
        results = meta.get("results", "results")
        run = find_run(results, job.submission_id)
        done = total = None
        if run is not None:
            total, done = len(run.manifest().get("cells", [])), len(run.cells())
        message = (job.message or "").strip().splitlines()
        rows.append({"job": job.submission_id, "status": getattr(job.status, "value", str(job.status)),
                     "submitted": _time(job.start_time), "ended": _time(job.end_time), "source": meta.get("source"),
                     "run": run.id if run else "", "folder": str(run.path) if run else results,
                     "cells_done": done, "cells_total": total, "results": results,
                     "message": message[-1][:200] if message else ""})
    return sorted(rows, key=lambda r: r["job"], reverse=True)


def _time(ms) -> str:
    return dt.datetime.fromtimestamp(ms / 1000).strftime("%Y-%m-%d %H:%M:%S") if ms else ""


def stop(job_id: str, addr: str | None = None) -> bool:
    """Stop a job: Ray sends its sweep SIGTERM, which ends it like Ctrl-C (finished cells stored, run resumable)."""
    url = address(addr)
    c = _known(url, job_id)
    return bool(_ask(url, lambda: c.stop_job(job_id)))


def logs(job_id: str, addr: str | None = None) -> str:
    url = address(addr)
    c = _known(url, job_id)
    return _ask(url, lambda: c.get_job_logs(job_id))


def _known(url: str, job_id: str):
    """The client, once the server knows the job (its 404 is one line)."""
    c = client(url)
    _ask(url, lambda: c.get_job_info(job_id), refused=f"no job {job_id!r} at {url}: see attnprof jobs")
    return c
