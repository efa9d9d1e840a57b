"""Where a command's CPU goes, process by process: `python -m tests.cpu_sampler [--json FILE] -- make test`.

Runs the command and reads every process's CPU (utime + stime) from /proc twice a second until it ends, so that a
process killed by a signal, a daemon that is nobody's child (Ray's, after `ray stop`) and one that is not Python are
counted too, which pytest's own accounting (its reaped children) and a per-process exit hook miss; a process that
lives under half a second can be missed. Prints the machine's busy share of the command's wall time and, per command
a test started (the children of the pytest-xdist workers, or of the command itself), its processes and their CPU with
their descendants'. docs/developing.md gives what it measured of make test."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict

TICK = os.sysconf("SC_CLK_TCK")


def _busy() -> tuple[int, int]:
    with open("/proc/stat") as f:
        v = list(map(int, f.readline().split()[1:]))
    return sum(v) - v[3] - v[4], sum(v)  # all but idle and iowait, all


def snapshot(seen: dict, t: float) -> None:
    """Each live process's CPU into `seen`, by (pid, start time): a pid used again is another process."""
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            key = (int(d), int(fields[19]))
            if key not in seen:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                seen[key] = {"pid": int(d), "ppid": int(fields[1]), "cmd": cmd, "first_s": t}
            seen[key]["cpu_s"] = (int(fields[11]) + int(fields[12])) / TICK
        except (OSError, IndexError, ValueError):  # it ended meanwhile
            continue


def by_command(procs: list[dict], root: int) -> list[dict]:
    """Per process started by the root's xdist workers (or by the root itself where it has none): its command, the
    processes under it and their CPU, largest first; the root and the workers themselves as rows of their own."""
    kids = defaultdict(list)
    for p in procs:
        kids[p["ppid"]].append(p)

    def under(p):
        return [p] + [q for c in kids[p["pid"]] for q in under(c)]

    top = [p for p in procs if p["pid"] == root]  # none where the command ended before the first read
    mine = {p["pid"] for p in under(top[0])} if top else set()
    workers = [p for p in procs if p["pid"] in mine and p["cmd"].endswith("exec(eval(sys.stdin.readline()))")]
    tops = [c for w in workers for c in kids[w["pid"]]] if workers else kids[root]
    rows = [{"command": p["cmd"][:160], "processes": 1, "cpu_s": p["cpu_s"]} for p in procs
            if p["pid"] == root or p in workers]
    rows += [{"command": p["cmd"][:160], "processes": len(under(p)), "cpu_s": sum(q["cpu_s"] for q in under(p))}
             for p in tops]
    return sorted(rows, key=lambda r: -r["cpu_s"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.cpu_sampler", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="also write every process seen and the per-command rows to this file")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("no command given: python -m tests.cpu_sampler -- make test")
    before: dict = {}
    snapshot(before, 0.0)  # what ran already: not the command's
    seen: dict = {}
    busy0, t0 = _busy(), time.monotonic()
    proc = subprocess.Popen(command)
    while proc.poll() is None:
        snapshot(seen, time.monotonic() - t0)
        time.sleep(0.5)
    wall, busy1 = time.monotonic() - t0, _busy()
    new = [p for key, p in seen.items() if key not in before and "cpu_s" in p]
    rows = by_command(new, proc.pid)
    share = (busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1])
    print(f"\n{wall:.0f} s wall, the machine busy {share:.0%} of it ({(busy1[0] - busy0[0]) / TICK:.0f} s of CPU); "
          f"the command's processes: {sum(p['cpu_s'] for p in new):.0f} s of CPU in {len(new)} processes")
    print(f"{'CPU (s)':>8} {'procs':>5}  command")
    for r in rows[:40]:
        print(f"{r['cpu_s']:8.1f} {r['processes']:5d}  {r['command']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"wall_s": wall, "busy_share": share, "processes": new, "by_command": rows}, f)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
