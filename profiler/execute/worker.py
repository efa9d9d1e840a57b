"""A sweep worker: reads one job (JSON) on stdin, runs its cells, prints one JSON event per line on stdout.
With --probe: reads a JSON list of (backend, device, dtype, head dims) and prints one JSON list of (ok, reason); with
--limits: reads [device, dtypes] and prints the device's measured limits; with --calibrate: reads [device, when]
and prints a calibration (measure/calibrate.py); so that the sweep's parent never makes a
CUDA context of its own."""
import faulthandler
import json
import sys

from .. import backends  # noqa: F401 (first: the plugins $ATTNPROF_PLUGINS names load before the sweep's modules)
from ..spec import CellSpec


def main() -> None:
    faulthandler.enable()  # a segfault leaves its traceback in the run's worker.log
    if sys.argv[1:] == ["--probe"]:
        from ..backends import availability

        asks = json.loads(sys.stdin.read())
        print(json.dumps([availability(name, dev, dtype, tuple(dims)) for name, dev, dtype, dims in asks]))
        return
    if sys.argv[1:] == ["--limits"]:
        from ..measure.limits import device_limits

        print(json.dumps(device_limits(*json.loads(sys.stdin.read()))))
        return
    if sys.argv[1:] == ["--calibrate"]:
        from ..measure.calibrate import calibrate

        print(json.dumps(calibrate(*json.loads(sys.stdin.read()))))
        return
    from ..store import Run
    from .sweep import run_group

    job = json.loads(sys.stdin.read())
    out = sys.stdout

    def emit(event):
        out.write(json.dumps(event) + "\n")
        out.flush()

    sys.stdout = sys.stderr  # anything else printed goes to stderr, not into the event stream
    run_group([CellSpec.from_row(r) for r in job["cells"]], Run.open(job["run"]), job["repeats"], job["warmup"], emit,
              job["extra"], job["trace"])


if __name__ == "__main__":
    main()
