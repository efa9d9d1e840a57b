"""Sweeps: the grid (grid.py), running it (sweep.py) on local workers (local.py, worker.py) or Ray (ray.py)."""
import signal
import threading

NO_CELL_OK = 1  # run, sweep, profile: the run holds no cell that ended ok


class ExecutorError(RuntimeError):
    """A subprocess of the executor failed where no cell row can say so (the availability probe or the device
    limits' measurement died, a new worker died before its first cell): the CLI prints it as one line."""


def stop_on_sigterm() -> None:
    """Make SIGTERM (a kill, `attnprof jobs --stop`) end a sweep as Ctrl-C does: the cells recorded so far are kept
    and the run can be resumed. Called at start, and again after ray.init, whose driver would otherwise just exit.
    SIGINT too where the process was started with it ignored (a background job of a non-interactive shell, `cmd &`):
    `kill -INT PID` then stops it as Ctrl-C would, and its workers with it (local.py kills the one in flight)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)
        if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


class HeldStops:
    """SIGINT and SIGTERM held (noted, not acted on) from hold() to release(), which then acts on a held one as the
    handler it replaced would: a stop that lands in a short stretch that no `finally` covers yet (a run just made,
    its lock being taken) is raised where one does. In the main thread only (where Python runs handlers)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.old: dict = {}
        self.held: int | None = None

    def hold(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self.old = {s: signal.signal(s, self._note) for s in self.SIGNALS}

    def _note(self, signum, frame) -> None:
        self.held = self.held or signum

    def release(self) -> None:
        """The replaced handlers back, first, then a held stop acted on: a signal noted up to the last handler's
        restoring is acted on here, and one after it goes to the restored handler itself, so none is lost."""
        old, self.old = self.old, {}
        try:
            for s, handler in old.items():
                signal.signal(s, handler)
        finally:  # a pending signal raised by a handler just restored must not leave the next one ours
            for s, handler in old.items():
                if signal.getsignal(s) == self._note:
                    signal.signal(s, handler)
        held, self.held = self.held, None
        if held is None or held not in old:
            return
        handler = old[held]
        if callable(handler):
            handler(held, None)
        elif handler == signal.SIG_DFL:
            signal.raise_signal(held)
