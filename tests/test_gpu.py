"""The GPU suite (pytest -m gpu): the model checks of make gpu-check (profiler/gpu_check), one test each, in this
process (make gpu-check runs each in a process of its own, with the runs and their judges). Skipped with the reason
where there is no CUDA device; the CPU suite (tests/test_devices.py, tests/test_gpu_check.py) catches what a CPU
can."""
import pytest
import torch

from profiler import gpu_check

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="no CUDA device here: the GPU suite runs on a GPU box (make gpu-check)")]


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu")
    return gpu_check.Context(device="cuda", out=out, runs=out / "runs")


@pytest.mark.parametrize("step", [s for s in gpu_check.STEPS if s.kind == "model"], ids=lambda s: s.name)
def test_gpu(ctx, step, record_property):
    try:
        verdict = step.fn(ctx)
    except gpu_check.Skip as e:
        pytest.skip(str(e))
    record_property("figure", verdict.figure)
    assert not verdict.failed, verdict.failed
