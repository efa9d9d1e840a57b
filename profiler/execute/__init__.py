"""Sweeps: the grid (grid.py), running it (sweep.py) on local workers (local.py, worker.py) or Ray (ray.py)."""
import signal
import threading


def stop_on_sigterm() -> None:
    """Make SIGTERM (a kill, `attnprof jobs --stop`) end a sweep as Ctrl-C does: the cells recorded so far are kept
    and the run can be resumed. Called at start, and again after ray.init, whose driver would otherwise just exit."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum, frame):
    raise KeyboardInterrupt
