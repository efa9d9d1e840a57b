"""The plan of make gpu-check: every step in order of value (STEPS), each with its expected seconds on one H200-class
GPU and in the CPU dry run. steps.py runs them within a budget; child.py runs one that needs a process of its own."""
from __future__ import annotations

from dataclasses import dataclass

from . import timing_judges as tj
from ..tuning.check import tuned_maps_against_sdpa
from .model_judges import (device_limits_are_rates, short_generation_matches_its_prediction,
                           time_model_fits_kernel_times_across_models)
from .checks import (CHUNKED, allocator_holds_only_the_model_and_its_forward, call_peaks_match_their_memory_models,
                     cells_ok_within_tolerance, core_run, cuda1_is_measured_on_cuda1, folder_build_on_cuda,
                     forced_kernels_ran, forward_peak_matches_the_planner, kernels_credited_to_their_call,
                     new_backend_check, nvml_covers_the_allocator, provoked_oom_then_ok, random_build_on_cuda,
                     rest_run, sdpa_runs_the_kernel_pytorch_answers, sweep_parent_holds_no_context)

@dataclass(frozen=True)
class Step:
    """One step of the plan: its name (as the report prints it), what it is (run, judge or model), its function,
    its expected seconds on one H200-class GPU and in the CPU dry run, the run a judge reads, its group; whether it
    needs CUDA (it SKIPs at once without: a model check, a judge whose bounds are a GPU's), the backend it checks
    (one that must be installed and able to run here) and whether it needs a second GPU. The GPU seconds are
    estimates from the work each does until a GPU run replaces them."""

    name: str
    kind: str
    fn: object
    gpu_s: float = 0.0
    cpu_s: float = 0.0
    run: str | None = None
    group: str = "core"
    needs_cuda: bool = False
    backend: str | None = None
    needs_two_gpus: bool = False

    def expected(self, cuda: bool) -> float | None:
        """Seconds it is expected to take; None where it cannot run at all (a CUDA step on the CPU)."""
        return self.gpu_s if cuda else None if self.needs_cuda else self.cpu_s


def _judges(run: str, group: str, judges) -> list[Step]:
    """The judge steps of a run, from (name, function, needs CUDA)."""
    return [Step(f"{run}: {name}", "judge", fn, run=run, group=group, needs_cuda=cuda) for name, fn, cuda in judges]


def _models(group: str, checks, **flags) -> list[Step]:
    """The model checks of a group, from (name, function, GPU seconds): each needs CUDA."""
    return [Step(name, "model", fn, s, group=group, needs_cuda=True, **flags) for name, fn, s in checks]


TIMING_JUDGES = [(name, fn, True) for name, fn in zip(
    ["attention is its calls kernels", "kernel times are steady", "chosen and forced agree",
     "kernels rank the backends", "graphs agree with cupti", "events match the wall clock", "hooks change no kernel",
     "call kernels agree across passes", "machine held still", "bound is labelled"], tj.JUDGES, strict=True)]
CELLS = [("cells ok within tolerance", cells_ok_within_tolerance, False)]
KERNELS_AND_PEAKS = [("forced kernels ran", forced_kernels_ran, False),
                     ("forward peak matches the planner", forward_peak_matches_the_planner, False)]
ALLOCATOR = [("allocator holds only the model and its forward", allocator_holds_only_the_model_and_its_forward, True)]
CALL_PEAKS = "call peaks match their memory models"
STEPS = [
    Step("core run", "run", core_run, 120, 15),
    *_judges("core run", "core", [
        *CELLS, *TIMING_JUDGES,
        ("device limits are rates", device_limits_are_rates, True),  # its bounds are a GPU's (tests judge it on a CPU)
        ("time model fits kernel times across models", time_model_fits_kernel_times_across_models, False),
        *KERNELS_AND_PEAKS, ("sdpa runs the kernel pytorch answers", sdpa_runs_the_kernel_pytorch_answers, False),
        (CALL_PEAKS, call_peaks_match_their_memory_models(["naive"]), True),
        ("nvml covers the allocator", nvml_covers_the_allocator, True), *ALLOCATOR]),
    *_models("harness", [
        ("short generation matches its prediction", short_generation_matches_its_prediction, 60),
        ("kernels credited to their call", kernels_credited_to_their_call, 25),
        ("provoked oom then ok", provoked_oom_then_ok, 30), ("random build on cuda", random_build_on_cuda, 15),
        ("folder build on cuda", folder_build_on_cuda, 15),
        ("sweep parent holds no context", sweep_parent_holds_no_context, 35)]),
    *_models("harness", [("cuda1 is measured on cuda1", cuda1_is_measured_on_cuda1, 20)], needs_two_gpus=True),
    *_models("tune", [("tuned maps against sdpa", tuned_maps_against_sdpa, 150)]),
    Step("rest run", "run", rest_run, 100, 15, group="rest"),
    *_judges("rest run", "rest", [*CELLS, *KERNELS_AND_PEAKS,
                                  (CALL_PEAKS, call_peaks_match_their_memory_models(CHUNKED), True), *ALLOCATOR]),
    *(Step(f"{title} runs with its own kernels", "model", new_backend_check(backend), s, group="last",
           needs_cuda=True, backend=backend)
      for backend, title, s in (("flex", "flex", 90), ("sage", "sage", 30), ("diffusers:_flash_3", "flash 3", 30))),
]
STEP = {s.name: s for s in STEPS}
