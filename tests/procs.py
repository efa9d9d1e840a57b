"""Processes a test starts and must find gone: a token in the environment marks every process of one command (its
children and theirs inherit it), so that a test can list any that outlives the command."""
import os
import secrets
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def start_marked(argv: list[str], env: dict | None = None, session: bool = False) -> tuple[subprocess.Popen, str]:
    """`python -m <argv>` in the repository, its output piped, every process of it marked: (the process, token)."""
    token = secrets.token_hex(8)
    proc = subprocess.Popen([sys.executable, "-m", *argv], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**(env or os.environ), "PYTHONUNBUFFERED": "1",
                                            "ATTNPROF_TEST_TOKEN": token}, start_new_session=session)
    return proc, token


def alive(token: str) -> list[int]:
    """The pids whose environment holds the token."""
    found = []
    for env in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"ATTNPROF_TEST_TOKEN={token}".encode() in env.read_bytes().split(b"\0"):
                found.append(int(env.parent.name))
        except OSError:
            continue
    return found
