"""The GPU suite (pytest -m gpu): the checks of make gpu-check (profiler/gpu_check.py), one test each. Skipped with
the reason where there is no CUDA device; the CPU suite (tests/test_devices.py) catches what a CPU can."""
import pytest
import torch

from profiler import gpu_check

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="no CUDA device here: the GPU suite runs on a GPU box (make gpu-check)")]


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    return gpu_check.Context(device="cuda", out=tmp_path_factory.mktemp("gpu"))


@pytest.mark.parametrize("check", gpu_check.CHECKS, ids=lambda c: c.name)
def test_gpu(ctx, check, record_property):
    try:
        figure = check.fn(ctx)
    except gpu_check.Skip as e:
        pytest.skip(str(e))
    record_property("figure", figure)
    print(figure)

