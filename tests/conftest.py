import os
import tempfile

import pytest
import torch

from profiler import models

# The device limits (profiler/measure/limits.py) are measured once per test session, into a cache of its own that
# the sweep workers and subprocesses the tests start share; never the user's ~/.cache/attnprof.
os.environ["ATTNPROF_CACHE"] = tempfile.mkdtemp(prefix="attnprof-test-cache-")


@pytest.fixture(scope="session")
def tiny_sd15():
    return models.build("tiny-sd15", weights="random", dtype="float32")


@pytest.fixture(scope="session")
def tiny_sdxl():
    return models.build("tiny-sdxl", weights="random", dtype="float32")


@pytest.fixture
def faults(monkeypatch):
    """The injected-failure backends of tests/faults.py, here and in the workers this test starts."""
    from tests import faults as module

    module.register_all()
    monkeypatch.setenv("ATTNPROF_PLUGINS", "tests.faults")
    module.raised.clear()
    yield module
    module.unregister_all()


@pytest.fixture(autouse=True)
def _few_threads():
    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def dashboard_results(tmp_path_factory):
    """A results folder with one run written by the real profiler, for the dashboard's tests: tiny-sd15 at 64x64 and
    128x128, float32 on the CPU, in process; naive, sdpa and subquad measured, xformers unavailable (CUDA only),
    and naive at 128x128 skipped by a memory budget set between its predicted need and subquad's."""
    from dataclasses import replace

    from profiler.execute.grid import Sweep
    from profiler.execute.sweep import execute, predict

    root = tmp_path_factory.mktemp("dashboard") / "results"
    sweep = Sweep(models=("tiny-sd15",), sizes=((64, 64), (128, 128)), dtypes=("float32",),
                  backends=(("naive", ()), ("sdpa", ()), ("subquad", ()), ("xformers", ())), repeats=2, warmup=0,
                  device="cpu", out=str(root))
    cells = [c for c in sweep.cells() if c.width == 128]
    predicted = predict(cells)[0]
    need = {c.backend: predicted[c.cell_id]["predicted_need_bytes"] for c in cells}
    assert need["naive"] > need["subquad"] > need["sdpa"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the timings do not matter here, and two threads on a busy machine spin for minutes
    try:
        execute(replace(sweep, memory_budget=(need["naive"] + need["subquad"]) // 2), workers=False, progress=False)
    finally:
        torch.set_num_threads(threads)
    return root


@pytest.fixture(scope="session")
def traced_results(tmp_path_factory):
    """A results folder with one run of `attnprof run ... --trace` (worker subprocesses, as the CLI runs by default):
    tiny-sd15 at 64x64, float32 on the CPU, naive and sdpa; and what the command printed."""
    import contextlib
    import io

    from profiler.cli import main

    root = tmp_path_factory.mktemp("traced") / "results"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["run", "--model", "tiny-sd15", "--size", "64x64", "--dtype", "float32", "--device", "cpu",
                     "--backend", "naive", "--backend", "sdpa", "--repeats", "1", "--warmup", "0", "--trace",
                     "--quiet", "--out", str(root)])
    assert code == 0, printed.getvalue()
    return root, printed.getvalue()
