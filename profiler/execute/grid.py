"""A sweep's grid: the YAML config (or `attnprof run`'s arguments), validated whole before any model is built, and
the cells it makes."""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..attention import backends
from .. import devices
from ..unet import models
from ..spec import (SETTINGS, CellSpec, InputError, load_yaml, parse_batch, parse_bytes, parse_dtype, parse_size,
                    setting_value)
from ..unet.workload import applies, check_settings

GRID_KEYS = {"models": "list of model names", "sizes": "list of WxH strings", "batch": "list of batch sizes",
             "dtypes": "list of dtype names", "backends": "list of backend names or {name: {option: value}}",
             **{name: f"list of values ({s.takes})" for name, s in SETTINGS.items()}}
KEYS = {**GRID_KEYS, "repeats": "timed forwards per cell", "warmup": "warm-up forwards per cell",
        "device": "auto, cpu, cuda or cuda:N", "out": "results folder",
        "memory_budget": "a size with its unit such as 20GiB, or a GPU name such as 4090",
        "timeout_s": "seconds per cell",
        "executor": "local or ray", "ray_address": "a Ray cluster's address (with executor: ray)",
        "also": "list of further grids, each a mapping of grid keys (the others as at the top)",
        "trace": "true, kernels or false: true keeps a Chrome / Perfetto trace of each cell's memory pass (on CUDA "
                 "with a memory snapshot) and its kernel-timing trace; kernels only the kernel-timing trace (compact, "
                 "gzipped: what trace.load reads again)",
        "allow_pickle": "true or false: let models be .ckpt / .pt files, pickles that run any code they hold"}


@dataclass(frozen=True)
class Sweep:
    models: tuple[str, ...]
    sizes: tuple[tuple[int, int], ...] = ((512, 512),)
    batch: tuple[int, ...] = (1,)
    dtypes: tuple[str, ...] = ()  # none: the device's default (devices.default_dtype: float32 on the CPU)
    backends: tuple[tuple[str, tuple], ...] = (("sdpa", ()),)
    repeats: int = 3
    warmup: int = 1
    device: str = "auto"
    out: str = "results"
    memory_budget: int | None = None
    timeout_s: float | None = None
    executor: str = "local"  # local worker subprocesses, or ray
    ray_address: str | None = None  # None: the cluster this machine runs, else a local one
    model_settings: tuple[tuple[str, tuple], ...] = ()  # setting -> its values: axes of the models they apply to
    also: tuple["Sweep", ...] = ()  # further grids, each with every key set (the top's where it set none)
    trace: bool | str = False  # per cell, its traces in the run folder: True all, "kernels" the kernel-timing one
    source: str = field(default="command line", compare=False)

    def resolved_device(self) -> str:
        return devices.resolve(self.device)

    def cells(self, device: str | None = None) -> list[CellSpec]:
        """The grid's cells (and its further grids', each cell once) on `device` (default: the sweep's device as
        this machine resolves it). A setting multiplies only the cells of the models it applies to."""
        device = device or self.resolved_device()
        out: dict[str, CellSpec] = {}
        for grid in (self, *self.also):
            for m in grid.models:
                kind = models.resolve(m).kind
                axes = [(n, vals) for n, vals in grid.model_settings if applies(n, kind)]
                for combo in itertools.product(*(vals for _, vals in axes)):
                    settings = check_settings(m, dict(zip((n for n, _ in axes), combo)))
                    for c in (CellSpec(m, w, h, b, dt, name, device, opts, settings)
                              for dt in grid.dtypes or (devices.default_dtype(device),)
                              for (w, h) in grid.sizes for b in grid.batch for name, opts in grid.backends):
                        out.setdefault(c.cell_id, c)
        return list(out.values())

    def grid(self) -> dict:
        """The grid keys as a config writes them."""
        return {"models": list(self.models), "sizes": [f"{w}x{h}" for w, h in self.sizes], "batch": list(self.batch),
                "dtypes": list(self.dtypes), "backends": [[n, dict(o)] for n, o in self.backends],
                **{n: list(v) for n, v in self.model_settings}}

    def settings(self) -> dict:
        return {**self.grid(), "repeats": self.repeats, "warmup": self.warmup, "device": self.device,
                "memory_budget": self.memory_budget, "timeout_s": self.timeout_s, "executor": self.executor,
                "ray_address": self.ray_address, "also": [g.grid() for g in self.also], "trace": self.trace, "source": self.source}


def _as_list(doc: dict, key: str, where: str) -> list:
    value = doc[key]
    if not isinstance(value, list) or not value:
        raise InputError(f"{where}: key '{key}' must be a non-empty {KEYS[key]}, not {value!r}")
    return value


def _checked(where: str, key: str, fn, value):
    try:
        return fn(value)
    except InputError as e:
        raise InputError(f"{where}: key '{key}': {e}") from None


def _backend_entry(entry, where: str) -> tuple[str, tuple]:
    if isinstance(entry, str):
        name, options = entry, {}
    elif isinstance(entry, dict) and len(entry) == 1:
        name, options = next(iter(entry.items()))
        if not isinstance(options, dict):
            raise InputError(f"{where}: key 'backends': options of {name!r} must be a mapping, e.g. "
                             f"{{{name}: {{slice_size: 4}}}}")
    else:
        raise InputError(f"{where}: key 'backends': {entry!r} is not a name or {{name: {{option: value}}}}")
    name, options = _checked(where, "backends", lambda o: backends.cell_backend(name, o), options)
    return name, tuple(sorted(options.items()))


def _positive_int(value, where: str, key: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InputError(f"{where}: key '{key}' must be a whole number >= {minimum}, not {value!r}")
    return value


def load(path: str | Path) -> Sweep:
    """Read and validate a sweep YAML file (or env:NAME, the text of an environment variable, as a queued job gets
    its config): every key, name and size, before any model is built."""
    if str(path).startswith("env:"):
        name = str(path)[4:]
        if name not in os.environ:
            raise InputError(f"sweep config {path}: the environment variable {name} is not set")
        return loads(os.environ[name], str(path))
    path = Path(path)
    if not path.is_file():
        raise InputError(f"sweep config {path} does not exist: see configs/sweeps/ for examples")
    return loads(path.read_text(), str(path))


def loads(text: str, where: str) -> Sweep:
    """Validate a sweep config's text; `where` names it in every error."""
    doc = load_yaml(text, where)
    if not isinstance(doc, dict):
        raise InputError(f"{where}: expected a mapping of keys ({', '.join(KEYS)})")
    unknown = [k for k in doc if k not in KEYS]
    if unknown:
        import difflib

        near = difflib.get_close_matches(unknown[0], list(KEYS), n=1)
        raise InputError(f"{where}: unknown key '{unknown[0]}'" + (f" (did you mean '{near[0]}'?)" if near else "")
                         + f": the keys are {', '.join(KEYS)}")
    _allow_pickle(doc, where)  # before the models are read
    kw = {"source": where, **_grid(doc, where)}
    also = doc.get("also", [])
    if not isinstance(also, list) or not all(isinstance(g, dict) for g in also):
        raise InputError(f"{where}: key 'also' must be a list of mappings of grid keys ({', '.join(GRID_KEYS)})")
    for i, g in enumerate(also):
        bad = [k for k in g if k not in GRID_KEYS]
        if bad:
            raise InputError(f"{where}: also[{i}]: key '{bad[0]}' is not a grid key: the grid keys are "
                             f"{', '.join(GRID_KEYS)}; the others hold for every grid and go at the top")
    top = {k: v for k, v in kw.items() if k in ("models", "sizes", "batch", "dtypes", "backends", "model_settings")}
    kw["also"] = tuple(Sweep(**{**top, **_grid({"models": doc.get("models"), **g}, f"{where}: also[{i}]",
                                              inherit=top)}) for i, g in enumerate(also))
    sweep = Sweep(**kw, **_run_keys(doc, where))
    for i, (grid, given) in enumerate(zip((sweep, *sweep.also), (doc, *also))):
        kinds = {models.resolve(m).kind for m in grid.models}
        for name in [n for n in SETTINGS if n in given]:  # a setting a grid inherits may apply to none of its models
            if not any(applies(name, k) for k in kinds):
                place = f"{where}: also[{i - 1}]" if i else where
                raise InputError(f"{place}: key '{name}' is for {' or '.join(SETTINGS[name].kinds)} models and this "
                                 "grid has none: "
                                 "add one to its models, or move the key to a grid that has one (also:)")
    return sweep


def _allow_pickle(doc: dict, where: str) -> None:
    if "allow_pickle" in doc:
        if not isinstance(doc["allow_pickle"], bool):
            raise InputError(f"{where}: key 'allow_pickle' must be true or false, not {doc['allow_pickle']!r}")
        if doc["allow_pickle"]:
            from ..unet.checkpoint import allow_pickle

            allow_pickle()


def _grid(doc: dict, where: str, inherit: dict | None = None) -> dict:
    """The grid keys of a config (or of one of its further grids)."""
    if doc.get("models") is None:
        raise InputError(f"{where}: key 'models' is missing: list one or more of {', '.join(models.known_models())}")
    kw = {}
    kw["models"] = tuple(str(m) for m in _as_list(doc, "models", where))
    for m in kw["models"]:
        _checked(where, "models", models.resolve, m)
    if "sizes" in doc:
        sizes = _as_list(doc, "sizes", where)
        if not all(isinstance(s, str) for s in sizes):
            raise InputError(f"{where}: key 'sizes' must be a list of WxH strings such as \"512x512\", not {sizes!r}")
        kw["sizes"] = tuple(_checked(where, "sizes", parse_size, s) for s in sizes)
    if "batch" in doc:
        batch = _as_list(doc, "batch", where)
        if not all(isinstance(b, int) and not isinstance(b, bool) for b in batch):
            raise InputError(f"{where}: key 'batch' must be a list of whole numbers such as [1, 2], not {batch!r}")
        kw["batch"] = tuple(_checked(where, "batch", parse_batch, b) for b in batch)
    if "dtypes" in doc:
        kw["dtypes"] = tuple(_checked(where, "dtypes", parse_dtype, d) for d in _as_list(doc, "dtypes", where))
    if "backends" in doc:
        given = doc["backends"]  # a list, or the docs' mapping form {sliced: {slice_size: 4}, sdpa: {}}
        entries = [{n: o or {}} for n, o in given.items()] if isinstance(given, dict) and given else \
            _as_list(doc, "backends", where)
        kw["backends"] = tuple(_backend_entry(b, where) for b in entries)
        maps_elsewhere([b if isinstance(b, str) else next(iter(b)) for b in entries], kw["models"],
                       kw.get("sizes") or (inherit or {}).get("sizes") or Sweep.sizes, f"attnprof sweep: {where}")
    axes = dict((inherit or {}).get("model_settings", ()))
    for name in SETTINGS:
        if name in doc:
            values = doc[name] if isinstance(doc[name], list) else [doc[name]]
            if not values:
                raise InputError(f"{where}: key '{name}' must be a value or a non-empty list of values")
            axes[name] = tuple(_checked(where, name, lambda v: setting_value(name, v), v) for v in values)
    kw["model_settings"] = tuple(axes.items())
    return kw


def maps_elsewhere(names: list, models_: tuple, sizes: tuple, said: str) -> None:
    """A processor map file among a grid's (or attnprof run's) backends that was tuned for another of its models or
    sizes: one warning line on stderr each (mix.elsewhere), after said; the sweep runs on."""
    import sys

    from ..attention import mix

    for name in names:
        if isinstance(name, str) and mix.is_map(name) and name != mix.NAME:
            doc = mix.read(name)
            for model in models_:
                line = mix.elsewhere(doc, name, model, sizes)
                if line:
                    print(f"{said}: {line}", file=sys.stderr, flush=True)


def _run_keys(doc: dict, where: str) -> dict:
    """The keys that hold for every grid of the config: how and where its cells run."""
    kw = {}
    for key, minimum in (("repeats", 1), ("warmup", 0)):
        if key in doc:
            kw[key] = _positive_int(doc[key], where, key, minimum)
    if "device" in doc:
        kw["device"] = devices.parse(doc["device"], where)
    if "out" in doc:
        if not isinstance(doc["out"], str) or not doc["out"]:
            raise InputError(f"{where}: key 'out' must be a folder path, not {doc['out']!r}")
        kw["out"] = doc["out"]
    if doc.get("memory_budget") is not None:
        kw["memory_budget"] = parse_bytes(doc["memory_budget"], f"{where}: key 'memory_budget'")
    if "executor" in doc:
        if doc["executor"] not in ("local", "ray"):
            raise InputError(f"{where}: key 'executor' must be local or ray, not {doc['executor']!r}")
        kw["executor"] = doc["executor"]
    if doc.get("ray_address") is not None:
        if not isinstance(doc["ray_address"], str) or not doc["ray_address"].strip():
            raise InputError(f"{where}: key 'ray_address' must be an address such as 10.0.0.1:6379 or auto, "
                             f"not {doc['ray_address']!r}")
        kw["ray_address"] = doc["ray_address"].strip()
    if "trace" in doc:
        if not isinstance(doc["trace"], bool) and doc["trace"] != "kernels":
            raise InputError(f"{where}: key 'trace' must be true, kernels or false, not {doc['trace']!r}")
        kw["trace"] = doc["trace"]
    if doc.get("timeout_s") is not None:
        t = doc["timeout_s"]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0:
            raise InputError(f"{where}: key 'timeout_s' must be a positive number of seconds, not {t!r}")
        kw["timeout_s"] = float(t)
    return kw


def with_overrides(sweep: Sweep, **changes) -> Sweep:
    return replace(sweep, **{k: v for k, v in changes.items() if v is not None})
