"""The independent check of the CPU memory method: a call's peak RSS, measured alone in a fresh process."""
import subprocess
import sys

_MEASURE = """
def _status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
open("/proc/self/clear_refs", "w").write("5")  # reset the peak-RSS mark (VmHWM): imports peak higher than calls
_before = _status("VmRSS")
call()
print(_status("VmHWM") - _before)
"""


def fresh_process_peak_rss(setup: str) -> int:
    """`setup` defines call(); returns the bytes RSS rose to above where it stood just before the call."""
    p = subprocess.run([sys.executable, "-c", setup + _MEASURE], capture_output=True, text=True, check=True)
    return int(p.stdout.split()[-1])


def fresh_process_peak_rss_of(argv: list[str]) -> tuple[int, str]:
    """`attnprof ARGV` run in a fresh process: (its peak RSS in bytes over its whole life, what it printed)."""
    code = ("import sys\nfrom profiler.cli import main\ncode = main(sys.argv[1:])\nsys.stdout.flush()\n"
            "hwm = [ln for ln in open('/proc/self/status') if ln.startswith('VmHWM')][0]\n"
            "print('VmHWM', int(hwm.split()[1]) * 1024)\nsys.exit(code)\n")
    p = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, check=True)
    out, last = p.stdout.rsplit("VmHWM", 1)
    return int(last.split()[0]), out
