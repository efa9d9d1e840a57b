"""The time model (planner/timing.py) and the GPU table (profiler/gpus.py): the fit on synthetic rows with a known
answer, the CLI on a small stored run whose times the test writes itself (no timing of anything)."""
import json
import re
from pathlib import Path

import numpy as np
import pytest

from profiler import gpus
from profiler.cli import main
from profiler.measure.limits import device_key, machine_key
from profiler.planner import calibration, host, plan, timing
from profiler.spec import CellSpec, InputError, parse_bytes, size_text
from profiler.store import Run

TRUE = {"core_self": 3.0, "core_cross": 1.5, "projections": 2.0, "overhead": 0.25}  # the synthetic device's answer
REST = {"convolution": 3.0, "matmul": 2.0, "norm": 5.0, "other": 4.0, "ops": 0.01}
PEAKS = {"float32": 2e11}, 1.5e10  # FLOP/s, bytes/s
DEVICE = timing.Device(PEAKS[0]["float32"], PEAKS[1])
SIZES = [(64, 64), (128, 128), (192, 128), (128, 64), (64, 192), (192, 192)]  # more forwards than rest features


def test_nnls_recovers_known_coefficients_and_clips_negative_ones():
    rng = np.random.default_rng(0)
    x = rng.uniform(0.1, 2.0, size=(40, 3))
    assert np.allclose(timing.nnls(x, x @ np.array([2.0, 0.5, 3.0])), [2.0, 0.5, 3.0])
    # a target that an unconstrained fit would give a negative weight: that weight is 0, the rest refitted
    y = x @ np.array([2.0, -1.0, 0.0])
    coef = timing.nnls(x, y)
    assert coef[1] == coef[2] == 0  # column 2 alone would come out negative once column 1 is gone: it goes too
    assert coef[0] == pytest.approx(np.linalg.lstsq(x[:, [0]], y, rcond=None)[0][0])


def test_fit_model_leave_one_out_is_exact_on_noiseless_rows_and_measures_a_wrong_cell():
    rows = []
    for cell, scale in (("a", 1.0), ("b", 2.0), ("c", 3.0)):
        for k in range(6):
            f = {"core_self": scale * (k + 1) * (k % 2), "core_cross": scale * (k + 1) * (1 - k % 2),
                 "projections": 0.1 * scale * k, "overhead": 1.0}
            rows.append({**f, "time_ms": timing.apply({"coefficients": TRUE}, f, 0.0), "cell_id": cell})
    fitted = timing.fit_model(rows, timing.CALL_FEATURES, "time_ms")
    assert fitted["coefficients"] == pytest.approx(TRUE)
    assert fitted["cells"] == 3 and fitted["loo_error_pct"] == pytest.approx(0, abs=1e-6)
    for r in rows:  # cell c measured 20% slower than the model: its left-out prediction is 1/1.2 of it
        r["time_ms"] *= 1.2 if r["cell_id"] == "c" else 1.0
    loo = {e["cell_id"]: e for e in timing.fit_model(rows, timing.CALL_FEATURES, "time_ms")["loo"]}
    assert loo["c"]["predicted_ms"] == pytest.approx(loo["c"]["measured_ms"] / 1.2, rel=1e-6)


def _features(row, backend, call_ops, device=DEVICE) -> dict:
    return timing.call_features(row, backend, {}, "float32", timing.roof_ms(call_ops, device), device)


def _rest(ops, device=DEVICE) -> float:
    return sum(REST[k] * v for k, v in device.rest_features(ops["rest"]).items())


def _synthetic_run(root, sizes, backend="naive", gpu_name=None, run_id="synthetic", kept=True, scale=1.0):
    """A stored run of tiny-sd15 whose every call takes what TRUE says on the device of PEAKS (and its rest what
    REST says), recorded with this machine's CPU limits key, so that plan --device cpu --results finds it; or, with
    gpu_name, as if made on a CUDA device of that name (its environment and limits key), each call's CUPTI kernel time
    what TRUE says on that GPU's published figures (the table's), warm-up 1 and 3 repeats. kept=False: under the key
    of a user's own process (attnprof record's). scale: every time that many times what TRUE and REST say."""
    key = f"{gpu_name} | synthetic" if gpu_name else device_key("cpu", kept=kept)
    manifest = {"device_peak_flops": PEAKS[0], "device_peak_bytes_per_s": PEAKS[1],
                "device_memory": {}, "device_softmax_per_s": {},  # DEVICE's: no cache, page or softmax terms
                "device_limits": {"key": key, "measured_at": "synthetic"},
                "environment": {"device": "cuda:0", "device_name": gpu_name} if gpu_name else {"device": "cpu"}}
    run = Run.create(root, manifest, run_id="synthetic-gpu" if gpu_name else run_id)
    table = gpus.named_in(gpu_name) if gpu_name else None
    device = timing.Device(table["tflops"]["float32"] * 1e12, table["bytes_per_s"]) if table else DEVICE
    for w, h in sizes:
        spec = CellSpec("tiny-sd15", w, h, 1, "float32", backend, "cuda" if gpu_name else "cpu")
        p = plan("tiny-sd15", w, h, 1, "float32", backend=backend, device="cpu")
        ops = timing.walk("tiny-sd15", w, h, 1, "float32")
        blocks = []
        for i, (row, call_ops) in enumerate(zip(p["blocks"], ops["calls"])):
            f = _features(row, backend, call_ops, device)
            blocks.append({**spec.as_row(), **{k: v for k, v in row.items() if k != "traced_peak_bytes"},
                           "call_index": i, "time_ms": scale * sum(TRUE[k] * f[k] for k in TRUE)}
                          | ({"time_source": "cupti"} if gpu_name else {}))
        rest = scale * _rest(ops)
        attention = sum(b["time_ms"] for b in blocks)
        run.record({**spec.as_row(), "status": "ok", "attention_time_ms": attention, "warmup": 1, "repeats": 3,
                    "forward_time_ms": attention + rest}, blocks)
    return run


def test_a_forwards_leave_one_out_over_runs_of_the_same_cells_counts_each_forward_once(tmp_path):
    """The same cells in two runs (a grid run twice, a script recorded in three pairs): each forward left out is
    predicted from its own calls, not from those of every run that holds its cell (which read 185% for recorded
    generations in three runs)."""
    for run_id in ("synthetic", "synthetic-again"):
        _synthetic_run(tmp_path, SIZES, run_id=run_id)
    c = calibration.calibrate(tmp_path, device_key("cpu", kept=True), write=False)
    fitted = c["backends"]["naive float32"]
    assert len(fitted["loo_forward"]) == 2 * len(SIZES) and fitted["loo_forward_error_pct"] == pytest.approx(0, abs=0.1)


def test_runs_of_ours_and_a_users_generations_calibrate_one_machine(tmp_path):
    """Issue 64's tour: two attnprof run runs of tiny-sd15 (their processes keep their memory), then plan --pipeline
    (a user's generation, whose process does not) said 'no stored runs of this device and backend': the two keys
    were two machines. Both count now, each sample priced on its own run's limits; the limits are the key's own."""
    _synthetic_run(tmp_path, SIZES[:3], run_id="run-a")
    _synthetic_run(tmp_path, SIZES[3:], run_id="run-b")
    user = calibration.calibrate(tmp_path, device_key("cpu", kept=False), write=False)
    assert user is not None, "a user's generation's key found none of the runs of ours"
    assert sorted(user["runs"]) == ["run-a", "run-b"] and user["backends"]["naive float32"]["cells"] == 6
    assert user["backends"]["naive float32"]["coefficients"] == pytest.approx(TRUE, rel=1e-6)
    assert user["limits"] == {}  # none of the runs has this key: plan measures this process's limits
    limits, cal, _ = calibration.target("cpu", "float32", results=str(tmp_path), kept=False)
    # this process's limits: "memory kept" where an earlier test in this worker kept its memory (order-dependent)
    assert machine_key(limits["device_limits"]["key"]) == machine_key(device_key("cpu", kept=False))
    assert "naive float32" in cal["backends"]
    _synthetic_run(tmp_path, SIZES[:2], run_id="recorded", kept=False)  # and the other way round
    ours = calibration.calibrate(tmp_path, device_key("cpu", kept=True), write=False)
    assert sorted(ours["runs"]) == ["recorded", "run-a", "run-b"] and ours["limits"]["device_peak_flops"] == PEAKS[0]


@pytest.mark.parametrize("scale", [0.125, 8.0])
def test_a_run_far_off_the_others_is_named_and_left_out_of_the_fit(capsys, tmp_path, scale):
    """Issue 64's tour: one run at 8x8 among tiny-sd15's others made every prediction after it 'no prediction
    (leave-one-out error 756%)', naming no run. Its leave-one-out error far over the others', it is left out of the
    fit (the others' answer comes back exactly) and named in the plan's 'time from' line with how to move it out."""
    _synthetic_run(tmp_path, SIZES[:3], run_id="run-a")
    _synthetic_run(tmp_path, SIZES[3:], run_id="run-b")
    _synthetic_run(tmp_path, [(8, 8)], run_id="odd", scale=scale)
    c = calibration.calibrate(tmp_path, device_key("cpu", kept=True), write=False)
    assert "odd" in c["passed_over"], "the odd run was not named"
    assert sorted(c["runs"]) == ["run-a", "run-b"]
    assert c["backends"]["naive float32"]["coefficients"] == pytest.approx(TRUE, rel=1e-6)
    code = main(["plan", "--model", "tiny-sd15", "--size", "128x192", "--backend", "naive", "--dtype", "float32",
                 "--device", "cpu", "--results", str(tmp_path)])
    text = " ".join(capsys.readouterr().out.split())  # the footer's lines wrapped at the terminal's width
    line = text.split(" time from: ", 1)[1].split(" params_total:", 1)[0]
    assert code == 0 and "leave-one-out error 0.0%" in line
    why = line.split("; left out 1 run (odd: its leave-one-out error ", 1)[1]
    error, median = (int(n) for n in re.match(r"(\d+)% is over 5x the other runs' median (\d+)%: ", why).groups())
    assert error > 5 * median and error > 50
    assert why.endswith(f"left out of the fit (an odd size or a machine that moved; move {tmp_path / 'odd'} out of "
                        f"{tmp_path} to keep it out for good))")
    _synthetic_run(tmp_path, SIZES[:2], run_id="run-c", scale=1.1)  # a run a little off: kept
    assert "run-c" not in calibration.calibrate(tmp_path, device_key("cpu", kept=True), write=False)["passed_over"]


def test_plan_predicts_a_new_size_from_a_stored_run_exactly(capsys, tmp_path):
    _synthetic_run(tmp_path, SIZES)
    code = main(["plan", "--model", "tiny-sd15", "--size", "128x192", "--backend", "naive", "--dtype", "float32",
                 "--device", "cpu", "--results", str(tmp_path), "--json"])
    out = json.loads(capsys.readouterr().out)[0]
    assert code == 0
    # the answer the synthetic device gives at 128x192, a size the run does not hold
    ops = timing.walk("tiny-sd15", 128, 192, 1, "float32")
    want_calls = []
    for row, call_ops in zip(out["blocks"], ops["calls"]):
        f = _features(row, "naive", call_ops)
        want_calls.append(sum(TRUE[k] * f[k] for k in TRUE))
    assert [b["predicted_time_ms"] for b in out["blocks"]] == pytest.approx(want_calls, rel=1e-6)
    t = out["totals"]
    rest = _rest(ops)
    assert t["predicted_attention_time_ms"] == pytest.approx(sum(want_calls), rel=1e-6)
    assert t["predicted_forward_time_ms"] == pytest.approx(sum(want_calls) + rest, rel=1e-6)
    assert t["time_source"].startswith("calibrated on 6 cells in 1 runs of this device, leave-one-out error 0.0%")
    assert all(b["predicted_time_ms"] >= b["roofline_time_ms"] for b in out["blocks"])
    # the fit and its residuals went to the calibration file, under the device's key
    stored = json.loads(calibration.calibration_path().read_text())[device_key("cpu", kept=True)]
    assert stored["backends"]["naive float32"]["coefficients"] == pytest.approx(TRUE, rel=1e-6)


def test_a_score_table_through_separate_gemms_is_priced_by_their_measured_rate_in_the_cache_or_not():
    """tiny-sd15 at 256x256 (heads of 4): sliced's 1024-token tables (4 MiB a head) stay in a 32 MiB cache, naive's
    (32 MiB) do not, and both calls measured 11.8 ms on this project's CPU, every score at about 1.4 ns in either:
    the GEMMs at a head dim of 4 cost their loop, not their FLOPs (16 a score) nor their bytes. Priced at the cache's
    bandwidth, sliced's was predicted at a third of naive's. With the score GEMMs' rate both are that rate's; a fused
    kernel's scores never leave its tiles (no such term), and the roofline bound leaves the term out (a cost measured
    at one head dim, not a bound at every one)."""
    e, cache = 8 * 1024 * 1024, 32 * 2**20
    device = timing.Device(2e11, 3e10, cache, 1.78e11, softmax=3.2e9, score_gemm=1.1e9)
    row = next(r for r in timing.walk("tiny-sd15", 256, 256, 1, "float32")["rows"]
               if r["kind"] == "self" and r["tokens_q"] == 1024)
    assert row["score_elements"] == e and row["head_dim"] == 4
    gemms_and_softmax = (e / 1.1e9 + e / 3.2e9) * 1e3  # ms
    f = {b: timing.call_features(row, b, {}, "float32", 0.0, device) for b in ("sliced", "naive", "sdpa")}
    assert f["sliced"]["core_self"] == pytest.approx(gemms_and_softmax) == f["naive"]["core_self"]
    without = timing.Device(2e11, 3e10, cache, 1.78e11, softmax=3.2e9)  # the model before: the cache's bandwidth
    assert timing.call_features(row, "sliced", {}, "float32", 0.0, without)["core_self"] < gemms_and_softmax / 2
    assert f["sdpa"]["core_self"] == pytest.approx(timing.call_features(row, "sdpa", {}, "float32", 0.0,
                                                                        without)["core_self"])
    assert f["sliced"]["roofline_ms"] == timing.call_features(row, "sliced", {}, "float32", 0.0, without)["roofline_ms"]
    # SD 1.5 at 512x512 on the same device: heads of 40 (160 FLOPs a score, 0.80 ns at P) still below a score
    # through the GEMMs (0.91 ns at G); heads of 80 and 160 (1.6 and 3.2 ns) bound by their FLOPs
    rows = timing.walk("sd15", 512, 512, 1, "float32")["rows"]
    for head_dim, bound in ((40, "gemms"), (80, "flops"), (160, "flops")):
        r = next(r for r in rows if r["kind"] == "self" and r["head_dim"] == head_dim)
        ms = r["flops"] / 2e11 if bound == "flops" else r["score_elements"] / 1.1e9
        assert timing.call_features(r, "sliced", {}, "float32", 0.0, device)["core_self"] == pytest.approx(
            (ms + r["score_elements"] / 3.2e9) * 1e3), head_dim


def test_a_recorded_calls_new_pages_are_those_it_was_counted_to_touch():
    """In a user's process (fresh_min: glibc's largest mmap threshold) a call's tables of 32 MiB and up are priced
    as new pages; sliced's 4 MiB tables at 256x256 get them in some processes and not in others (glibc's thresholds
    move with what the process freed), so a recorded call's pages are the ones counted: 0 or 728 MiB a forward alike
    priced as they fell. A sweep's rows (no count) and a kept process keep the model's."""
    device = timing.Device(2e11, 3e10, 32 * 2**20, 1.78e11, new_page_bandwidth=4e9, fresh_min=32 * 2**20,
                           softmax=3.2e9, score_gemm=1.1e9)
    row = next(r for r in timing.walk("tiny-sd15", 256, 256, 2, "float32")["rows"]
               if r["kind"] == "self" and r["tokens_q"] == 1024)
    model = timing.call_features(row, "sliced", {}, "float32", 0.0, device)
    assert model["fixed_ms"] == 0  # 4 MiB tables: under fresh_min, no pages in the model
    for counted in (0, 2**27):
        f = timing.call_features({**row, "faulted_bytes": counted}, "sliced", {}, "float32", 0.0, device)
        assert f["fixed_ms"] == pytest.approx(counted / 4e9 * 1e3) and f["core_self"] == model["core_self"]
    assert timing.call_features({**row, "faulted_bytes": float("nan")}, "sliced", {}, "float32", 0.0,
                                device)["fixed_ms"] == 0
    kept = timing.Device(2e11, 3e10, 32 * 2**20, 1.78e11, softmax=3.2e9, score_gemm=1.1e9)
    assert timing.call_features({**row, "faulted_bytes": 2**27}, "sliced", {}, "float32", 0.0, kept)["fixed_ms"] == 0


def test_plan_on_a_gpu_from_the_table_prices_each_call_by_its_kernels_fit(capsys):
    """An H100 (sm90, the architecture of the kernel times kept with the project): each sdpa call (cuDNN's on sm90) at
    the cuDNN kernel's fit to the H200's kernel times, on the H100's published figures, its projections, minimum and
    all; sliced (an unfused core: its tables' traffic) at naive's fit there; the host apart, overlapped op by op;
    every figure named with its source and said to be an estimate."""
    code = main(["plan", "--model", "sd15", "--size", "512x512", "--gpu", "H100-SXM", "--host-us-per-op", "20"])
    out = capsys.readouterr().out
    assert code == 0
    assert "sdpa (published efficiencies): GPU kernels" in out and "an estimate, not a measurement" in out
    assert "kernel times fitted on NVIDIA H200 (13 cells)" in " ".join(out.split())
    assert "host from:                 given" in out and "time rests on:             attention: measured kernels" in out
    assert "H100-SXM (sm90): 989.5 TFLOP/s dense float16, 3.35 TB/s, 80 GiB" in out and "datasheet" in out
    h100 = gpus.get("H100")
    cal = calibration.published_calibration(h100, "float16", host_us=20.0)
    device = timing.Device(989.5e12, 3350e9)
    ops = timing.walk("sd15", 512, 512, 1, "float16")
    hosts = {}
    for backend, coef in (("sdpa", cal["kernels"]["cudnn"]), ("sliced", cal["kernels"]["naive"])):
        p = plan("sd15", 512, 512)
        t = timing.predict(p, backend, {}, gpus.limits(h100, "float16"), cal, gpu=h100)
        assert t["time_published"] and t["time_calibrated"] and t["bound"] == "host"
        for row, o in list(zip(p["blocks"], ops["calls"]))[:4]:
            f = timing.call_features(row, backend, {}, "float16", timing.roof_ms(o, device), device)
            want = sum(v * f[k] for k, v in coef["coefficients"].items())
            assert row["predicted_time_ms"] == pytest.approx(want, rel=1e-9) and want > row["roofline_time_ms"]
        cores = sum(host.core_ops(backend, {}, row, "float16") for row in ops["rows"])
        assert t["predicted_host_time_ms"] == pytest.approx(20e-3 * (len(ops["rest"]) +
                                                                     sum(len(c) for c in ops["calls"]) + cores))
        hosts[backend] = t["predicted_host_time_ms"]
        assert t["predicted_forward_time_ms"] >= max(t["predicted_host_time_ms"], t["predicted_gpu_time_ms"])
        assert t["predicted_graph_time_ms"] == t["predicted_gpu_time_ms"] > t["roofline_forward_time_ms"]
    # the host of each backend's own core: sliced's loop (a baddbmm, a softmax and a bmm per head and image at
    # slice_size 1) dispatches far more than sdpa's one fused kernel
    assert hosts["sliced"] > 2 * hosts["sdpa"], hosts


def test_each_backends_host_counts_its_own_attention_core():
    """host.core_ops on SD 1.5's calls at batch 1 (8 heads): a call under sdpa dispatches its kernels and nothing
    else (to_q, to_k, to_v, the fused core, to_out and diffusers' rescale division; a fake tensor's metadata queries,
    prim.device, are no ops: they were 22 more a call), and its core nets none over the walk's count of the call
    (the fused kernel writes its output in the layout the core-less call's reshape copies into); naive's a table
    (baddbmm, softmax, bmm and its layouts); sliced's a Python loop of 8 slices, each a baddbmm, a softmax and a bmm;
    a CUDA-only kernel (xformers) is taken as one fused kernel, as sdpa's."""
    ops = timing.walk("sd15", 512, 512, 1, "float16")
    row = ops["rows"][0]  # down_blocks.0's first self-attention: 4096 tokens, 8 heads of 40
    shape = tuple(row.get(k) or "" if k == "upcast" else row[k] for k in host.CALL_SHAPE)
    assert host._call_ops("sdpa", {}, shape, "float16") == 6 == len(ops["calls"][0])
    core = {b: host.core_ops(b, {}, row, "float16") for b in ("sdpa", "naive", "sliced", "xformers")}
    assert core["sdpa"] == 0 and core["naive"] >= core["sdpa"] + 3, core
    assert core["sliced"] >= 3 * row["batch"] * row["heads"] + core["sdpa"], core
    assert core["xformers"] == core["sdpa"]
    assert host.forward_ops(ops, "sliced") - host.forward_ops(ops, "sdpa") == \
        sum(host.core_ops("sliced", {}, r, "float16") - host.core_ops("sdpa", {}, r, "float16") for r in ops["rows"])


def test_chunked_cores_ops_counted_from_a_few_chunks_are_the_direct_count_at_real_sizes(monkeypatch):
    """split's and subquad's core ops (host._looped_ops: two or three calls of two or three chunks a loop) against
    the same call counted whole on fake tensors, chunk by chunk, on every distinct call of SD 1.5 at 1024x1024 and
    SD 2.1-v (upcast attention) at 768x768, batch 2: their own options, a tighter budget (a ragged last chunk) and
    subquad with chunks that divide nothing; the counts grow with the chunks, as they must."""
    shapes = []
    for model, side in (("sd15", 1024), ("sd21-768-v", 768)):
        rows = timing.walk(model, side, side, 2, "float16")["rows"]
        shapes += list({tuple(r.get(k) or "" if k == "upcast" else r[k] for k in host.CALL_SHAPE): 0
                        for r in rows})
    assert {s[6] for s in shapes} == {"", "attention"} and max(s[4] for s in shapes) == 16384
    asks = [("split", {"budget_bytes": 64 * 2**20}), ("split", {"budget_bytes": 28 * 2**20}),
            ("subquad", {"query_chunk": 1024, "key_chunk": 4096}), ("subquad", {"query_chunk": 700, "key_chunk": 999})]
    counted = {}
    for name, options in asks:
        for shape in shapes:
            direct = host._call_ops(name, dict(options), shape, "float16")
            assert host._looped_ops(name, dict(options), shape, "float16") == direct, (name, options, shape)
            counted[name, options.get("budget_bytes", options.get("query_chunk")), shape] = direct
    # at a few tokens (8 to 11, head dims 40 and 64): chunks of 2 or 3 rows, counted from a few chunks where the 2- and
    # 3-chunk calls are regular too (8 rows in 2s, 11 in 3s, 10 keys in 2s), whole where they are not (9 in 2s: a
    # last chunk of one row)
    small = {("self", 2, 8, 40, 8, 8, ""): [2, 1, 3, 2], ("self", 1, 5, 64, 11, 11, "attention"): [1, 2, 1, 2],
             ("cross", 2, 8, 40, 10, 9, ""): [2, 1, 2, 1], ("cross", 2, 8, 64, 9, 10, ""): [1, 1, 2, 2]}  # calls counted
    real_call_ops, looped = host._call_ops, []
    monkeypatch.setattr(host, "_call_ops", lambda *a, **k: looped.append(a[1]) or real_call_ops(*a, **k))
    for shape, calls in small.items():
        n, tk = shape[1] * shape[2], shape[5] if shape[0] == "cross" else shape[4]
        asks = [("split", {"budget_bytes": n * tk * 2 * 2}), ("split", {"budget_bytes": n * tk * 4 * 3}),
                ("subquad", {"query_chunk": 2, "key_chunk": 2}), ("subquad", {"query_chunk": 3, "key_chunk": 2})]
        for (name, options), want in zip(asks, calls):
            looped.clear()
            got = host._looped_ops(name, dict(options), shape, "float16")
            assert got == real_call_ops(name, dict(options), shape, "float16"), (name, options, shape)
            assert len(looped) == want and (want > 1 or looped == [options]), (name, options, shape, looped)
    monkeypatch.undo()
    self_16k = next(s for s in shapes if s[0] == "self" and s[4] == 16384)
    assert counted["split", 28 * 2**20, self_16k] > 2 * counted["split", 64 * 2**20, self_16k]  # 293 chunks, 128
    assert counted["subquad", 700, self_16k] > 5 * counted["subquad", 1024, self_16k]  # 24 x 17 chunks, 16 x 4


def test_a_gpu_of_the_table_is_calibrated_on_stored_runs_of_its_architecture(capsys, tmp_path):
    """--gpu with --results: the kernel times of the runs made on a GPU of the same architecture (an H100 here, named
    as torch names it, for an H200) join the fit, each call's features on the published figures of the GPU that ran
    it, so the H200's prediction is exactly the runs' model on its own figures; a CPU run is never used."""
    _synthetic_run(tmp_path, SIZES, gpu_name="NVIDIA H100 80GB HBM3")
    _synthetic_run(tmp_path, [(64, 64)])  # this CPU's: never used for a GPU
    args = ["plan", "--model", "tiny-sd15", "--size", "128x192", "--backend", "naive", "--dtype", "float32",
            "--results", str(tmp_path), "--host-us-per-op", "10", "--json"]
    assert main([*args, "--gpu", "H200"]) == 0
    out = json.loads(capsys.readouterr().out)[0]
    h200 = gpus.get("H200")
    device = timing.Device(h200["tflops"]["float32"] * 1e12, h200["bytes_per_s"])
    ops = timing.walk("tiny-sd15", 128, 192, 1, "float32")
    want = [sum(TRUE[k] * f[k] for k in TRUE) for f in
            (_features(row, "naive", o, device) for row, o in zip(out["blocks"], ops["calls"]))]
    t = out["totals"]
    assert [b["predicted_time_ms"] for b in out["blocks"]] == pytest.approx(want, rel=1e-6)
    assert t["time_calibrated"] and "kernel times fitted on NVIDIA H100 80GB HBM3 (6 cells)" in t["time_source"]
    assert t["predicted_attention_time_ms"] > t["roofline_attention_time_ms"]


def test_a_runs_gpu_architecture_from_its_environment():
    assert gpus.arch_of({"device_arch": "sm90", "device_name": "NVIDIA A100-SXM4-80GB"}) == "sm90"  # recorded first
    assert gpus.arch_of({"device_name": "NVIDIA A100-SXM4-80GB"}) == "sm80"
    assert gpus.arch_of({"device_name": "NVIDIA GeForce RTX 4090"}) == "sm89"
    assert gpus.arch_of({"device_name": "NVIDIA L40S"}) == "sm89" and gpus.arch_of({"device_name": "NVIDIA L4"})
    assert gpus.arch_of({"device_name": "Intel(R) Xeon(R) Platinum 8481C CPU"}) is None


def test_unknown_gpu_lists_the_known_ones_in_one_line_exit_2(capsys):
    assert main(["plan", "--model", "sd15", "--gpu", "H101"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "H200 (141 GiB)" in err and "RTX-4090 (24 GiB)" in err
    assert main(["plan", "--model", "sd15", "--gpu", "T4", "--dtype", "bfloat16"]) == 2
    assert "no bfloat16 tensor throughput" in capsys.readouterr().err


def test_budget_by_gpu_name_and_units():
    assert parse_bytes("4090", "--budget") == parse_bytes("rtx 4090", "x") == 24 * 2**30
    assert parse_bytes("A100-40GB", "--budget") == 40 * 2**30 and parse_bytes("L4", "x") == 24 * 2**30
    assert parse_bytes("24GB", "x") == 24 * 10**9 and parse_bytes("24GiB", "x") == 24 * 2**30
    assert size_text("24GB") == "24GB = 24,000,000,000 bytes = 22.35 GiB = 24.00 GB"
    assert size_text("4090").startswith("4090 = the RTX-4090's 24 GiB (NVIDIA Ada Lovelace")
    for bad in ("8", 8, "8 GiBs"):
        with pytest.raises(InputError, match="unit|not a size"):
            parse_bytes(bad, "--budget")


def test_a_gpu_named_for_the_budget_sets_its_architecture(capsys):
    """fit --budget 4090: the RTX 4090's kernels (sm89), not the default H100's; --gpu-arch still says otherwise."""
    args = ["fit", "--model", "sd15", "--budget", "4090", "--backend", "sdpa", "--json", "--quiet"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["gpu"].startswith("sm89")
    assert main([*args, "--gpu-arch", "sm80"]) == 0
    assert json.loads(capsys.readouterr().out)["gpu"].startswith("sm80")


def test_fit_budget_8_exits_2_naming_the_unit(capsys):
    assert main(["fit", "--model", "sd15", "--budget", "8"]) == 2
    assert "has no unit (it would mean 8 bytes)" in capsys.readouterr().err


def test_every_gpu_row_has_a_source_and_dense_figures_below_the_sparse_ones():
    for name in gpus.names():
        g = gpus.get(name)
        assert g["source"] and g["memory_gib"] > 0 and g["bytes_per_s"] > 1e11
        assert g["tflops"]["float16"] > g["tflops"]["float32"] > 0
    assert gpus.get("H100")["tflops"]["float16"] == 989.5  # the datasheet's 1,979 is with sparsity


def test_attach_carries_the_prediction_and_ratio():
    cell = {"status": "ok", "forward_time_ms": 30.0, "attention_time_ms": 12.0}
    blocks = [{"time_ms": 4.0}, {"time_ms": 8.0}]
    more = timing.attach(cell, blocks, {"predicted_forward_time_ms": 20.0, "predicted_attention_time_ms": 10.0,
                                        "predicted_call_times_ms": [2.0, 8.0], "roofline_call_times_ms": [1.0, 3.0],
                                        "x": 1})
    assert [b["predicted_time_ratio"] for b in blocks] == [2.0, 1.0] and blocks[0]["predicted_time_ms"] == 2.0
    assert [b["roofline_time_ms"] for b in blocks] == [1.0, 3.0]  # each call's floor: make gpu-check's N8 judges it
    assert more == {"predicted_forward_time_ms": 20.0, "predicted_attention_time_ms": 10.0, "x": 1,
                    "forward_time_ratio": 1.5, "attention_time_ratio": 1.2}


def test_the_sweeps_predicted_total_and_its_end_summary():
    """What a sweep prints before and after, as far as each prediction is evidence: the roofline floor as "at
    least", a calibrated time with its expected (leave-one-out) error, none where that error is over 50%; the cells
    the run holds beside those it runs."""
    import pandas as pd

    floor = {"time_kind": "floor", "time_error_pct": None}
    predicted = {"a": {"predicted_forward_time_ms": 100.0, "time_source": "naive: roofline bound", **floor},
                 "b": {"predicted_forward_time_ms": 300.0, "time_source": "sdpa: calibrated on 2 cells",
                       "time_kind": "calibrated", "time_error_pct": 12.4}}
    text = timing.sweep_text(predicted, 5, cells=3)  # 5 forwards a cell: (100 + 300) ms x 5 = 2 s
    assert text.startswith("predicted: 3 cells, 2 to run (1 recorded without running: unavailable here or over the "
                           "memory budget); at least 2.0 s of forwards (5 a cell: warm-up, timed and probe), 1 of the "
                           "2 cells' forwards by the roofline floor alone, a lower bound; ")
    assert text.endswith("forwards from naive: roofline bound; sdpa: calibrated on 2 cells")
    first = timing.sweep_text({"a": predicted["a"]}, 5)  # a first run on a new machine: floors alone
    assert first.startswith("predicted: 1 cells; at least 0.5 s of forwards (5 a cell: warm-up, timed and probe), "
                            "each the roofline floor, a lower bound") and "forwards from" not in first
    calibrated = {**predicted, "a": {**predicted["a"], "time_kind": "calibrated", "time_error_pct": 7.0}}
    # with what this device's finished runs took beyond their forwards: 2 s + 2 x 3 s + 4 s
    text = timing.sweep_text(calibrated, 5, {"cell_s": 3.0, "run_s": 4.0, "cells": 7, "runs": 2})
    assert text.startswith("predicted: 2 cells; about 12 s in all, expected error up to 12% (leave-one-out): 2.0 s "
                           "of forwards") and "7 cells in 2" in text
    wild = {**calibrated, "c": {**predicted["b"], "time_source": "sliced: calibrated on 3 cells",
                                "time_error_pct": 993}}
    assert timing.sweep_text(wild, 5).split("; ")[-1] == ("no time for sliced (1 cell): its calibration's "
                                                         "leave-one-out error is 993%, over 50%")
    assert "about 2.0 s of forwards" in timing.sweep_text(wild, 5)  # its total leaves sliced's out
    cells = pd.DataFrame([{"status": "ok", "backend": "sdpa", "width": 64, "height": 64, "attention_time_ms": 30.0,
                           "forward_time_ms": 90.0, "predicted_attention_time_ms": 20.0,
                           "predicted_forward_time_ms": 60.0},
                          {"status": "oom", "backend": "naive", "width": 64, "height": 64, "attention_time_ms": None,
                           "forward_time_ms": None, "predicted_attention_time_ms": 5.0,
                           "predicted_forward_time_ms": 9.0}])
    lines = timing.format_versus(cells).splitlines()
    assert len(lines) == 2  # the oom cell has no measurement to set against its prediction
    assert lines[1] == "  sdpa 64x64: attention 20 vs 30 (1.50x), forward 60 vs 90 (1.50x)"  # a run of before
    kinds = pd.concat([cells.iloc[:1].assign(width=w, **kind) for w, kind in (
        (64, floor), (128, {"time_kind": "calibrated", "time_error_pct": 8.2}),
        (256, {"time_kind": "calibrated", "time_error_pct": 993.0}))])
    assert timing.format_versus(kinds).splitlines()[1:] == [
        "  sdpa 64x64: attention at least 20 vs 30 (1.50x the floor), forward at least 60 vs 90 (1.50x the floor)",
        "  sdpa 128x64: attention 20 vs 30 (1.50x), forward 60 vs 90 (1.50x); expected error 8%",
        "  sdpa 256x64: no prediction (its calibration's leave-one-out error 993% is over 50%); measured attention "
        "30, forward 90"]
    two = pd.concat([cells.assign(model="tiny-sd15", settings="{}"),
                     cells.assign(model="tiny-vae", settings='{"controlnet": true}')])
    assert timing.format_versus(two).splitlines()[1:] == [  # where models or settings vary, each row names them
        "  sdpa tiny-sd15 (none)      64x64: attention 20 vs 30 (1.50x), forward 60 vs 90 (1.50x)",
        "  sdpa tiny-vae (controlnet) 64x64: attention 20 vs 30 (1.50x), forward 60 vs 90 (1.50x)"]


def test_a_first_run_on_a_new_machine_prints_its_floors_as_at_least(tmp_path):
    """attnprof run into an empty results folder (no stored run of this device to calibrate on): the start line
    counts the cells it holds and the one it runs (xformers is unavailable on the CPU), its time "at least", the
    roofline floor; the end table sets "at least" against the measurement."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-m", "profiler", "run", "--model", "tiny-sd15", "--size", "64x64",
                           "--backend", "sdpa", "--backend", "xformers", "--device", "cpu", "--dtype", "float32",
                           "--repeats", "3", "--warmup", "0", "--in-process", "--out", str(tmp_path)], cwd=repo,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "attnprof: predicted: 2 cells, 1 to run (1 recorded without running: unavailable here or over the memory " \
           "budget); at least " in done.stderr and ", each the roofline floor, a lower bound" in done.stderr
    row = next(line for line in done.stdout.splitlines() if line.startswith("  sdpa 64x64: "))
    assert row.startswith("  sdpa 64x64: attention at least ") and "the floor), forward at least " in row


def test_calibration_skips_cells_it_cannot_sample(tmp_path):
    """A stored run may hold a plugin's backend that this process has not loaded (tests/faults.py's, in a Ray job
    that did not set ATTNPROF_PLUGINS) or a model file gone since: those cells are left out, never an error that
    stops the sweep before its first cell."""
    from profiler.store import Run

    good = _synthetic_run(tmp_path, [(64, 64), (128, 128)])
    blocks = good.blocks()
    other = Run.create(tmp_path, {"device_peak_flops": PEAKS[0], "device_peak_bytes_per_s": PEAKS[1],
                                  "device_limits": {"key": device_key("cpu", kept=True), "measured_at": "synthetic"}},
                       run_id="plugins")
    for backend, model in (("fault-not-loaded", "tiny-sd15"), ("naive", str(tmp_path / "gone.safetensors"))):
        spec = CellSpec(model, 64, 64, 1, "float32", backend, "cpu")
        rows = [{**r, **spec.as_row()} for r in blocks[blocks["width"] == 64].to_dict("records")]
        other.record({**spec.as_row(), "status": "ok", "attention_time_ms": 1.0, "forward_time_ms": 2.0}, rows)
    calls, cells, _, runs = calibration.samples(tmp_path, device_key("cpu", kept=True))
    assert sorted(runs) == ["plugins", "synthetic"] and len(cells) == 2  # the two good cells only


def test_a_sweeps_preflight_and_time_prediction_share_one_fake_forward_per_shape(monkeypatch):
    """The preflight's trace (every backend of a shape on its calls) counts the ops that the time model reads: two
    shapes, three backends, two forwards in all. Its counts are those of a forward that runs no backend: the
    backends' own ops never leak into a call's projections or the rest."""
    from profiler.execute.sweep import predict
    from profiler.planner import forward

    cells = [CellSpec("tiny-sd15", w, h, 1, "float32", b, "cpu", o) for w, h in ((64, 64), (128, 96))
             for b, o in (("naive", ()), ("sliced", (("slice_size", 2),)), ("sdpa", ()))]
    limits = {"device_limits": {"key": "synthetic"}, "device_peak_flops": PEAKS[0], "device_peak_bytes_per_s": PEAKS[1]}
    traced, real = [], forward.trace
    monkeypatch.setattr(forward, "trace", lambda *a, **k: traced.append(a[:3]) or real(*a, **k))
    forward._WALKS.clear()
    predict(cells)
    times = calibration.predict_cells(cells, limits, Path("no-such-results"))
    assert traced == [("tiny-sd15", 64, 64), ("tiny-sd15", 128, 96)]
    assert len(times) == 6 and all(t["predicted_forward_time_ms"] > t["predicted_attention_time_ms"] > 0
                                   for t in times.values())
    shared = {k: forward._WALKS[k] for k in list(forward._WALKS)}
    forward._WALKS.clear()
    for key, ops in shared.items():  # again, each from a forward of its own with no backend
        alone = timing.walk(*key)
        assert ops["blocks"] == alone["blocks"] and ops["rows"] == alone["rows"]
        assert all(np.array_equal(a, b) for a, b in zip(ops["calls"], alone["calls"]))
        assert np.array_equal(ops["rest"], alone["rest"]) and len(ops["calls"]) == 32


def test_a_prediction_on_kernel_fits_alone_says_why_its_error_is_unknown(tmp_path):
    """A GPU's prediction fitted on its kernel times (planner/kernels.py) with no fit of stored forwards: its error
    is unknown because the kernel fits carry no held-out error, never 'one cell' (it rests on two): plan's time
    lines, plan --pipeline's total, record's line before a generation, the sweep's start line and a run's end table
    say so."""
    import pandas as pd

    from profiler.planner.generation import GenerationSpec, format_generation, predict_generation
    from profiler.record.script import _eta_text
    from tests.test_kernels import _cuda_run

    _cuda_run(tmp_path, [("04ef5bee2e18", 1, 3), ("44683f4ae2f0", 1, 3)])
    c = calibration.calibrate(tmp_path, "NVIDIA H200 | synthetic", write=False)
    t = timing.predict(timing.walked_plan("sdxl-base", 1024, 1024, 1, "float16"), "naive", {}, c["limits"], c,
                       device="cuda")
    assert (t["time_kind"], t["time_error_pct"], t["time_error_why"]) == ("calibrated", None, timing.NO_HELD_OUT)
    said = "expected error unknown: the kernel fits carry no held-out error"
    assert dict(timing.format_times(t))["predicted time"].endswith(f"; {said}")
    g = predict_generation(GenerationSpec("sdxl", 1024, 1024, 4, backend="naive"), c["limits"], c, None, "cuda")
    assert f"predicted total: {g['total_s']:,.2f} s ({said}) (" in format_generation(g)
    assert _eta_text(g) == f"predicted {g['total_ms'] / 1e3:.2f} s ({said})"
    kind = {k: t[k] for k in ("time_kind", "time_error_pct", "time_error_why")}
    line = timing.sweep_text({"a": {"predicted_forward_time_ms": 100.0, "time_source": "naive: kernel times",
                                    **kind}}, 5)
    assert "expected error unknown (the kernel fits carry no held-out error)" in line and "one cell" not in line
    cells = pd.DataFrame([{"status": "ok", "backend": "naive", "width": 64, "height": 64, "attention_time_ms": 30.0,
                           "forward_time_ms": 90.0, "predicted_attention_time_ms": 20.0,
                           "predicted_forward_time_ms": 60.0, **kind}])
    assert timing.format_versus(cells).splitlines()[1].endswith(f"forward 60 vs 90 (1.50x); {said}")


def test_plan_prints_its_times_as_far_as_their_evidence_goes(tmp_path, capsys):
    """attnprof plan (--model and --pipeline) on a machine with no stored run to calibrate on: its forward and its
    generation's total are roofline floors, said 'at least'; a calibration whose leave-one-out error is over 50%
    prints no time, only why (the rule of record's and the sweep's lines: timing.said_time)."""
    from profiler.planner.generation import format_generation

    empty = tmp_path / "results"
    empty.mkdir()
    assert main(["plan", "--model", "tiny-sd15", "--size", "64x64", "--device", "cpu", "--dtype", "float32",
                 "--results", str(empty)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "= forward at least " in out and "; the roofline floor, a lower bound" in out
    assert main(["plan", "--pipeline", "tiny-sd15", "--size", "64x64", "--steps", "2", "--device", "cpu",
                 "--dtype", "float32", "--results", str(empty)]) == 0
    out = capsys.readouterr().out
    assert "predicted total: at least " in out and "the U-Net's time is its roofline floor, a lower bound" in out
    assert [ln for ln in out.splitlines() if ln.startswith("denoise")][0].count("at least") >= 2  # each and total
    t = {"predicted_forward_time_ms": 5.0, "predicted_attention_time_ms": 2.0, "predicted_rest_time_ms": 3.0,
         "time_backend": "sdpa", "time_calibrated": True, "time_source": "calibrated on 3 cells",
         "time_kind": "calibrated", "time_error_pct": 993.0}
    assert dict(timing.format_times(t))["predicted time"] == ("sdpa (calibrated): none: its calibration's "
                                                              "leave-one-out error 993% is over 50%")
    assert dict(timing.format_times({**t, "time_error_pct": 8.2}))["predicted time"].endswith(
        "= forward 5 ms; expected error 8%, leave-one-out")
    denoise = {"part": "denoise", "model": "tiny-sd15", "batch": 2, "forwards": 2, "each_ms": 5.0, "total_ms": 10.0,
               "attention_ms": 4.0, "source": "calibrated on 3 cells", "time_kind": "calibrated",
               "time_error_pct": 993.0, "total_s": 0.01}
    g = {"spec": {"pipeline": "tiny-sd15", "width": 64, "height": 64, "steps": 2, "guidance": 7.5, "cfg": True,
                  "step_batch": 2, "dtype": "float32", "backend": "sdpa"}, "parts": [denoise], "total_ms": 10.0,
         "total_s": 0.01, "attention_ms": 4.0, "attention_share": 0.4, "largest_blocks": [], "device": "cpu"}
    text = format_generation(g)
    assert "predicted total: none: the U-Net's time has no evidence to print it by: its calibration's " \
           "leave-one-out error 993% is over 50%" in text and "10.0 ms" not in text
