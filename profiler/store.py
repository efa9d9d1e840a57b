"""The results layout: results/<run-id>/manifest.json + blocks.parquet + cells.parquet.

Every write goes to a temporary file in the same folder and is moved into place (os.replace), so a reader sees the
old or the new file, never half of one. A cell's block rows are written before its cell row; rewriting a cell first
drops its old rows, so a cell re-run after a crash between the two writes is never duplicated."""
from __future__ import annotations

import datetime as dt
import json
import os
import platform
import secrets
import subprocess
from pathlib import Path

import pandas as pd

from .spec import InputError

MANIFEST, BLOCKS, CELLS = "manifest.json", "blocks.parquet", "cells.parquet"
DONE_STATUSES = ("ok", "oom", "skipped", "unavailable", "error", "timeout")
REPO = Path(__file__).resolve().parent.parent


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def new_run_id() -> str:
    return dt.datetime.now().strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(2)


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(path: Path, data: dict) -> None:
    _atomic_write(path, lambda tmp: tmp.write_text(json.dumps(data, indent=1, default=str) + "\n"))


def _write_parquet(path: Path, df: pd.DataFrame) -> None:
    _atomic_write(path, lambda tmp: df.to_parquet(tmp, index=False))


def environment(device: str) -> dict:
    """Library versions, hardware and the profiler's git revision: a number without these is not comparable.
    The device is described from torch's properties and NVML, which make no CUDA context here."""
    import diffusers
    import torch

    from . import devices

    env = {"python": platform.python_version(), "torch": torch.__version__, "diffusers": diffusers.__version__,
           "cuda": torch.version.cuda, "platform": platform.platform(), "cpu": devices.cpu_name(),
           "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "device": device,
           "device_name": None, "driver": None}
    if device.startswith("cuda") and torch.cuda.is_available():
        described = devices.describe_cuda(torch.device(device).index or 0)
        env.update({k: described[k] for k in ("device_name", "device_uuid", "pci_bus_id", "driver")})
    else:
        env["device_name"] = env["cpu"]
    env["git_revision"] = _git_revision()
    return env


def _git_revision() -> str | None:
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if rev.returncode:
        return None
    return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


class Run:
    """One run folder. `Run.create` starts one, `Run.open` continues one; `record` adds a finished cell."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.id = self.path.name

    @classmethod
    def create(cls, root: Path, manifest: dict, run_id: str | None = None) -> "Run":
        run = cls(Path(root) / (run_id or new_run_id()))
        try:
            run.path.mkdir(parents=True, exist_ok=False)
        except OSError as e:
            raise InputError(f"cannot write the results folder {root} ({e.strerror}): choose another with --out "
                             "(or out: in the sweep config)") from None
        write_json(run.path / MANIFEST, {"run_id": run.id, "created_at": now(), "ended_at": None, **manifest})
        return run

    @classmethod
    def open(cls, path: Path) -> "Run":
        run = cls(path)
        if not (run.path / MANIFEST).is_file():
            raise InputError(f"{path} is not a run folder (no {MANIFEST}): give a folder under the results folder")
        return run

    def manifest(self) -> dict:
        return json.loads((self.path / MANIFEST).read_text())

    def update_manifest(self, **fields) -> None:
        write_json(self.path / MANIFEST, {**self.manifest(), **fields})

    def cells(self) -> pd.DataFrame:
        """The recorded cells, in the order of the run's grid."""
        cells = _read(self.path / CELLS)
        if len(cells):
            order = {c["cell_id"]: i for i, c in enumerate(self.manifest().get("cells", []))}
            cells = cells.sort_values("cell_id", key=lambda s: s.map(order).fillna(len(order)), kind="stable")
        return cells.reset_index(drop=True)

    def blocks(self) -> pd.DataFrame:
        """Block rows of the recorded cells (rows of a cell whose cell row a kill kept from being written are left
        out: the cell runs again on resume and replaces them)."""
        blocks = _read(self.path / BLOCKS)
        if len(blocks):
            blocks = blocks[blocks["cell_id"].isin(set(_read(self.path / CELLS).get("cell_id", [])))]
        return blocks.reset_index(drop=True)

    def done_cells(self) -> dict[str, str]:
        """cell_id -> status of the cells already recorded."""
        cells = self.cells()
        return dict(zip(cells["cell_id"], cells["status"])) if len(cells) else {}

    def record(self, cell: dict, blocks: list[dict]) -> None:
        cid = cell["cell_id"]
        cell = {"run_id": self.id, **cell, "recorded_at": dt.datetime.now(dt.timezone.utc).isoformat()}
        blocks = [{"run_id": self.id, **b} for b in blocks]
        old_blocks = _read(self.path / BLOCKS)
        if len(old_blocks):
            old_blocks = old_blocks[old_blocks["cell_id"] != cid]
        _write_parquet(self.path / BLOCKS, _concat(old_blocks, pd.DataFrame(blocks)))
        old_cells = _read(self.path / CELLS)
        if len(old_cells):
            old_cells = old_cells[old_cells["cell_id"] != cid]
        _write_parquet(self.path / CELLS, _concat(old_cells, pd.DataFrame([cell])))


def _concat(old: pd.DataFrame, new: pd.DataFrame) -> pd.DataFrame:
    parts = [df for df in (old, new) if len(df)]
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()


def _read(path: Path) -> pd.DataFrame:
    return pd.read_parquet(path) if path.is_file() else pd.DataFrame()


def list_runs(root: Path) -> list[Path]:
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if (p / MANIFEST).is_file()), key=lambda p: p.name)


def find_run(root: Path, name: str) -> Run:
    """A run id under root, a unique prefix of one, 'latest', or a path to a run folder."""
    path = Path(name)
    if (path / MANIFEST).is_file():
        return Run.open(path)
    runs = list_runs(root)
    if name == "latest" and runs:
        return Run.open(runs[-1])
    matches = [p for p in runs if p.name.startswith(name)]
    if len(matches) == 1:
        return Run.open(matches[0])
    if not runs:
        raise InputError(f"no runs under {root}: make one with attnprof run or attnprof sweep")
    what = "several runs start with" if matches else "no run named"
    raise InputError(f"{what} {name!r} under {root}: see attnprof runs --results {root}")
