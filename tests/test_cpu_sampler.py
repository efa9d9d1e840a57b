"""tests/cpu_sampler.py, the tool docs/developing.md's figures of the suite's CPU come from: a child that burns CPU
and is killed by a signal (which no exit hook and no reaping parent would count) is counted under its command."""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# 1.5 s of CPU, then 3 s asleep (the sampler reads the whole of it however busy the machine: its CPU no longer
# moves), then killed
BURN = ("import os, signal, time\n"
        "t = time.process_time()\n"
        "while time.process_time() - t < 1.5: pass\n"
        "time.sleep(3)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n")


def test_a_killed_childs_cpu_is_counted_under_its_command(tmp_path):
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {BURN!r}])"
    done = subprocess.run([sys.executable, "-m", "tests.cpu_sampler", "--json", str(tmp_path / "cpu.json"), "--",
                           sys.executable, "-c", parent], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    found = json.loads((tmp_path / "cpu.json").read_text())
    child = next(r for r in found["by_command"] if "process_time" in r["command"])
    assert child["processes"] == 1 and 1.4 <= child["cpu_s"] <= 2.0, found["by_command"]
    assert "s wall, the machine busy" in done.stdout and "CPU (s)" in done.stdout


def test_no_command_is_one_line_and_exit_2():
    done = subprocess.run([sys.executable, "-m", "tests.cpu_sampler"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 2 and "no command given" in done.stderr and "Traceback" not in done.stderr
