"""One step of make gpu-check in a process of its own: a run (a sweep through workers, whose parent this process
is) or a model check. Reads {"step", "ctx", "result"} as JSON on stdin and writes the step's outcome as JSON to
`result`: {"verdict": PASS | FAIL | SKIP, "figure", "evidence", "failed"}. The runner starts it in a process group of
its own, so that a stop ends it with every worker it started; faulthandler writes a native crash's trace to stderr,
which is the check's log. SIGTERM ends a sweep as Ctrl-C does (its run closed as interrupted, its cells kept)."""
import faulthandler
import json
import sys
import traceback
from dataclasses import asdict
from pathlib import Path

from ..attention import backends  # noqa: F401 (first: the plugins $ATTNPROF_PLUGINS names load before the rest)
from ..execute import stop_on_sigterm


def outcome(step, ctx) -> dict:
    from .verdicts import Skip, Verdict

    try:
        if step.kind == "run":
            from ..execute.sweep import execute
            from ..store import Run

            done = execute(step.fn(ctx), progress=False, command=f"gpu-check {step.name}")
            cells = Run.open(done.run_path).cells()
            counts = ", ".join(f"{n} {s}" for s, n in cells["status"].value_counts().items()) if len(cells) else \
                "none"
            verdict = Verdict(f"{len(cells)} cells recorded ({counts}): judged by the steps that read it")
        else:
            verdict = step.fn(ctx)
    except Skip as e:
        return {"verdict": "SKIP", "figure": str(e), "evidence": [], "failed": []}
    except Exception as e:  # the step's row says what failed; its traceback goes to the log
        traceback.print_exc()
        return {"verdict": "FAIL", "figure": f"{type(e).__name__}: {e}".strip(), "evidence": [], "failed": [str(e)]}
    return {"verdict": "FAIL" if verdict.failed else "PASS", **asdict(verdict)}


def main() -> None:
    faulthandler.enable()
    stop_on_sigterm()
    from ..store import write_json
    from .plan import STEP
    from .verdicts import Context

    job = json.loads(sys.stdin.read())
    result = outcome(STEP[job["step"]], Context.from_json(job["ctx"]))
    write_json(Path(job["result"]), result)
    print(f"gpu-check child: {job['step']}: {result['verdict']}: {result['figure']}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
