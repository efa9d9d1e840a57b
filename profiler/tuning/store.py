"""A tune stored: a run of kind `tune` (replay's cells per candidate backend, measured by the search; the map's
cell; a candidate that could not run every call as `unavailable` with why) and its map, tuned.json, in the run's
folder."""
from __future__ import annotations

from pathlib import Path

from ..measure.replay import replay, shape_of
from ..store import now, write_json
from . import search

MAP_FILE = "tuned.json"


def store(found, doc: dict, cell: dict, blocks: list[dict], out: Path, command: str, say) -> tuple[Path, Path]:
    """The tune as a new run under out, its map beside it: (the map's path, the run's folder)."""
    from ..measure.cell import failed_cell

    b = found.base
    target = {k: getattr(b, k) for k in ("model", "width", "height", "batch", "dtype")}
    ran = [k for k in found.keys if all(k in found.shapes[shape_of(r)]["figures"] for r in found.rows)]
    measured = {(k[0], k[1], b.dtype, b.device, s): f for s, m in found.shapes.items() for k, f in m["figures"].items()}
    repeats, warmup, rounds = found.timing
    run = replay([(target, found.rows, {})], [(k[0], dict(k[1])) for k in ran], b.device, repeats, warmup, out,
                 command, f"a tune of {b.model}", measured=measured,
                 manifest={"kind": "tune", "tune": {k: v for k, v in doc.items() if k != "blocks"}})
    failed = []
    for key in (k for k in found.keys if k not in ran):
        why = next((m["refused"][key] for m in found.shapes.values() if key in m["refused"]), "")
        failed.append(failed_cell(search.spec_of(b, key), "unavailable", f"it does not run every call: {why}"))
    for row in failed:
        run.record(row, [])
    run.record(cell, blocks)
    path = run.path / MAP_FILE
    write_json(path, doc)
    spec_keys = ("model", "width", "height", "batch", "dtype", "backend", "device", "backend_options", "settings",
                 "cell_id")
    run.update_manifest(cells=[*run.manifest()["cells"], *({k: r[k] for k in spec_keys} for r in [*failed, cell])],
                        ended_at=now(), interrupted=False, tune_rounds=rounds)
    run.compact()
    say(f"stored: run {run.id} under {out}, the map {path}")
    return path, run.path
