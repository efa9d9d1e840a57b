"""attnprof: a profiler for the attention blocks of Stable Diffusion U-Nets.

From Python, one stable place for what a user imports: `profile` (a generation of your own pipeline, as it runs),
`plan` and `fit` (the planner: no weights, no GPU), `tune` (the fastest attention backend per block of your
pipeline, as a processor map), `apply` and `processors` (a map put in place), and a backend of your own: `Backend`,
`register`, `make_processor`. Each is imported on first use, so that `import profiler` stays cheap.

The modules that moved into profiler/attention/ and profiler/unet/ keep their old paths (profiler.backends, the last
release's plugin docs) for one release: their names are the new modules', with a FutureWarning."""
import importlib
import sys
import types
import warnings

__version__ = "0.1.0"
__all__ = ["profile", "plan", "fit", "tune", "apply", "processors", "Profile", "Plan", "Fit", "Tuned", "Backend",
           "register", "make_processor"]
_HOMES = {"profile": "record.session", "Profile": "record.session", "plan": "api", "fit": "api", "Plan": "api",
          "Fit": "api", "tune": "tuning.tuner", "Tuned": "tuning.tuner", "apply": "attention.apply",
          "processors": "attention.apply", "Backend": "attention.backends", "register": "attention.backends",
          "make_processor": "attention.backends"}
MOVED = {name: f"attention.{name}" for name in ("backends", "recorder", "processor", "chunked", "fused")} | {
    name: f"unet.{name}" for name in ("models", "kinds", "checkpoint", "adapters", "workload", "weights_init")}


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    if name in MOVED:
        return sys.modules[f"{__name__}.{name}"]
    raise AttributeError(f"module 'profiler' has no attribute {name!r}")


class _Moved(types.ModuleType):
    """An old path of a module that moved (profiler.backends, now profiler.attention.backends): each name read
    from the new module, with a FutureWarning the first time; kept for one release."""

    def __init__(self, old: str, new: str):
        super().__init__(f"{__name__}.{old}")
        self._new, self._warned = f"{__name__}.{new}", False

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if not self._warned:
            self._warned = True
            public = f" (from profiler import {name})" if name in _HOMES else ""
            warnings.warn(f"{self.__name__} is now {self._new}{public}; the old path goes in the next release",
                          FutureWarning, stacklevel=2)
        return getattr(importlib.import_module(self._new), name)


for _old, _new in MOVED.items():
    sys.modules.setdefault(f"{__name__}.{_old}", _Moved(_old, _new))
