"""Profiles queued as Ray Jobs (Ray's own job queue): submit a sweep config, list the jobs with their progress and
run, stop one, read its logs. Each job runs `attnprof sweep` with --ray on the cluster; its run lands in the results
folder named at submission (on the machine the job runs on: the head), with the job's id in its manifest.

Ray's token authentication stays on: every request carries the token from ~/.ray/auth_token (or $RAY_AUTH_TOKEN),
as `attnprof serve` or `ray get-auth-token --generate` left it."""
from __future__ import annotations

import datetime as dt
import logging
import os
import secrets
import shlex
import sys
from pathlib import Path

from ..spec import InputError
from ..store import REPO, Run, list_runs

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
PREFIX = "attnprof-"
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
    was first imported in the process)."""
    from ray.job_submission import JobSubmissionClient

    for name in [n for n in logging.root.manager.loggerDict if n.startswith("ray")]:  # not Ray's notes on packaging
        logging.getLogger(name).setLevel(logging.ERROR)
    url, secret = address(addr), token()
    try:
        return JobSubmissionClient(url, headers={"Authorization": f"Bearer {secret}"} if secret else None)
    except Exception as e:  # ConnectionError, AuthenticationError, ...: one line that says what to do
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise InputError(f"no Ray job server answers at {url} ({first}): start one with attnprof serve, or give "
                         "--address") from None


def new_id() -> str:
    return PREFIX + dt.datetime.now().strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(2)


def submit(text: str, source: str, results: str | Path, addr: str | None = None, resume: bool = False) -> str:
    """Validate the config as `attnprof sweep` would (InputError, nothing queued), then queue it; the job's id."""
    from ..execute.grid import loads

    loads(text, source)
    results = Path(results).expanduser().resolve()
    sid = new_id()
    entrypoint = (f"{shlex.quote(sys.executable)} -m profiler sweep env:ATTNPROF_SWEEP_YAML --ray auto "
                  f"--out {shlex.quote(str(results))} --quiet" + (" --resume" if resume else ""))
    excludes = EXCLUDES + ([os.path.relpath(results, REPO)] if str(results).startswith(str(REPO) + os.sep) else [])
    env_vars = {"ATTNPROF_SWEEP_YAML": text, "ATTNPROF_JOB_ID": sid,
                "ATTNPROF_PLUGINS": os.environ.get("ATTNPROF_PLUGINS", "")}
    client(addr).submit_job(entrypoint=entrypoint, submission_id=sid, metadata={
        "attnprof": "sweep", "source": source, "results": str(results)},
        runtime_env={"working_dir": str(REPO), "excludes": excludes, "env_vars": env_vars})
    return sid


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
    """The attnprof jobs of the cluster, newest first: id, status, what was queued, its run and cells done / total."""
    rows = []
    for job in client(addr).list_jobs():
        meta = job.metadata or {}
        if meta.get("attnprof") != "sweep" or not job.submission_id:
            continue
        run = find_run(meta.get("results", "results"), job.submission_id)
        done = total = None
        if run is not None:
            total, done = len(run.manifest().get("cells", [])), len(run.cells())
        message = (job.message or "").strip().splitlines()
        rows.append({"job": job.submission_id, "status": getattr(job.status, "value", str(job.status)),
                     "submitted": _time(job.start_time), "ended": _time(job.end_time), "source": meta.get("source"),
                     "run": run.id if run else "", "cells_done": done, "cells_total": total,
                     "results": meta.get("results"), "message": message[-1][:200] if message else ""})
    return sorted(rows, key=lambda r: r["job"], reverse=True)


def _time(ms) -> str:
    return dt.datetime.fromtimestamp(ms / 1000).strftime("%Y-%m-%d %H:%M:%S") if ms else ""


def stop(job_id: str, addr: str | None = None) -> bool:
    """Stop a job: Ray sends its sweep SIGTERM, which ends it like Ctrl-C (finished cells stored, run resumable)."""
    c = client(addr)
    _known(c, job_id)
    return bool(c.stop_job(job_id))


def logs(job_id: str, addr: str | None = None) -> str:
    c = client(addr)
    _known(c, job_id)
    return c.get_job_logs(job_id)


def _known(c, job_id: str) -> None:
    try:
        c.get_job_info(job_id)
    except Exception:  # RuntimeError with the server's 404 text
        raise InputError(f"no job {job_id!r} at {c.get_address()}: see attnprof jobs") from None
