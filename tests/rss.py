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
