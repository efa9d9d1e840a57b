"""--trace: per cell, a Chrome / Perfetto trace of the probe forward with one range per attention call named by its
block path, stored in the run folder and listed in the cell's row; a sweep config's trace key."""
import json

import pytest

from profiler.execute.grid import loads
from profiler.spec import InputError
from profiler.store import Run, list_runs


def test_run_trace_leaves_a_trace_per_cell_with_one_range_per_call_named_by_its_block(traced_results):
    root, _ = traced_results
    run = Run.open(list_runs(root)[0])
    cells, blocks = run.read()
    assert set(cells["status"]) == {"ok"} and len(cells) == 2
    for c in cells.to_dict("records"):
        assert list(c["trace_files"]) == [f"traces/{c['cell_id']}.trace.json"]  # on the CPU no memory snapshot
        trace = json.loads((run.path / c["trace_files"][0]).read_text())
        ranges = sorted((e for e in trace["traceEvents"] if e.get("cat") == "user_annotation" and e.get("ph") == "X"),
                        key=lambda e: e["ts"])
        calls = blocks[blocks["cell_id"] == c["cell_id"]].sort_values("call_index")
        assert [r["name"] for r in ranges] == calls["block"].tolist() and len(ranges) == 32
        inside = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "cpu_op"
                  and ranges[0]["ts"] <= e["ts"] <= ranges[0]["ts"] + ranges[0]["dur"]]
        kernel = "aten::baddbmm" if c["backend"] == "naive" else "aten::_scaled_dot_product_flash_attention_for_cpu"
        assert kernel in {e["name"] for e in inside}  # the call's own ops sit inside its range


def test_trace_is_off_by_default_and_a_sweep_key_validated_like_the_others():
    good = "models: [tiny-sd15]\nsizes: [64x64]\n"
    assert not loads(good, "s.yaml").trace and loads(good + "trace: true\n", "s.yaml").trace
    with pytest.raises(InputError, match="^s.yaml: key 'trace' must be true, kernels or false, not 'sometimes'$"):
        loads(good + "trace: sometimes\n", "s.yaml")
