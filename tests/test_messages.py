"""Every message that names a flag names one that exists: the flags in the code's strings are checked against the
parsers of attnprof (and, in a string that names `attnprof CMD`, against CMD's own); and a run stopped with Ctrl-C
finishes with the command its message names."""
import argparse
import ast
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from profiler.cli import build_parser
from profiler.execute.commands import resume_command
from profiler.store import Run, list_runs

REPO = Path(__file__).resolve().parent.parent
FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9-]*[a-z0-9])")
COMMAND = re.compile(r"attnprof ([a-z]+)\b([^;:()`]*)")  # 'attnprof sweep CONFIG --resume', to the clause's end
# Flags of other programs that messages tell the user to type: `ray start --head`, the worker's own modes.
OTHERS = {"head": "ray start --head", "probe": "execute/worker.py --probe", "limits": "execute/worker.py --limits",
          "calibrate": "execute/worker.py --calibrate", "generate": "ray get-auth-token --generate",
          "node-ip-address": "ray start --node-ip-address (attnprof serve's head)",
          "steps": "docs/examples/generate.py --steps (a user's script that attnprof record runs)",
          "only": "python -m profiler.bench --only (make bench's single step)"}


def _parsers() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s[2:] for a in parser._actions for s in a.option_strings if s.startswith("--")}


def _texts() -> list[tuple[str, str]]:
    """(where, text) of each string in profiler/ and dashboards/ that reads as words (holds a space), f-strings'
    literal parts joined."""
    out = []
    for path in sorted([*(REPO / "profiler").rglob("*.py"), *(REPO / "dashboards").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):
                text = "".join(v.value if isinstance(v, ast.Constant) else "X" for v in node.values)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
            else:
                continue
            if " " in text.strip():
                out.append((f"{path.relative_to(REPO)}:{node.lineno}", text))
    return out


def test_every_flag_a_message_names_exists():
    parsers = _parsers()
    from profiler.gpu_check.runner import parser as gpu_check_parser

    known = set().union(*map(_flags, parsers.values()), _flags(gpu_check_parser())) | {"help"}  # make gpu-check's
    unknown = [(where, flag) for where, text in _texts() for flag in FLAG.findall(text)
               if flag not in known and flag not in OTHERS]
    assert unknown == []
    wrong = [(where, cmd, flag) for where, text in _texts() for cmd, rest in COMMAND.findall(text)
             if cmd in parsers for flag in FLAG.findall(rest.split(" -- ")[0])  # after --: a script's own
             if flag not in _flags(parsers[cmd]) | {"help"}]
    assert wrong == []


@pytest.mark.parametrize("argv", [["run", "--model", "tiny-sd15", "--device", "cpu"], ["sweep", "a.yaml"],
                                  ["profile", "--out", "r"], ["sweep", "a.yaml", "--resume"]])
def test_the_resume_command_parses_and_resumes(argv):
    named = shlex.split(resume_command(argv))
    assert named[0] == "attnprof" and named.count("--resume") == 1
    assert build_parser().parse_args(named[1:]).resume is True


def _wait_for(check, timeout=300):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if got := check():
            return got
        time.sleep(0.2)
    raise AssertionError("timed out")


def test_an_interrupted_run_finishes_with_the_command_its_message_names(tmp_path):
    out = tmp_path / "results"
    args = ["run", "--model", "tiny-sd15", "--size", "64x64", "--size", "128x128", "--backend", "sdpa", "--backend",
            "naive", "--dtype", "float32", "--device", "cpu", "--repeats", "1", "--warmup", "0", "--in-process",
            "--quiet", "--out", str(out)]
    proc = subprocess.Popen([sys.executable, "-m", "profiler", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    run_dir = _wait_for(lambda: list_runs(out))[0]
    _wait_for(lambda: len(Run.open(run_dir).cells()) >= 1)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole foreground group
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    named = shlex.split(err.split("to finish: ", 1)[1].splitlines()[0])
    assert named[:2] == ["attnprof", "run"] and named[-1] == "--resume"
    assert len(Run.open(run_dir).cells()) < 4
    done = subprocess.run([sys.executable, "-m", "profiler", *named[1:]], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    assert list_runs(out) == [run_dir]  # the same run, finished
    run = Run.open(run_dir)
    assert len(run.cells()) == 4 and set(run.cells()["status"]) == {"ok"} and run.manifest()["interrupted"] is False
