"""A sweep worker: reads one job (JSON) on stdin, runs its cells, prints one JSON event per line on stdout."""
import faulthandler
import json
import sys

from .spec import CellSpec
from .store import Run
from .sweep import run_group


def main() -> None:
    faulthandler.enable()  # a segfault leaves its traceback in the run's worker.log
    job = json.loads(sys.stdin.read())
    keys = CellSpec.__dataclass_fields__
    cells = []
    for row in job["cells"]:
        spec = {k: row[k] for k in keys if k != "backend_options"}
        cells.append(CellSpec(**spec, backend_options=tuple(sorted(json.loads(row["backend_options"]).items()))))
    out = sys.stdout

    def emit(event):
        out.write(json.dumps(event) + "\n")
        out.flush()

    sys.stdout = sys.stderr  # anything else printed goes to stderr, not into the event stream
    run_group(cells, Run.open(job["run"]), job["repeats"], job["warmup"], emit)


if __name__ == "__main__":
    main()
