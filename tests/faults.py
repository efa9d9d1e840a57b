"""Injected failures, registered as backends (profiler.attention.backends.register) so that workers load them too: set
ATTNPROF_PLUGINS=tests.faults. Each raises on the calls of a real U-Net block (more than 64 query tokens); the
availability probe's 64-token calls pass, as a kernel that fails only under real load would. In this process, use
the `faults` fixture (conftest.py): it registers them and sets ATTNPROF_PLUGINS, and takes both back after.

Worker deaths: with ATTNPROF_FAULT_EXIT=WHEN:BACKEND in a sweep worker's environment, the worker exits (os._exit)
once, at WHEN of the first cell of BACKEND: `after-done` (its row recorded and reported: between two cells) or
`after-record` (its row recorded, not yet reported). A marker file beside the run keeps it to one death."""
import functools
import os
import sys
from pathlib import Path

from profiler.attention.backends import Backend, register

TRIGGER_TOKENS = 64
raised: list[str] = []  # what was raised, in this process


class Failing:
    def __init__(self, make):
        self.make = make

    def __call__(self, attn, hidden_states, *args, **kwargs):
        tokens = hidden_states.shape[1] if hidden_states.ndim == 3 else hidden_states.shape[2] * hidden_states.shape[3]
        if tokens > TRIGGER_TOKENS:
            exc = self.make()
            raised.append(f"{type(exc).__name__}: {exc}")
            raise exc
        from diffusers.models.attention_processor import AttnProcessor2_0

        return AttnProcessor2_0()(attn, hidden_states, *args, **kwargs)


def _torch_oom():
    import torch

    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.16 GiB. GPU 0 has a total capacity of "
                                  "23.55 GiB of which 1.02 GiB is free.")


class Slow:
    """Runs SDPA, 0.3 s late on every call (a tiny-sd15 forward: about 10 s): a cell long enough to stop mid-run.
    fault-slow-big is late only on calls of more than 64 query tokens (TRIGGER_TOKENS): the cells of a shape are
    timed together (measure/cell.measure_set), so a test that wants cells to land before a slow one gives them a
    shape of their own, 64x64 (tiny-sd15's calls there have 64 tokens at most), where fault-slow-big is fast."""

    def __init__(self, min_tokens: int = 0):
        self.min_tokens = min_tokens

    def __call__(self, attn, hidden_states, *args, **kwargs):
        import time

        from diffusers.models.attention_processor import AttnProcessor2_0

        if _tokens(hidden_states) > self.min_tokens:
            time.sleep(0.3)
        return AttnProcessor2_0()(attn, hidden_states, *args, **kwargs)


class NativeChatter:
    """Runs SDPA after writing to file descriptor 1 itself, as native code (a kernel's printf, a library's C++) does,
    past sys.stdout."""

    def __call__(self, attn, hidden_states, *args, **kwargs):
        from diffusers.models.attention_processor import AttnProcessor2_0

        os.write(1, b"native chatter on fd 1\n")
        return AttnProcessor2_0()(attn, hidden_states, *args, **kwargs)


class DiesInProbe:
    """Kills its own process on the availability probe's small calls (a segfault in an extension's first launch);
    never run it in the test process: only a probe subprocess meets it."""

    def __call__(self, attn, hidden_states, *args, **kwargs):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


class Aborts:
    """A native crash on the calls of a real block (more than 64 query tokens) on real tensors: os.abort(), as a
    kernel's failed assertion or a segfault in an extension ends the process that runs it (a worker). The
    availability probe's small calls and the planner's fake tensors (no kernel runs there) pass."""

    def __call__(self, attn, hidden_states, *args, **kwargs):
        from diffusers.models.attention_processor import AttnProcessor2_0
        from torch._subclasses.fake_tensor import FakeTensor

        if hidden_states.shape[1] > TRIGGER_TOKENS and not isinstance(hidden_states, FakeTensor):
            os.abort()
        return AttnProcessor2_0()(attn, hidden_states, *args, **kwargs)


class Scaled:
    """Runs SDPA, then waits SCALED_MS x $ATTNPROF_FAULT_FACTOR (default 1) on every call: a backend made slower by
    a set factor (at 2, twice as slow: the wait is most of each call at tiny-sd15's sizes), whatever the machine's
    load. The runs compared keep one backend name and so one cell to match. With $ATTNPROF_FAULT_SWING=S, the calls
    of every other U-Net forward (SWING_CALLS calls each: tiny-sd15's) wait S times as long: samples that swing."""

    calls = 0  # in this process

    def __call__(self, attn, hidden_states, *args, **kwargs):
        import time

        from diffusers.models.attention_processor import AttnProcessor2_0

        out = AttnProcessor2_0()(attn, hidden_states, *args, **kwargs)
        swing = float(os.environ.get("ATTNPROF_FAULT_SWING", "1")) if (Scaled.calls // SWING_CALLS) % 2 else 1.0
        Scaled.calls += 1
        time.sleep(SCALED_MS / 1e3 * float(os.environ.get("ATTNPROF_FAULT_FACTOR", "1")) * swing)
        return out


SWING_CALLS = 32  # a tiny-sd15 forward's attention calls
SCALED_MS = 40.0  # a call's own work (SDPA at tiny sizes, the recorder, the scheduler's delays under load) is a
# few ms: the wait is most of each call, so that a ratio of two runs' times is the ratio of their waits


def _tokens(hidden_states) -> int:
    return hidden_states.shape[1] if hidden_states.ndim == 3 else hidden_states.shape[2] * hidden_states.shape[3]


class SlowAt:
    """Runs SDPA (or, with naive=True, diffusers' naive attention: AttnProcessor's baddbmm, softmax, bmm); on
    self-attention over SLOW_AT_TOKENS query tokens (tiny-sd15's second level at 128x128: 5 calls of the forward's 32),
    SLOW_AT_MS late: a backend much slower at one shape only, fast at every other. Beside fault-paced (SDPA, PACED_MS
    late on every call) the naive one makes a tune's map mix two kernels whatever the machine's load: naive wherever
    it is not slow, SDPA there. Fake tensors (the planner's trace) pass without the wait."""

    def __init__(self, naive: bool = False):
        self.naive = naive

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, *args, **kwargs):
        import time

        from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0
        from torch._subclasses.fake_tensor import FakeTensor

        inner = AttnProcessor() if self.naive else AttnProcessor2_0()
        out = inner(attn, hidden_states, encoder_hidden_states, *args, **kwargs)
        if encoder_hidden_states is None and _tokens(hidden_states) == SLOW_AT_TOKENS and \
                not isinstance(hidden_states, FakeTensor):
            time.sleep(SLOW_AT_MS / 1e3)
        return out


class Paced:
    """Runs SDPA, then waits PACED_MS on every call: slower than the others everywhere by a set amount, whatever the
    machine's load (SDPA's memory: lean). Fake tensors pass without the wait."""

    def __call__(self, attn, hidden_states, *args, **kwargs):
        import time

        from diffusers.models.attention_processor import AttnProcessor2_0
        from torch._subclasses.fake_tensor import FakeTensor

        out = AttnProcessor2_0()(attn, hidden_states, *args, **kwargs)
        if not isinstance(hidden_states, FakeTensor):
            time.sleep(PACED_MS / 1e3)
        return out


SLOW_AT_TOKENS, SLOW_AT_MS, PACED_MS = 64, 60.0, 10.0  # a call's own work at tiny-sd15's 128x128 shapes is a
# fraction of a millisecond on one thread: the waits decide every comparison


FAULTS = {
    "fault-torch-oom": _torch_oom,
    "fault-text-oom": lambda: RuntimeError("CUDA out of memory. Tried to allocate 3.16 GiB"),
    "fault-error": lambda: RuntimeError("kernel exploded"),
    "fault-bug": lambda: TypeError("unsupported operand type(s) for +: 'Tensor' and 'NoneType'"),  # a bug, not a refusal
}


def register_all() -> None:
    for name, make in FAULTS.items():
        register(Backend(name, "fused exact", f"test fault: raises an injected error ({name}) on real blocks",
                         factory=lambda make=make: Failing(make), memory_like="sdpa"))
    register(Backend("fault-slow", "fused exact", "test: SDPA, 0.3 s late on every call", factory=Slow,
                     memory_like="sdpa"))
    register(Backend("fault-slow-big", "fused exact", f"test: SDPA, 0.3 s late on calls over {TRIGGER_TOKENS} tokens",
                     factory=lambda: Slow(TRIGGER_TOKENS), memory_like="sdpa"))
    register(Backend("fault-fd1", "fused exact", "test: SDPA, writing to fd 1 first", factory=NativeChatter,
                     memory_like="sdpa"))
    register(Backend("fault-die-probe", "fused exact", "test: kills its process when probed",
                     factory=DiesInProbe, memory_like="sdpa"))
    register(Backend("fault-abort", "fused exact", "test: aborts its process (a native crash) on real blocks",
                     factory=Aborts, memory_like="sdpa"))
    register(Backend("fault-scaled", "fused exact", f"test: SDPA, then {SCALED_MS:g} ms x $ATTNPROF_FAULT_FACTOR on "
                     "every call", factory=Scaled, memory_like="sdpa"))
    register(Backend("fault-slow-at", "fused exact", f"test: SDPA, {SLOW_AT_MS:g} ms late on self-attention over "
                     f"{SLOW_AT_TOKENS} tokens only", factory=SlowAt, memory_like="sdpa"))
    register(Backend("fault-paced", "fused exact", f"test: SDPA, then {PACED_MS:g} ms on every call", factory=Paced,
                     memory_like="sdpa"))
    register(Backend("fault-naive-slow-at", "materialised", f"test: naive attention, {SLOW_AT_MS:g} ms late on "
                     f"self-attention over {SLOW_AT_TOKENS} tokens only", factory=functools.partial(SlowAt, naive=True),
                     memory_like="naive"))


def unregister_all() -> None:
    from profiler.attention.backends import BACKENDS

    for name in [*FAULTS, "fault-slow", "fault-slow-big", "fault-fd1", "fault-die-probe", "fault-abort", "fault-scaled",
                 "fault-slow-at", "fault-paced", "fault-naive-slow-at"]:
        BACKENDS.pop(name, None)


register_all()  # on import: how a worker started with ATTNPROF_PLUGINS=tests.faults gets them

STEADY_MS = 2.0


def _steady_machine() -> None:
    """With $ATTNPROF_FAULT_STEADY set, every calibration (measure/calibrate.py: the machine's speed at a run's start
    and end) is injected, not measured: STEADY_MS in each of its rounds, whatever the machine's load, so that a diff
    of runs whose cells are waits too (fault-scaled) gives the same verdicts however busy the machine is (a timed
    wait in its place still moved with the load: at a load of 7 the runs' calibrations drifted apart and the diff
    tests read "not judged")."""
    from profiler.measure import calibrate

    def injected(device: str, when: str) -> dict:
        from profiler import devices
        from profiler.store import now  # here: the plugin loads while profiler.store is being imported

        if os.environ.get("ATTNPROF_FAULT_CALIBRATIONS"):  # a line per calibration taken, to count them
            with open(os.environ["ATTNPROF_FAULT_CALIBRATIONS"], "a") as f:
                f.write(f"{when} {device}\n")
        return {"when": when, "at": now(), "median_ms": STEADY_MS, "samples_ms": [STEADY_MS] * calibrate.ROUNDS,
                "workload": f"{calibrate.WORKLOAD} (injected: tests/faults.py)",
                "memory_kept": devices.get(device).memory_kept}  # where it ran: a process of ours, or the user's

    calibrate.calibrate = injected


if os.environ.get("ATTNPROF_FAULT_STEADY"):
    _steady_machine()


def _record_faults() -> None:
    """In attnprof record's processes: with $ATTNPROF_FAULT_SIGINT_STORE, the script's process sends itself SIGINT
    as it begins to write a cell's rows (its cells folder made: an audit hook, since profiler.store may be importing
    as this loads), a Ctrl-C landing while it stores; with $ATTNPROF_FAULT_SLOW_END_S=S, record's own process says
    'fault: finishing' and waits S seconds before it writes the run's end (record's _finish: every script ended),
    for a Ctrl-C to land there."""
    import signal
    import time

    if os.environ.get("ATTNPROF_RECORD_RUN") and os.environ.get("ATTNPROF_FAULT_SIGINT_STORE"):
        def hook(event, args):
            if event == "os.mkdir" and str(args[0]).endswith("/cells") and not _interrupted:
                _interrupted.append(True)
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.2)  # delivered by now, where a handler would raise

        sys.addaudithook(hook)
    if os.environ.get("ATTNPROF_FAULT_SLOW_END_S") and sys.argv[1:2] == ["record"]:  # record's own process (the
        import profiler.record.script as script  # script's runs it as __main__), whatever imported this plugin first
        finish = script._finish

        def slow(*args, **kwargs):
            print("fault: finishing", file=sys.stderr, flush=True)
            time.sleep(float(os.environ["ATTNPROF_FAULT_SLOW_END_S"]))
            return finish(*args, **kwargs)

        script._finish = slow


_interrupted: list = []


if os.environ.get("ATTNPROF_FAULT_SIGINT_STORE") or os.environ.get("ATTNPROF_FAULT_SLOW_END_S"):
    _record_faults()


_recorded_in: list[Path] = []  # the run this worker records into


def _die_once(cell_backend: str, when: str) -> None:
    marker = _recorded_in[-1] / ".fault-exit-done"
    if os.environ.get("ATTNPROF_FAULT_EXIT") == f"{when}:{cell_backend}" and not marker.exists():
        marker.touch()
        os._exit(3)


def _arm_worker_deaths() -> None:
    """Wrap the sweep's event stream and the store's record, in a sweep worker only."""
    from profiler.execute import groups
    from profiler.store import Run

    events, record = groups.group_events, Run.record

    def group_events(cells, *args, **kwargs):
        backend = {c.cell_id: c.backend for c in cells}
        for event in events(cells, *args, **kwargs):
            yield event  # run_group records and reports it before asking for the next one
            if event["event"] == "done":
                _die_once(backend[event["cell_id"]], "after-done")

    def dying_record(self, cell, blocks, *args, **kwargs):
        record(self, cell, blocks, *args, **kwargs)
        _recorded_in.append(self.path)
        _die_once(cell["backend"], "after-record")

    groups.group_events, Run.record = group_events, dying_record


if os.environ.get("ATTNPROF_FAULT_EXIT") and sys.argv[0].endswith(os.path.join("execute", "worker.py")):
    _arm_worker_deaths()
