"""The results layout: one folder per run.

    results/<run-id>/manifest.json            the grid, the settings, the environment (updated under .lock)
    results/<run-id>/cells/<cell_id>.parquet  one row per finished cell
    results/<run-id>/blocks/<cell_id>.<v>.parquet  that cell's rows per attention call (v: the cell row's
                                              blocks_version, so that a cell recorded again never mixes versions)
    results/<run-id>/cells.parquet, blocks.parquet   the compacted form: what a finished sweep folds the per-cell
                                              files into (and the whole layout of runs written before per-cell files)
    results/<run-id>/traces/<cell_id>.*       with --trace: the cell's trace files, listed in its row (trace_files)

Every file is written to a temporary name in its folder and moved into place (os.replace): a reader sees the old or
the new file, never half of one. Recording a cell writes its own two files under the run's lock (.lock, held for
milliseconds), so it costs the same at the 10,000th cell as at the first and concurrent writers never lose a row;
readers take the lock shared, so a compaction never hides a cell from them. One executor at a time: `executor()`
holds .executor.lock for a sweep's life and names its holder to anyone else who tries."""
from __future__ import annotations

import datetime as dt
import errno
import fcntl
import json
import os
import secrets
import shutil
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from .report.frame import normalised
from .spec import InputError

MANIFEST, BLOCKS, CELLS = "manifest.json", "blocks.parquet", "cells.parquet"
CELL_DIR, BLOCK_DIR, TRACE_DIR, LOCK, EXECUTOR_LOCK = "cells", "blocks", "traces", ".lock", ".executor.lock"
DONE_STATUSES = ("ok", "oom", "skipped", "unavailable", "error", "timeout")


def cannot_write(root, why: str, where: str = "--out (or out: in the sweep config)") -> InputError:
    return InputError(f"cannot write the results folder {root} ({why}): choose another with {where}")


def check_writable(root, where: str = "--out") -> None:
    """Said before any work where Run.create could not make a run under root: the nearest of root and the folders
    above it that exists must be a folder this process may write in (a file there: Not a directory)."""
    path = Path(root).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise cannot_write(root, os.strerror(errno.ENOTDIR), where)
    if not os.access(existing, os.W_OK | os.X_OK):
        raise cannot_write(root, os.strerror(errno.EACCES), where)


@dataclass(frozen=True)
class RunKind:
    """What a kind of run holds, so that each reader asks here rather than guessing from the files: whether its
    cells timed whole forwards of a model (forward_time_ms: the findings' speed lines, diff's verdicts), whether its
    cells' models are names the planner resolves (a replay of its shapes), whether the time model may be fitted on
    it (forwards of models it can trace: a sweep's named ones, a record's components matched to them), and whether each of its calls has a measured peak."""

    name: str
    what: str
    forwards: bool
    named: bool
    calibrates: bool
    peaks: bool


RUN_KINDS = {k.name: k for k in (
    RunKind("sweep", "cells built by name and measured (attnprof run and sweep, make profile, gpu-check)", True, True,
            True, True),
    RunKind("replay", "each attention shape of a run or a plan, its kernel alone (attnprof replay)", False, True,
            False, True),
    RunKind("record", "a user's own generation as it ran (attnprof record, profiler.profile)", True, False, True,
            False),
    RunKind("tune", "each attention shape's backends timed alone, the fastest per block as a processor map, proved "
            "by the whole forward (attnprof tune, profiler.tune)", False, False, False, True))}


def kind_of(manifest: dict) -> RunKind:
    """The kind of a run from its manifest: its `kind`, else (runs written before kinds) a replay's settings, else a
    sweep."""
    return RUN_KINDS.get(manifest.get("kind")) or RUN_KINDS["replay" if "replay" in manifest else "sweep"]


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def new_run_id() -> str:
    """The time to the second, then the fraction of that second in 4 hex digits (15 us a step) and a random one:
    runs sort by name as they were created, two made within one second too ('latest' is the last made)."""
    t = dt.datetime.now()
    return t.strftime("%Y%m%d-%H%M%S-") + f"{t.microsecond * 65536 // 1_000_000:04x}{secrets.randbelow(16):x}"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, write) -> None:
    """The file written under a temporary name, flushed to disk, moved into place, and the move flushed (the
    folder fsynced): a crash or a power cut leaves the old file or the new one, never a torn or empty one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        _fsync(tmp)
        os.replace(tmp, path)
        _fsync(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path: Path, text: str) -> None:
    _atomic_write(path, lambda tmp: tmp.write_text(text))


def _json_text(data: dict) -> str:
    return json.dumps(data, indent=1, default=str) + "\n"


def write_json(path: Path, data: dict) -> None:
    write_text(path, _json_text(data))


def read_cache(path: Path) -> dict:
    """A JSON cache file's object (profiler.env.cache_dir): {} where it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_cache(path: Path, text: str) -> None:
    """A cache file written whole, its folder made; one that cannot be written is made again next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, text)
    except OSError:
        pass


def add_to_cache(path: Path, key: str, entry) -> None:
    """A JSON cache file with entry under key, beside the keys it held."""
    write_cache(path, _json_text({**read_cache(path), key: entry}))


@contextmanager
def cache_lock(path: Path):
    """The cache file at path held by one process at a time while it measures what the file lacks: a second waits,
    then reads what the first stored (two measuring at once would each time a machine the other keeps busy). Where
    the lock file cannot be made (a read-only cache folder), no lock."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the lock


def _write_rows(path: Path, rows: list[dict]) -> None:
    table = pa.Table.from_pylist(rows)
    _atomic_write(path, lambda tmp: pq.write_table(table, tmp))


def _write_frame(path: Path, df: pd.DataFrame) -> None:
    _atomic_write(path, lambda tmp: pq.write_table(pa.Table.from_pandas(df, preserve_index=False), tmp))


@contextmanager
def _flock(path: Path, shared: bool = False, blocking: bool = True):
    """An flock on path (created if it can be); yields False where it could not be taken without waiting. A lock
    for writing that cannot be opened is an error (never a lock-free write); a lock for reading in a read-only
    folder with no lock file is skipped (nobody can be writing there)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        try:
            fd = os.open(path, os.O_RDONLY) if shared else None
        except OSError:
            fd = None
        if fd is None and not shared:
            raise InputError(f"cannot lock {path} to write the run ({e.strerror}): make the run folder writable, or "
                             "write the run elsewhere (--out)") from None
        if fd is None:
            yield True
            return
    try:
        mode = (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if blocking else fcntl.LOCK_NB)
        try:
            fcntl.flock(fd, mode)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # closing drops the lock


def _holder(holder_file: Path, wait_s: float = 2.0) -> str:
    """Who holds a run's executor lock, from its executor.json. The holder writes that file just after it takes the
    lock, so for a moment the file can still name a process of this host that is gone (one killed while it held the
    run): that is read again until it names a live one, else the holder is "another process"."""
    import time

    deadline = time.monotonic() + wait_s
    while True:
        try:
            h = json.loads(holder_file.read_text())
            who = f"pid {h['pid']} on {h['host']} since {h['since']} ({h['command']})"
            if h["host"] != socket.gethostname() or _alive(int(h["pid"])):
                return who
        except (OSError, ValueError, KeyError, TypeError):
            pass
        if time.monotonic() > deadline:
            return "another process"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # no signal sent: whether the process exists (PermissionError: it does, another user's)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class RunBusy(InputError):
    """Another process runs this run's cells now."""


class Unreadable(InputError):
    """A file of a run that cannot be read (a torn copy, a disk error, an edit by hand); its cause is the reader's
    own error (JSONDecodeError, pyarrow's ArrowInvalid, ...)."""


def unreadable(path: Path, e: BaseException) -> Unreadable:
    detail = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return Unreadable(f"{path} cannot be read ({type(e).__name__}{': ' + detail if detail else ''}): restore it from "
                      f"a copy, or move the run folder {path.parent} out of the results folder")


class Run:
    """One run folder. `Run.create` starts one, `Run.open` continues one; `record` adds a finished cell."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.id = self.path.name

    @classmethod
    def create(cls, root: Path, manifest: dict, run_id: str | None = None) -> "Run":
        """A new run folder under root, whole at once: made under a hidden name with its manifest, then renamed into
        place, so that a stop at any moment leaves either no run or one with its manifest (never a bare folder)."""
        for _ in range(8):  # a new id taken by a run made in the same 15 us: another id
            run = cls(Path(root) / (run_id or new_run_id()))
            staging = run.path.with_name(f".{run.path.name}.new")
            try:
                staging.mkdir(parents=True, exist_ok=False)
                try:
                    write_json(staging / MANIFEST, {"run_id": run.id, "created_at": now(), "ended_at": None,
                                                    **manifest})
                    if run.path.exists():
                        raise FileExistsError(errno.EEXIST, "a run of that id exists")
                    staging.rename(run.path)
                finally:
                    shutil.rmtree(staging, ignore_errors=True)  # gone once renamed; else what the failure left
                return run
            except FileExistsError as e:
                error = e
                if run_id:
                    break
            except OSError as e:
                error = e
                break
        raise cannot_write(root, error.strerror) from None

    @classmethod
    def open(cls, path: Path) -> "Run":
        run = cls(path)
        if not (run.path / MANIFEST).is_file():
            raise InputError(f"{path} is not a run folder (no {MANIFEST}): give a folder under the results folder")
        return run

    def manifest(self) -> dict:
        path = self.path / MANIFEST
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise unreadable(path, e) from e
        if not isinstance(data, dict):
            raise unreadable(path, TypeError(f"a JSON {type(data).__name__}, not an object")) from None
        return data

    @property
    def kind(self) -> RunKind:
        return kind_of(self.manifest())

    def update_manifest(self, **fields) -> None:
        with _flock(self.path / LOCK):
            write_json(self.path / MANIFEST, {**self.manifest(), **fields})

    @contextmanager
    def executor(self, command: str):
        """Held while one process runs the run's cells; a second one gets RunBusy naming the holder."""
        holder_file = self.path / "executor.json"
        with _flock(self.path / EXECUTOR_LOCK, blocking=False) as got:
            if not got:
                raise RunBusy(f"run {self.id} is being run by {_holder(holder_file)}: wait for it to end, or stop it "
                              "and run again with --resume")
            write_json(holder_file, {"pid": os.getpid(), "host": socket.gethostname(), "since": now(),
                                     "command": command})
            try:
                yield self
            finally:
                holder_file.unlink(missing_ok=True)

    def record(self, cell: dict, blocks: list[dict], files: dict[str, bytes] | None = None) -> None:
        """Store a finished cell: its files (traces: name -> content, stored under traces/ and listed in the row's
        trace_files), its block rows, then its cell row (which names the blocks' version), then drop the blocks of
        the version it replaces. A cell recorded again replaces its rows. Nothing here lists a folder, so the cost
        does not grow with the run."""
        cid, version = cell["cell_id"], secrets.token_hex(6) if blocks else ""
        cell = {"run_id": self.id, **cell, "recorded_at": dt.datetime.now(dt.timezone.utc).isoformat(),
                "blocks_version": version}
        if files:  # each file whole before the row that lists it
            (self.path / TRACE_DIR).mkdir(exist_ok=True)
            for name, data in files.items():
                _atomic_write(self.path / TRACE_DIR / Path(name).name, lambda tmp, data=data: tmp.write_bytes(data))
            cell["trace_files"] = sorted(f"{TRACE_DIR}/{Path(name).name}" for name in files)
        cell_file = self.path / CELL_DIR / f"{cid}.parquet"
        with _flock(self.path / LOCK):
            (self.path / CELL_DIR).mkdir(exist_ok=True)
            replaced = pq.read_table(cell_file, columns=["blocks_version"])[0][0].as_py() \
                if cell_file.is_file() else ""
            if blocks:
                (self.path / BLOCK_DIR).mkdir(exist_ok=True)
                _write_rows(self.path / BLOCK_DIR / f"{cid}.{version}.parquet",
                            [{"run_id": self.id, **b, "blocks_version": version} for b in blocks])
            _write_rows(cell_file, [cell])
            if replaced:
                (self.path / BLOCK_DIR / f"{cid}.{replaced}.parquet").unlink(missing_ok=True)

    def write_frame(self, name: str, frame: pd.DataFrame) -> None:
        """A table of the run beside its cells (a recorded generation's every call: calls.parquet), written whole."""
        _write_frame(self.path / f"{name}.parquet", frame)

    def read_frame(self, name: str) -> pd.DataFrame:
        """That table, or an empty one where the run has none."""
        return _read(self.path / f"{name}.parquet")

    def _read_cells(self) -> tuple[pd.DataFrame, set[str]]:
        """(every recorded cell row, the ids whose row is a per-cell file); call under the lock."""
        compacted = _read(self.path / CELLS)
        files = sorted((self.path / CELL_DIR).glob("*.parquet")) if (self.path / CELL_DIR).is_dir() else []
        fresh = _read_many(files)
        ids = set(fresh["cell_id"]) if len(fresh) else set()
        if len(compacted) and ids:
            compacted = compacted[~compacted["cell_id"].isin(ids)]
        return _concat(compacted, fresh), ids

    def cells(self) -> pd.DataFrame:
        """The recorded cells, in the order of the run's grid, in the one schema of every reader (report/frame.py:
        what older runs lack filled, the display columns added)."""
        with _flock(self.path / LOCK, shared=True):
            cells, _ = self._read_cells()
        return normalised(self._in_grid_order(cells))

    def _in_grid_order(self, cells: pd.DataFrame) -> pd.DataFrame:
        if len(cells):
            order = {c["cell_id"]: i for i, c in enumerate(self.manifest().get("cells", []))}
            cells = cells.sort_values("cell_id", key=lambda s: s.map(order).fillna(len(order)), kind="stable")
        return self._named(cells).reset_index(drop=True)

    def _named(self, rows: pd.DataFrame) -> pd.DataFrame:
        """The rows with run_id = this folder's name: a run is its folder, whatever id its files were written under
        (a run copied or renamed from another machine; two copies of one run are two runs)."""
        return rows.assign(run_id=self.id) if len(rows) else rows

    def blocks(self) -> pd.DataFrame:
        """Block rows of the recorded cells, each cell's of the version its cell row names (rows of a cell whose
        cell row a kill kept from being written are left out: the cell runs again on resume and replaces them)."""
        return self.read()[1]

    def read(self) -> tuple[pd.DataFrame, pd.DataFrame]:
        """(cells, blocks) from one view of the run: every cell with all its block rows, both in the one schema of
        every reader (report/frame.py)."""
        with _flock(self.path / LOCK, shared=True):
            cells, fresh = self._read_cells()
            return normalised(self._in_grid_order(cells)), normalised(self._named(self._blocks_of(cells, fresh)))

    def _blocks_of(self, cells: pd.DataFrame, fresh: set[str]) -> pd.DataFrame:
        if not len(cells):
            return pd.DataFrame()
        version = dict(zip(cells["cell_id"], cells.get("blocks_version", pd.Series([None] * len(cells)))))
        old = _read(self.path / BLOCKS)
        if len(old):
            old = old[old["cell_id"].isin(set(version) - fresh)]
            if "blocks_version" in old:  # a compacted run: only the version each cell row names
                old = old[old["blocks_version"].fillna("") == old["cell_id"].map(version).fillna("")]
        files = [self.path / BLOCK_DIR / f"{cid}.{version[cid]}.parquet" for cid in sorted(fresh) if version[cid]]
        return _concat(old, _read_many(files)).reset_index(drop=True)

    def compact(self) -> None:
        """Fold the per-cell files into cells.parquet and blocks.parquet (under the lock: no reader misses a cell,
        no writer is lost), so that a finished run opens from two files however many cells it holds."""
        with _flock(self.path / LOCK):
            cells, fresh = self._read_cells()
            if not fresh:
                return
            blocks = self._blocks_of(cells, fresh)
            _write_frame(self.path / BLOCKS, blocks)
            _write_frame(self.path / CELLS, cells)
            for folder in (CELL_DIR, BLOCK_DIR):
                for f in (self.path / folder).glob("*.parquet") if (self.path / folder).is_dir() else []:
                    f.unlink()

    def recorded_since(self, cell_id: str, since: float | None) -> bool:
        """Whether the cell's row was recorded at or after `since` (seconds since the epoch): by the worker that ran
        it, before that worker died."""
        cell_file = self.path / CELL_DIR / f"{cell_id}.parquet"
        with _flock(self.path / LOCK, shared=True):
            if since is None or not cell_file.is_file():
                return False
            recorded = pq.read_table(cell_file, columns=["recorded_at"])[0][0].as_py()
        return dt.datetime.fromisoformat(recorded).timestamp() >= since

    def done_cells(self) -> dict[str, str]:
        """cell_id -> status of the cells already recorded."""
        cells = self.cells()
        return dict(zip(cells["cell_id"], cells["status"])) if len(cells) else {}


def _concat(old: pd.DataFrame, new: pd.DataFrame) -> pd.DataFrame:
    parts = [df for df in (old, new) if len(df)]
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()


def _read(path: Path) -> pd.DataFrame:
    if not path.is_file():
        return pd.DataFrame()
    try:
        return pd.read_parquet(path)
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise unreadable(path, e) from e


def _read_many(paths: list[Path]) -> pd.DataFrame:
    """Small Parquet files of one kind, their columns unified (a failed cell has fewer columns than an ok one)."""
    tables = []
    for path in paths:
        try:
            tables.append(pq.ParquetFile(path).read())
        except FileNotFoundError:  # replaced since it was listed (readers hold the lock shared: rare)
            continue
        except (OSError, ValueError) as e:
            raise unreadable(path, e) from e
    if not tables:
        return pd.DataFrame()
    return pa.concat_tables(tables, promote_options="permissive").to_pandas()


_WARNED: set = set()  # the unreadable runs this process has warned of


def readable_runs(root: Path) -> list[tuple["Run", dict]]:
    """(run, manifest) of every run under root whose manifest reads; one that does not is passed over with one
    warning line on stderr (once a process), so that one torn run never blocks new work."""
    import sys

    found = []
    for path in list_runs(root):
        run = Run.open(path)
        try:
            found.append((run, run.manifest()))
        except Unreadable as e:
            if path not in _WARNED:
                print(f"attnprof: warning: passed over {path.name}: {e}", file=sys.stderr)
                _WARNED.add(path)
    return found


def results_folder(root: Path | str) -> Path:
    """root, a folder that runs are stored under: InputError where it is a file (a folder not made yet holds none)."""
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise InputError(f"--results {root} is a file, not a results folder: give the folder the runs were written to "
                         "(their --out; default results)")
    return root


def list_runs(root: Path) -> list[Path]:
    root = results_folder(root)
    if not root.is_dir():
        return []
    # a hidden name is a run still being made (Run.create's staging folder, renamed into place once whole)
    return sorted((p for p in root.iterdir() if not p.name.startswith(".") and (p / MANIFEST).is_file()),
                  key=lambda p: p.name)


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
