"""attnprof: a profiler for the attention blocks of Stable Diffusion U-Nets.

From Python, one stable place for what a user imports: `profile` (a generation of your own pipeline, as it runs),
`plan` and `fit` (the planner: no weights, no GPU), `tune` (the fastest attention backend per block of your
pipeline, as a processor map), `apply` and `processors` (a map put in place), and a backend of your own: `Backend`,
`register`, `make_processor`. Each is imported on first use, so that `import profiler` stays cheap."""
import importlib

__version__ = "0.1.0"
__all__ = ["profile", "plan", "fit", "tune", "apply", "processors", "Profile", "Plan", "Fit", "Tuned", "Backend",
           "register", "make_processor"]
_HOMES = {"profile": "record.session", "Profile": "record.cells", "plan": "api", "fit": "api", "Plan": "api",
          "Fit": "api", "tune": "tuning.tuner", "Tuned": "tuning.tuner", "apply": "attention.apply",
          "processors": "attention.apply", "Backend": "attention.backends", "register": "attention.backends",
          "make_processor": "attention.backends"}


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'profiler' has no attribute {name!r}")

