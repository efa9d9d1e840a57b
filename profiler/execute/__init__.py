"""Sweeps: the grid (grid.py), running it (sweep.py) on local workers (local.py, worker.py) or Ray (ray.py)."""
import signal
import threading


class ExecutorError(RuntimeError):
    """A subprocess of the executor failed where no cell row can say so (the availability probe or the device
    limits' measurement died, a new worker died before its first cell): the CLI prints it as one line."""


def stop_on_sigterm() -> None:
    """Make SIGTERM (a kill, `attnprof jobs --stop`) end a sweep as Ctrl-C does: the cells recorded so far are kept
    and the run can be resumed. Called at start, and again after ray.init, whose driver would otherwise just exit."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum, frame):
    raise KeyboardInterrupt
