"""Opt-in (make test-slow): the full-size SD1.5 U-Net, measured at 512x512 on the CPU."""
import pytest

from profiler.store import Run
from profiler.execute.grid import Sweep
from profiler.execute.sweep import execute

pytestmark = pytest.mark.slow


def test_full_size_sd15_at_512_on_the_cpu(tmp_path):
    sweep = Sweep(models=("sd15",), sizes=((512, 512),), dtypes=("float32",), device="cpu", repeats=1, warmup=0,
                  backends=(("naive", ()), ("sdpa", ())), out=str(tmp_path))
    run = Run.open(execute(sweep, workers=False, progress=False).run_path)
    cells = run.cells().set_index("backend")
    assert set(cells["status"]) == {"ok"}, cells["error"].to_dict()
    assert cells["error_ok"].all()
    blocks = run.blocks()
    assert blocks.groupby("backend").size().to_dict() == {"naive": 32, "sdpa": 32}
    first = blocks[(blocks["backend"] == "naive") & (blocks["call_index"] == 0)].iloc[0]
    assert (first["heads"], first["head_dim"], first["tokens_q"]) == (8, 40, 4096)
    assert first["score_elements"] == 8 * 4096 * 4096
    assert 0.9 < first["peak_mem_bytes"] / first["predicted_peak_bytes"] < 1.1
    sdpa = blocks[(blocks["backend"] == "sdpa") & (blocks["call_index"] == 0)].iloc[0]
    assert sdpa["peak_mem_bytes"] < first["peak_mem_bytes"] / 10
