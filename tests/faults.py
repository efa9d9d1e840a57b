"""Injected failures, registered as backends (profiler.backends.register) so that workers load them too: set
ATTNPROF_PLUGINS=tests.faults. Each raises on the calls of a real U-Net block (more than 64 query tokens); the
availability probe's 64-token calls pass, as a kernel that fails only under real load would. In this process, use
the `faults` fixture (conftest.py): it registers them and sets ATTNPROF_PLUGINS, and takes both back after."""
from profiler.backends import Backend, register

TRIGGER_TOKENS = 64
raised: list[str] = []  # what was raised, in this process


class Failing:
    def __init__(self, make):
        self.make = make

    def __call__(self, attn, hidden_states, *args, **kwargs):
        tokens = hidden_states.shape[1] if hidden_states.ndim == 3 else hidden_states.shape[2] * hidden_states.shape[3]
        if tokens > TRIGGER_TOKENS:
            exc = self.make()
            raised.append(f"{type(exc).__name__}: {exc}")
            raise exc
        from diffusers.models.attention_processor import AttnProcessor2_0

        return AttnProcessor2_0()(attn, hidden_states, *args, **kwargs)


def _torch_oom():
    import torch

    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.16 GiB. GPU 0 has a total capacity of "
                                  "23.55 GiB of which 1.02 GiB is free.")


FAULTS = {
    "fault-torch-oom": _torch_oom,
    "fault-text-oom": lambda: RuntimeError("CUDA out of memory. Tried to allocate 3.16 GiB"),
    "fault-error": lambda: RuntimeError("kernel exploded"),
}


def register_all() -> None:
    for name, make in FAULTS.items():
        register(Backend(name, "fused", f"test fault: raises {make()!r} on real blocks",
                         factory=lambda make=make: Failing(make), memory_like="sdpa"))


def unregister_all() -> None:
    from profiler.backends import BACKENDS

    for name in FAULTS:
        BACKENDS.pop(name, None)


register_all()  # on import: how a worker started with ATTNPROF_PLUGINS=tests.faults gets them
