"""attnprof: a profiler for the attention blocks of Stable Diffusion U-Nets.

From Python: `profile` (a generation of your own pipeline, as it runs), `plan` and `fit` (the planner: no weights, no
GPU), `tune` (the fastest attention backend per block of your pipeline, as a processor map), `apply` and `processors`
(a map put in place). Each is imported on first use, so that `import profiler` stays cheap."""
__version__ = "0.1.0"
__all__ = ["profile", "plan", "fit", "tune", "apply", "processors", "Profile", "Plan", "Fit", "Tuned"]


def __getattr__(name: str):
    if name in ("profile", "Profile"):
        from .record import session

        return getattr(session, name)
    if name in ("tune", "Tuned"):
        from .tuning import tuner

        return getattr(tuner, name)
    if name in ("apply", "processors"):
        from .attention import apply

        return getattr(apply, name)
    if name in ("plan", "fit", "Plan", "Fit"):
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'profiler' has no attribute {name!r}")
