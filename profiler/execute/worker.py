"""A sweep worker: reads one job (JSON) on stdin, runs its cells, prints one JSON event per line on stdout.
With --probe: reads a JSON list of (backend, device, dtype, head dims) and prints one JSON list of (ok, reason); with
--limits: reads [device, dtypes] and prints the device's measured limits; with --calibrate: reads [device, when]
and prints a calibration (measure/calibrate.py); so that the sweep's parent never makes a
CUDA context of its own."""
import faulthandler
import json
import os
import sys

# first: the plugins $ATTNPROF_PLUGINS names load before the sweep's modules
from ..attention import backends  # noqa: F401
from ..spec import CellSpec


def _own_stream():
    """The stream for this worker's JSON on a descriptor of its own; file descriptor 1 (what native code, a kernel's
    printf or a library's C++ writes) and sys.stdout then go to stderr, the run's worker.log, not into the stream."""
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def main() -> None:
    faulthandler.enable()  # a segfault leaves its traceback in the run's worker.log
    from .. import devices

    devices.keep_memory()  # a process that times cells (devices.keep_memory)
    out = _own_stream()
    if sys.argv[1:] == ["--probe"]:
        from ..attention.backends import availability

        asks = json.loads(sys.stdin.read())
        out.write(json.dumps([availability(name, dev, dtype, tuple(dims)) for name, dev, dtype, dims in asks]) + "\n")
        out.flush()
        return
    if sys.argv[1:] == ["--limits"]:
        from ..measure.limits import device_limits

        out.write(json.dumps(device_limits(*json.loads(sys.stdin.read()))) + "\n")
        out.flush()
        return
    if sys.argv[1:] == ["--calibrate"]:
        from ..measure.calibrate import calibrate

        out.write(json.dumps(calibrate(*json.loads(sys.stdin.read()))) + "\n")  # the stream, not print's stderr
        out.flush()
        return
    from ..store import Run
    from .groups import run_group

    job = json.loads(sys.stdin.read())

    def emit(event):
        out.write(json.dumps(event) + "\n")
        out.flush()

    run_group([CellSpec.from_row(r) for r in job["cells"]], Run.open(job["run"]), job["repeats"], job["warmup"], emit,
              job["extra"], job["trace"], set(job.get("alone", ())))


if __name__ == "__main__":
    main()
