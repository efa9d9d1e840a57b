"""The plan of make gpu-check: every step in order of value (STEPS), each with its expected seconds on one H200-class
GPU and in the CPU dry run. runner.py runs them within a budget; child.py runs one that needs a process of its own."""
from __future__ import annotations

from dataclasses import dataclass

from . import timing_judges
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
    """One step of the plan: what it is (run, judge or model), its function, its expected seconds on one H200-class
    GPU and in the CPU dry run (None: it needs CUDA and SKIPs at once there), the run a judge reads, its group.
    The GPU seconds are estimates from the work each does until a GPU run replaces them."""

    name: str
    kind: str
    fn: object
    gpu_s: float = 0.0
    cpu_s: float | None = 0.0
    run: str | None = None
    group: str = "core"

    def expected(self, cuda: bool) -> float | None:
        return self.gpu_s if cuda else self.cpu_s

    @property
    def needs_cuda(self) -> bool:
        return self.cpu_s is None or getattr(self.fn, "needs_cuda", False)


def _judges(run: str, group: str, judges) -> list[Step]:
    return [Step(f"{run}: {j.__name__.replace('_', ' ')}", "judge", j, run=run, group=group) for j in judges]


STEPS = [
    Step("core run", "run", core_run, 120, 15),
    *_judges("core run", "core", [cells_ok_within_tolerance, *timing_judges.JUDGES, device_limits_are_rates,
                                  time_model_fits_kernel_times_across_models, forced_kernels_ran,
                                  forward_peak_matches_the_planner, sdpa_runs_the_kernel_pytorch_answers,
                                  call_peaks_match_their_memory_models(["naive"]), nvml_covers_the_allocator,
                                  allocator_holds_only_the_model_and_its_forward]),
    *(Step(f.__name__.replace("_", " "), "model", f, s, None, group="harness") for f, s in (
        (short_generation_matches_its_prediction, 60), (kernels_credited_to_their_call, 25),
        (provoked_oom_then_ok, 30), (random_build_on_cuda, 15),
        (folder_build_on_cuda, 15), (sweep_parent_holds_no_context, 35), (cuda1_is_measured_on_cuda1, 20))),
    Step("tuned maps against sdpa", "model", tuned_maps_against_sdpa, 150, None, group="tune"),
    Step("rest run", "run", rest_run, 100, 15, group="rest"),
    *_judges("rest run", "rest", [cells_ok_within_tolerance, forced_kernels_ran, forward_peak_matches_the_planner,
                                  call_peaks_match_their_memory_models(CHUNKED),
                                  allocator_holds_only_the_model_and_its_forward]),
    *(Step(f.__name__.replace("_", " "), "model", f, s, None, group="last") for f, s in (
        (new_backend_check("flex"), 90), (new_backend_check("sage"), 30),
        (new_backend_check("diffusers:_flash_3"), 30))),
]
STEP = {s.name: s for s in STEPS}
