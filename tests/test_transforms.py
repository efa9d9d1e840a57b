"""The dashboard's data transforms, without Streamlit: hand-made frames with known answers, and one real run."""
import json
import math
import shutil

import pandas as pd
import pytest

from dashboards import generations as G
from dashboards import transforms as T
from profiler.attention import backends
from profiler.report.frame import normalised
from profiler.store import list_runs

GiB, MiB = 2**30, 2**20


def _cells(rows):
    """Cell rows from (backend, width, height, status, time_ms, peak_bytes[, run_id])."""
    out = []
    for r in rows:
        backend, w, h, status, t, peak = r[:6]
        ok = status == "ok"
        out.append({"run_id": r[6] if len(r) > 6 else "run-a", "model": "sd15", "dtype": "float16", "batch": 1,
                    "width": w, "height": h, "backend": backend, "backend_options": "{}", "cell_id": f"{backend}{w}",
                    "status": status, "error": "" if ok else f"{status} here",
                    "attention_time_ms": t if ok else math.nan, "attention_peak_mem_bytes": peak if ok else math.nan,
                    "forward_time_ms": 3 * t if ok else math.nan, "forward_peak_mem_bytes": peak if ok else math.nan,
                    "max_rel_err": 1e-3 if ok else math.nan, "noisy": False if ok else None})
    return normalised(pd.DataFrame(out))


def _block(block, call_index, level, kind, tokens_q, tokens_k, time_ms=1.0, peak=MiB, cell="c1", status="ok"):
    stage = block.split("_")[0]
    return {"run_id": "run-a", "model": "sdxl", "dtype": "float16", "batch": 1, "width": 1024, "height": 1024,
            "backend": "sdpa", "backend_options": "{}", "cell_id": cell, "call_index": call_index, "block": block,
            "stage": stage, "level": level, "kind": kind, "heads": 10, "head_dim": 64, "tokens_q": tokens_q,
            "tokens_k": tokens_k, "score_elements": 10 * tokens_q * tokens_k, "score_bytes": 20 * tokens_q * tokens_k,
            "flops": 1, "time_ms": time_ms, "peak_mem_bytes": peak, "predicted_peak_bytes": peak // 2,
            "status": status}


def test_backend_label_shows_only_options_that_differ_from_the_defaults():
    assert backends.label("naive", "{}") == "naive"
    assert backends.label("sliced", json.dumps({"slice_size": 1})) == "sliced"  # the default
    assert backends.label("sliced", json.dumps({"slice_size": 4})) == "sliced(slice_size=4)"
    assert backends.label("subquad", json.dumps({"query_chunk": 1024, "key_chunk": 512})) == "subquad(key_chunk=512)"
    assert backends.label("mine", json.dumps({"b": 2, "a": 1})) == "mine(a=1,b=2)"


def test_family_comes_from_the_backend_registry():
    assert [backends.family(n) for n in ("naive", "subquad", "sliced", "sdpa-flash", "xformers", "flex", "sage",
                                  "diffusers:_sage_qk_int8_pv_fp8_cuda", "diffusers:_native_math", "unknown")] == \
           ["materialised", "chunked", "chunked", "fused exact", "fused exact", "fused exact", "fused approximate",
            "fused approximate", "fused exact", "other"]


def test_by_family_groups_in_family_order_and_keeps_the_order_given():
    from profiler.attention import backends

    got = backends.by_family(["sage", "sdpa", "mine", "split", "naive", "diffusers:sage", "flex", "sdpa", "sliced"])
    assert got == [("materialised", ["naive"]), ("chunked", ["split", "sliced"]), ("fused exact", ["sdpa", "flex"]),
                   ("fused approximate", ["sage", "diffusers:sage"]), ("other", ["mine"])]
    assert backends.by_family([]) == []


def test_family_table_puts_the_error_beside_the_time_grouped_by_family():
    cells = pd.DataFrame({"backend": ["sage", "sdpa", "naive", "split"], "status": ["ok", "ok", "ok", "error"],
                          "attention_time_ms": [1.0, 2.0, 9.0, None], "max_rel_err": [3e-2, 1e-3, 0.0, None],
                          "error_ok": [False, True, True, None], "attention_peak_mem_bytes": [1, 2, 3, None],
                          "model": "m", "settings_label": "none", "dtype": "float16", "batch": 1, "size": "64x64",
                          "pixels": 4096, "run_id": "r"})
    cells = cells.assign(family=cells["backend"].map(backends.family), backend_label=cells["backend"])
    table = T.family_table(cells)
    assert table["backend_label"].tolist() == ["naive", "sdpa", "sage"]  # split did not end ok
    assert table["family"].tolist() == ["materialised", "fused exact", "fused approximate"]
    columns = table.columns.tolist()
    assert columns.index("max_rel_err") == columns.index("attention_time_ms") + 1
    assert table.loc[2, "max_rel_err"] == 3e-2 and not table.loc[2, "error_ok"]
    assert T.family_table(cells[cells["status"] != "ok"]).empty


def test_options_sort_sizes_by_pixels_and_backends_in_registry_order():
    df = pd.DataFrame({"size": ["1024x1024", "832x1216", "512x512", "64x64", "512x512"],
                       "backend": ["sdpa", "naive", "subquad", "zzz", "naive"]})
    assert T.options(df, "size") == ["64x64", "512x512", "832x1216", "1024x1024"]  # 1,011,712 < 1,048,576 pixels
    assert T.options(df, "backend") == ["naive", "subquad", "sdpa", "zzz"]
    assert T.options(pd.DataFrame(), "size") == []


def test_filters_intersect_and_an_empty_choice_keeps_everything():
    df = pd.DataFrame({"model": ["a", "a", "b", "b"], "backend": ["x", "y", "x", "y"]})
    assert len(T.apply_filters(df, {"model": [], "backend": []})) == 4
    assert T.apply_filters(df, {"model": ["b"], "backend": ["x", "z"]}).index.tolist() == [2]
    assert T.apply_filters(df, {"model": ["a"], "dtype": ["float16"]}).index.tolist() == [0, 1]  # no such column


def test_compare_ratios_are_against_the_baseline_of_the_same_run_and_size():
    cells = _cells([("naive", 512, 512, "ok", 20.0, 4 * GiB), ("sdpa", 512, 512, "ok", 5.0, GiB),
                    ("subquad", 512, 512, "ok", 30.0, 2 * GiB),
                    ("naive", 1024, 1024, "oom", 0, 0), ("sdpa", 1024, 1024, "ok", 40.0, 3 * GiB),
                    ("naive", 512, 512, "ok", 10.0, GiB, "run-b"), ("sdpa", 512, 512, "ok", 8.0, GiB, "run-b")])
    out = T.compare_table(cells, "naive").set_index(["run_id", "size", "backend_label"])
    assert out.loc[("run-a", "512x512", "sdpa"), "time_ratio"] == pytest.approx(0.25)
    assert out.loc[("run-a", "512x512", "sdpa"), "peak_ratio"] == pytest.approx(0.25)
    assert out.loc[("run-a", "512x512", "subquad"), "time_ratio"] == pytest.approx(1.5)
    assert out.loc[("run-a", "512x512", "naive"), "time_ratio"] == pytest.approx(1.0)
    assert out.loc[("run-b", "512x512", "sdpa"), "time_ratio"] == pytest.approx(0.8)  # run-b's own baseline
    assert math.isnan(out.loc[("run-a", "1024x1024", "sdpa"), "time_ratio"])  # the baseline ran out of memory
    assert out.loc[("run-a", "512x512", "sdpa"), "family"] == "fused exact"


def test_largest_ok_size_and_the_first_failure_above_it():
    cells = _cells([("naive", 64, 64, "ok", 1, 1), ("naive", 1024, 1024, "skipped", 0, 0),
                    ("naive", 832, 1216, "oom", 0, 0), ("naive", 512, 512, "ok", 1, 1),
                    ("sdpa", 512, 512, "ok", 1, 1), ("sdpa", 832, 1216, "ok", 1, 1),
                    ("sdpa", 64, 64, "error", 0, 0),
                    ("xformers", 64, 64, "unavailable", 0, 0), ("xformers", 512, 512, "unavailable", 0, 0)])
    out = T.largest_ok(cells).set_index("backend_label")
    assert out.loc["naive", ["largest_ok_size", "failed_above"]].tolist() == ["512x512", "oom at 832x1216"]
    assert out.loc["sdpa", ["largest_ok_size", "failed_above"]].tolist() == ["832x1216", ""]  # a failure below
    assert out.loc["xformers", ["largest_ok_size", "largest_ok_pixels", "failed_above"]].tolist() == \
           ["none", 0, "unavailable at 64x64"]
    assert out.loc["naive", "family"] == "materialised" and out.loc["naive", "sizes_tried"] == 4


def test_unet_layout_places_blocks_on_the_u():
    rows = [_block("down_blocks.1.attentions.0.transformer_blocks.0.attn1", 0, 1, "self", 1024, 1024),
            _block("down_blocks.1.attentions.0.transformer_blocks.0.attn2", 1, 1, "cross", 1024, 77),
            _block("down_blocks.1.attentions.0.transformer_blocks.1.attn1", 2, 1, "self", 1024, 1024),
            _block("down_blocks.1.attentions.1.transformer_blocks.0.attn1", 3, 1, "self", 1024, 1024),
            _block("mid_block.attentions.0.transformer_blocks.0.attn1", 4, 2, "self", 256, 256),
            _block("up_blocks.0.attentions.2.transformer_blocks.9.attn2", 5, 2, "cross", 256, 77),
            _block("up_blocks.1.attentions.0.transformer_blocks.0.attn1", 6, 1, "self", 1024, 1024)]
    out = T.unet_layout(pd.DataFrame(rows).sample(frac=1, random_state=0))  # call order restored
    assert out["column"].tolist() == [0, 0, 0, 1, 2, 3, 4]
    assert out["layer"].tolist() == [0, 0, 1, 0, 0, 9, 0]
    assert out["group_label"].tolist() == ["down 1.0"] * 3 + ["down 1.1", "mid", "up 0.2", "up 1.0"]
    assert out["level_label"].iloc[0] == "level 1: 1024 tokens"
    assert out["level_label"].iloc[5] == "level 2: 256 tokens"
    assert out["tokens"].iloc[1] == "1024 x 77"
    assert out["score_table"].iloc[0] == "20.0 MiB"  # 20 bytes x 1024 x 1024
    with pytest.raises(ValueError, match="one cell"):
        T.unet_layout(pd.DataFrame(rows[:1] + [_block("x.attn1", 0, 0, "self", 1, 1, cell="c2")]))


def test_the_unet_title_names_a_controlnet_and_image_tokens_only_where_the_cell_has_them():
    plain = pd.DataFrame({"block": ["down_blocks.0.attentions.0.transformer_blocks.0.attn1",
                                    "down_blocks.0.attentions.0.transformer_blocks.0.attn2"],
                          "kind": ["self", "cross"]})
    assert T.unet_title(plain) == "The U-Net: down, mid and up by level; each tile one attention call (self | cross)"
    both = pd.concat([plain, pd.DataFrame({
        "block": ["controlnet.down_blocks.0.attentions.0.transformer_blocks.0.attn1",
                  "down_blocks.0.attentions.0.transformer_blocks.0.attn2.image"], "kind": ["self", "image"]})])
    assert T.unet_title(both) == ("The U-Net and its ControlNet: down, mid and up by level; each tile one attention "
                                  "call (self | cross | image: IP-Adapter's image tokens)")
    vae = pd.DataFrame({"block": ["decoder.mid_block.attentions.0"], "kind": ["self"]})
    assert T.unet_title(vae).startswith("The VAE: ")


def test_panels_by_model_and_settings_lines_by_backend_split_by_run_only_where_runs_overlap():
    rows = [{"model": m, "settings_label": st, "dtype": "float32", "batch": 1, "aspect": "1:1", "backend_label": b,
             "run_id": r, "size": f"{w}x{w}", "pixels": w * w}
            for m, st in (("tiny-sd15", "none"), ("tiny-sd15", "controlnet"), ("tiny-vae", "none"))
            for b in ("naive", "sdpa") for r, w in (("r1", 64), ("r2", 128))]
    apart, panels, legend = T.panelled(pd.DataFrame(rows))
    assert (panels, legend) == ("model, settings", "backend")  # each run holds its own size: one line through both
    assert sorted(set(apart["panel"])) == ["tiny-sd15 (controlnet)", "tiny-sd15 (none)", "tiny-vae (none)"]
    assert sorted(set(apart["label"])) == ["naive", "sdpa"]
    again = pd.DataFrame(rows + [{**r, "run_id": "r3"} for r in rows])  # a third run repeating both sizes
    overlapping, _, legend = T.panelled(again)
    assert legend == "backend, run" and "sdpa r3" in set(overlapping["label"])
    ticks = T.size_ticks(pd.DataFrame({"pixels": [16384, 4096, 4096, 524288, 524288],
                                       "size": ["128x128", "64x64", "64x64", "512x1024", "1024x512"]}))
    assert ticks["values"] == [4096, 16384, 524288]
    assert ticks["labelExpr"] == ("datum.value == 4096 ? '64x64' : datum.value == 16384 ? '128x128' : "
                                  "datum.value == 524288 ? '512x1024 / 1024x512' : ''")


def test_scaling_table_sums_time_and_takes_the_largest_call():
    rows = [_block("a.attn1", 0, 0, "self", 64, 64, time_ms=1.5, peak=3 * MiB),
            _block("a.attn2", 1, 0, "cross", 64, 77, time_ms=0.5, peak=5 * MiB),
            _block("b.attn1", 2, 1, "self", 16, 16, time_ms=0.25, peak=MiB)]
    big = [dict(r, width=2048, height=2048, cell_id="c2", tokens_q=4 * r["tokens_q"]) for r in rows]
    failed = [dict(rows[0], cell_id="c3", width=4096, height=4096, status="oom")]
    out = T.scaling_table(normalised(pd.DataFrame(rows + big + failed)))
    assert out["size"].tolist() == ["1024x1024", "2048x2048"]  # the failed cell is left out
    first = out.iloc[0]
    assert first["attention_time_ms"] == pytest.approx(2.25)
    assert (first["tokens_max"], first["peak_mem_bytes"], first["predicted_peak_bytes"]) == (64, 5 * MiB, 5 * MiB // 2)
    assert first["score_table_max_bytes"] == 20 * 64 * 77
    assert out.iloc[1]["tokens_max"] == 256
    long = T.scaling_long(out)
    assert len(long) == 4 and sorted(long["source"].unique()) == ["measured", "predicted"]
    assert long[(long["size"] == "1024x1024") & (long["source"] == "predicted")]["peak_bytes"].item() == 5 * MiB // 2


def test_planner_table_judges_each_backends_whole_forward_against_the_budget():
    traced = {"weights_bytes": 2000, "rows": [
        {"block": "a.attn1", "traced_peak_bytes": {"naive": 500, "sdpa": 40}},
        {"block": "b.attn1", "traced_peak_bytes": {"naive": 900, "sdpa": 30}}],
        "backends": {"naive": {"predicted_forward_peak_bytes": 3000, "transient_peak_bytes": 950, "how": "processor"},
                     "sdpa": {"predicted_forward_peak_bytes": 2100, "transient_peak_bytes": 90, "how": "flash"}}}
    out = T.planner_table(traced, budget_bytes=3000).set_index("backend")
    assert out.loc["naive", "fits"] and out.loc["naive", "headroom_bytes"] == 0
    assert out.loc["naive", "largest_call"] == "b.attn1" and out.loc["sdpa", "largest_call"] == "a.attn1"
    assert out.loc["sdpa", "how"] == "traced: aten's flash attention kernel on fake CUDA tensors"
    tight = T.planner_table(traced, budget_bytes=2999).set_index("backend")
    assert not tight.loc["naive", "fits"] and tight.loc["sdpa", "fits"]
    fits = [{"budget_bytes": 8 * GiB, "backends": [{"backend": "naive", "largest": [512, 512]},
                                                    {"backend": "sdpa", "largest": None}]},
            {"budget_bytes": 24 * GiB, "backends": [{"backend": "naive", "largest": [1024, 1024]},
                                                     {"backend": "sdpa", "largest": [2048, 2048]}]}]
    assert T.largest_table(fits).to_dict("records") == [
        {"backend": "naive", "8 GiB": "512x512", "24 GiB": "1024x1024"},
        {"backend": "sdpa", "8 GiB": "none", "24 GiB": "2048x2048"}]


def test_units_for_people():
    assert [T.human_ms(v) for v in (0.43612, 12.3456, 1234.6, math.nan, None)] == \
           ["0.436 ms", "12.35 ms", "1,235 ms", "-", "-"]
    assert T.mem_unit(GiB - 1) == ("MiB", MiB) and T.mem_unit(GiB) == ("GiB", GiB) and T.mem_unit(math.nan)[0] == "MiB"
    mem, unit = T.with_mem_unit(pd.DataFrame({"peak_bytes": [GiB, 3 * GiB], "need_bytes": [MiB, 512 * MiB]}),
                                ["peak_bytes", "need_bytes"])
    assert unit == "GiB" and mem["peak_GiB"].tolist() == [1.0, 3.0] and mem["need_GiB"].tolist() == [2**-10, 0.5]
    assert T.with_mem_unit(pd.DataFrame({"p_bytes": [MiB, 3 * MiB]}), ["p_bytes"])[0]["p_MiB"].tolist() == [1.0, 3.0]
    raw = pd.DataFrame({"backend": ["a", "b"], "attention_peak_mem_bytes": [3 * GiB, 1536 * 1024],
                        "attention_time_ms": [0.5, 250.0], "time_ratio": [0.25, math.nan]})
    shown = T.display(raw)
    assert list(shown.columns) == ["backend", "attention peak mem", "attention time", "time_ratio"]
    assert shown["attention peak mem"].tolist() == ["3.0 GiB", "1.5 MiB"]
    assert shown["attention time"].tolist() == ["0.500 ms", "250 ms"]
    assert shown["time_ratio"].tolist() == ["0.25x", "-"]
    floats = pd.DataFrame({"attention_achieved_flops_per_s": [1003951230.8199871, math.nan],
                           "max_rel_err": [1.0729395843944966e-06, None], "compile_s": [None, 1.5],
                           "attention_pct_of_peak": [12.345, 0.5], "bytes_moved": [1024, 3 * MiB],
                           "flops": [2e12, 5], "noisy": [True, False]})
    assert T.display(floats).to_dict("list") == {
        "attention_achieved_flops_per_s": ["1.00GFLOP/s", "-"], "max_rel_err": ["1.07e-06", "-"],
        "compile": ["-", "1.50 s"], "attention_pct_of_peak": ["12.3%", "0.5%"], "bytes_moved": ["1.0 KiB", "3.0 MiB"],
        "flops": ["2.00TFLOP", "5FLOP"], "noisy": [True, False]}  # the raw floats, with their units
    assert raw["attention_peak_mem_bytes"].tolist() == [3 * GiB, 1536 * 1024]  # the raw table is untouched


def test_index_of_an_empty_or_missing_folder(tmp_path):
    assert T.load_index(tmp_path).empty and T.load_index(tmp_path / "nope").empty
    assert "warning" in T.load_index(tmp_path).columns


def test_index_and_run_from_a_real_run(dashboard_results):
    index = T.load_index(dashboard_results)
    assert len(index) == 1
    row = index.iloc[0]
    assert (row["cells"], row["ok"], row["skipped"], row["unavailable"], row["pending"]) == (8, 5, 1, 2, 0)
    assert row["readable"] and row["warning"] == "" and row["models"] == "tiny-sd15"
    assert row["backends"] == "naive, sdpa, subquad, xformers" and row["versions"].startswith("torch ")
    cells, blocks = T.load_run(list_runs(dashboard_results)[0])
    assert "time_samples_ms" not in blocks and len(blocks) == 5 * 32  # SD1.5 topology: 32 calls per forward
    assert set(blocks["family"]) == {"materialised", "fused exact", "chunked"}
    scale = T.scaling_table(blocks).set_index(["backend_label", "size"])
    assert scale.loc[("sdpa", "128x128"), "tokens_max"] == 4 * scale.loc[("sdpa", "64x64"), "tokens_max"] == 256
    finest = blocks[(blocks["kind"] == "self") & (blocks["level"] == 0) & (blocks["backend"] == "sdpa")]
    by_size = finest.groupby("size")["score_bytes"].max()
    assert by_size["128x128"] == 16 * by_size["64x64"]  # doubling width and height: each score table x16
    largest = T.largest_ok(cells).set_index("backend_label")
    assert largest.loc["naive", ["largest_ok_size", "failed_above"]].tolist() == ["64x64", "skipped at 128x128"]
    assert largest.loc["subquad", "largest_ok_size"] == "128x128"


def test_index_warns_about_corrupt_and_unfinished_runs(dashboard_results, tmp_path):
    good = list_runs(dashboard_results)[0]
    for name in ("a-good", "b-bad-manifest", "c-bad-blocks", "d-unfinished"):
        shutil.copytree(good, tmp_path / name)
    (tmp_path / "b-bad-manifest" / "manifest.json").write_text('{"run_id": ')
    blocks = tmp_path / "c-bad-blocks" / "blocks.parquet"
    blocks.write_bytes(blocks.read_bytes()[:300])
    manifest = json.loads((tmp_path / "d-unfinished" / "manifest.json").read_text())
    (tmp_path / "d-unfinished" / "manifest.json").write_text(json.dumps({**manifest, "ended_at": None}))
    for name in ("cells.parquet", "blocks.parquet"):
        (tmp_path / "d-unfinished" / name).unlink()
    index = T.load_index(tmp_path).set_index("run_id")
    assert index["readable"].to_dict() == {"a-good": True, "b-bad-manifest": False, "c-bad-blocks": False,
                                           "d-unfinished": True}
    assert index.loc["a-good", "warning"] == ""
    assert index.loc["b-bad-manifest", "warning"].startswith("unreadable: JSONDecodeError")
    assert index.loc["c-bad-blocks", "warning"].startswith("unreadable: ArrowInvalid")
    assert index.loc["d-unfinished", "warning"] == "unfinished: 0 of 8 cells recorded (running, or stopped)"
    assert index.loc["d-unfinished", "pending"] == 8
    with pytest.raises(ValueError):
        T.load_run(tmp_path / "c-bad-blocks")


def test_runs_side_by_side_by_an_environment_field_and_the_cells_own_threads():
    envs = pd.DataFrame([{"run_id": "a", "torch": "2.13.0", "torch_threads": "2", "python": "3.11"},
                         {"run_id": "b", "torch": "2.13.0", "torch_threads": "2", "python": "3.12"}])
    assert T.differing(envs) == ["python"]
    cells = pd.DataFrame({"run_id": ["a", "a", "b"], "backend_label": ["naive", "sdpa", "sdpa"],
                          "torch_threads": [2.0, float("nan"), 1.0]})
    assert T.with_series(cells, envs, "python")["series"].tolist() == ["python=3.11", "python=3.11", "python=3.12"]
    # a Ray CPU worker measured b's cell with one thread though b's driver had two; an old cell has no value
    assert T.with_series(cells, envs, "torch_threads")["series"].tolist() == [
        "torch_threads=2", "torch_threads=2", "torch_threads=1"]
    assert T.with_series(cells, envs, "run")["series"].tolist() == ["a", "a", "b"]


def test_best_backend_per_device_and_size_within_a_budget():
    MiB = 2**20

    def cell(device, size, backend, ms, peak, forward, status="ok"):
        return {"device_name": device, "model": "sd15", "settings_label": "none", "dtype": "float16", "batch": 1,
                "size": f"{size}x{size}", "pixels": size * size, "backend_label": backend, "status": status,
                "attention_time_ms": ms, "attention_peak_mem_bytes": peak, "forward_peak_total_bytes": forward}

    cells = pd.DataFrame([cell("cpu-x", 512, "naive", 100.0, 900 * MiB, 1000 * MiB),
                          cell("cpu-x", 512, "sdpa", 40.0, 30 * MiB, 300 * MiB),
                          cell("cpu-x", 512, "split", 60.0, 20 * MiB, 200 * MiB),
                          cell("cpu-x", 512, "sliced", 1.0, 1.0, None, status="oom"),
                          cell("cpu-x", 1024, "naive", 900.0, 9000 * MiB, 9e9),
                          cell("gpu-y", 512, "naive", 5.0, 900 * MiB, 1000 * MiB),
                          cell("gpu-y", 512, "sdpa", 6.0, 30 * MiB, 300 * MiB)])
    best = T.best_backends(cells, 500 * MiB).set_index(["device_name", "size"])
    assert best.loc[("cpu-x", "512x512"), ["fastest", "smallest", "fastest_that_fits"]].tolist() == [
        "sdpa", "split", "sdpa"]  # the oom cell, though "fastest", is not a candidate
    assert best.loc[("gpu-y", "512x512"), ["fastest", "fastest_that_fits"]].tolist() == ["naive", "sdpa"]
    assert best.loc[("cpu-x", "1024x1024"), "fastest_that_fits"] == "none"


def test_runs_sharing_an_environment_value_keep_their_own_series():
    envs = pd.DataFrame([{"run_id": r, "python": v} for r, v in (("a", "3.11"), ("b", "3.11"), ("c", "3.12"))])
    cells = pd.DataFrame({"run_id": ["a", "b", "b", "c"], "backend_label": ["sdpa"] * 4})
    assert T.with_series(cells, envs, "python")["series"].tolist() == [
        "python=3.11 (a)", "python=3.11 (b)", "python=3.11 (b)", "python=3.12"]


def test_a_label_names_what_varies_and_only_that():
    cells = normalised(pd.DataFrame({
        "width": [512, 512, 832, 1216], "height": [512, 512, 1216, 832], "backend": ["sliced"] * 4,
        "backend_options": ['{"slice_size": 1}', '{"slice_size": 4}', "{}", "{}"], "model": ["sd15"] * 4,
        "dtype": ["float16", "float16", "float16", "bfloat16"], "batch": [1, 1, 2, 2], "run_id": ["r"] * 4}))
    assert cells["aspect"].tolist() == ["1:1", "1:1", "13:19", "19:13"]
    out, title = T.labelled(cells)
    assert title == "backend, dtype, batch, aspect"
    assert out["label"].tolist() == ["sliced float16 batch 1 aspect 1:1", "sliced(slice_size=4) float16 batch 1 "
                                     "aspect 1:1", "sliced float16 batch 2 aspect 13:19",
                                     "sliced bfloat16 batch 2 aspect 19:13"]
    out, title = T.labelled(cells.iloc[:1])
    assert (title, out["label"].tolist()) == ("backend", ["sliced"])  # nothing varies: the backend alone
    shapes = T.shape_table(cells.assign(tokens_max=[4096, 4096, 2 * 4096, 2 * 4096]), "tokens_max",
                           ("model", "aspect"))
    assert shapes["size"].tolist() == ["512x512", "832x1216", "1216x832"]  # once per shape, whatever the backend


def test_the_queue_pages_sweep_without_dtypes_takes_each_devices_own():
    """The Queue page's default (no dtype chosen) leaves the key out: float32 cells on the CPU, where float16 is
    emulated, and float16 on CUDA; a chosen dtype is written as chosen."""
    from profiler.execute.grid import loads

    text = T.sweep_yaml(["tiny-sd15"], "64x64", "1", [], ["sdpa"], "cpu")
    assert "dtypes" not in text
    assert [c.dtype for c in loads(text, "queued").cells()] == ["float32"]
    assert [c.dtype for c in loads(text.replace("device: cpu", "device: cuda"), "queued").cells("cuda")] == ["float16"]
    chosen = T.sweep_yaml(["tiny-sd15"], "64x64", "1", ["bfloat16"], ["sdpa"], "cpu")
    assert [c.dtype for c in loads(chosen, "queued").cells()] == ["bfloat16"]


def test_a_row_recorded_before_upcast_existed_is_told_by_its_score_bytes():
    """Rows without the upcast field: 4-byte scores of a 2-byte dtype were upcast (upcast_attention), scores of the
    dtype's own size were not; the dtype sizes are read without torch (spec.ITEMSIZE), as torch says them."""
    import torch

    from profiler.report.frame import upcast
    from profiler.spec import DTYPES, ITEMSIZE

    assert ITEMSIZE == {d: getattr(torch, d).itemsize for d in DTYPES}
    old = pd.DataFrame({"dtype": ["float16", "fp16", "bfloat16", "float32"], "score_elements": [10, 10, 10, 10],
                        "score_bytes": [40, 20, 40, 40]})
    assert upcast(old).tolist() == ["attention", "", "attention", ""]
    kept = old.assign(upcast=["softmax", None, "", "attention"])  # recorded where recorded, told where not
    assert upcast(kept).tolist() == ["softmax", "", "", "attention"]


# ---- recorded generations (conftest's record_results: the tiny SD 1.5 pipeline, its CLIP text encoder real)

def _recorded(record_results, name: str) -> tuple[dict, pd.DataFrame, pd.DataFrame]:
    """(the cell, its blocks, its calls) of one of the record runs."""
    cells, blocks = T.load_run(record_results["root"] / record_results[name])
    cell = cells.iloc[0].to_dict()
    return cell, blocks, G.load_calls(record_results["root"] / record_results[name], cell["cell_id"])


def test_the_runs_index_names_a_recorded_runs_model_backend_and_kind(record_results):
    index = T.load_index(record_results["root"]).set_index("run_id")
    loaded, sliced = index.loc[record_results["loaded"]], index.loc[record_results["sliced"]]
    assert (loaded["kind"], loaded["backends"], sliced["backends"]) == ("record", "loaded", "sliced")
    assert loaded["models"] == sliced["models"] == "StableDiffusionPipeline UNet2DConditionModel 7f3af43b"


def test_a_recorded_generation_per_component_step_and_generation(record_results):
    """Two pipeline calls of 3 steps: per component its forwards (the U-Net's 6, the text encoder's 4: the prompt's
    and the negative one's in each), attention's share of it; per step the U-Net's 32 calls; per generation 101
    calls (32 x 3, CLIP's 2 layers x 2, the VAE's 1); the costliest blocks in order, their shares of every call."""
    from profiler.fmt import generations_text

    cell, _, calls = _recorded(record_results, "loaded")
    said = generations_text([3, 3], list(cell["generation_times_s"]))
    assert G.generation_line(cell).startswith(f"StableDiffusionPipeline, loaded (AttnProcessor2_0 x34): {said} at "
                                              "64x64, batch 2, DDIMScheduler")
    other = {**cell, "generation_steps": [3, 2]}  # fmt's words, never '2 generations, 3 steps' for 3 and 2
    assert "2 generations (3 and 2 steps), " in G.generation_line(other)
    comps = G.component_table(cell).set_index("component")
    assert comps["forwards"].to_dict() == {"vae": 2, "text_encoder": 4, "unet": 6}
    assert comps["attention_calls"].to_dict() == {"vae": 2, "text_encoder": 8, "unet": 192}
    unet = comps.loc["unet"]
    assert unet["attention_ms"] == pytest.approx(calls[calls["component"] == "unet"]["time_ms"].sum())
    assert unet["attention_of_component_pct"] == pytest.approx(100 * unet["attention_ms"] / unet["time_ms"])
    assert unet["time_share_pct"] == pytest.approx(100 * unet["time_ms"] / (cell["generation_s"] * 1e3))
    steps = G.step_table(calls, "a")
    assert steps[["generation", "step"]].values.tolist() == [[g, s] for g in (0, 1) for s in range(3)]
    assert set(steps["component"]) == {"unet"} and set(steps["calls"]) == {32}
    assert steps["attention_ms"].sum() == pytest.approx(unet["attention_ms"])
    per = G.generations_table(calls, cell)
    assert per["generation"].tolist() == [0, 1] and per["steps"].tolist() == [3, 3] and per["calls"].tolist() == \
        [101, 101]
    assert (per["text_encoder_attention_ms"] > 0).all() and per["attention_ms"].sum() == pytest.approx(
        calls["time_ms"].sum())
    top = G.costliest_blocks(calls, "a", top=5)
    # a block's calls over the two generations: a U-Net block's 6 (3 steps), a CLIP layer's 4 (2 forwards), the VAE's 2
    assert len(top) == 5 and top["total_ms"].is_monotonic_decreasing and set(top["calls"]) <= {6, 4, 2}
    assert top["share_of_attention_pct"].iloc[0] == pytest.approx(100 * top["total_ms"].iloc[0] /
                                                                  calls["time_ms"].sum())


def test_two_recorded_generations_side_by_side(record_results):
    a = G.component_table(_recorded(record_results, "loaded")[0])
    b = G.component_table(_recorded(record_results, "sliced")[0])
    both = G.components_side_by_side(a, b).set_index("component")
    assert list(both.index) == ["vae", "text_encoder", "unet"]
    assert both.loc["unet", "time_ratio"] == pytest.approx(b.set_index("component").loc["unet", "time_ms"] /
                                                           a.set_index("component").loc["unet", "time_ms"])


def test_a_component_whose_attention_is_not_recorded_says_so_never_zero():
    """A compiled U-Net (profile: its calls not recorded one by one) stored as NaN: the table says 'not recorded
    (Attention x32)', its attention figures NaN; a component without attention keeps its 0."""
    comps = json.dumps([{"component": "unet", "class": "OptimizedModule", "forwards": 3, "time_ms": 300.0,
                         "attention_calls": math.nan, "attention_ms": math.nan, "not_recorded": "Attention x32"},
                        {"component": "safety_checker", "class": "Checker", "forwards": 1, "time_ms": 5.0,
                         "attention_calls": 0, "attention_ms": 0.0, "not_recorded": ""}])
    cell = {"generation_s": 1.0, "components": comps, "backend_label": "loaded", "size": "64x64", "run_id": "r"}
    table = G.component_table(cell).set_index("component")
    assert table.loc["unet", "attention_calls"] == "not recorded (Attention x32)"
    assert math.isnan(table.loc["unet", "attention_ms"]) and math.isnan(table.loc["unet", "attention_share_pct"])
    assert table.loc["safety_checker", "attention_calls"] == 0 and table.loc["safety_checker", "attention_ms"] == 0
    shown = T.display(table.reset_index())
    assert shown.set_index("component").loc["unet", "attention"] == "-"


def test_each_component_of_a_recorded_cell_is_drawn_apart(record_results):
    """The VAE's mid-block call (its own level's 64 tokens) and the text encoder's 77-token calls are never placed
    in the U-Net's level rows: each component its own layout, the U-Net's rows its own tokens; the text encoder's
    calls are no U (bars instead)."""
    cell, blocks, _ = _recorded(record_results, "loaded")
    parts = dict(T.by_component(blocks))
    assert list(parts) == ["unet", "text_encoder", "vae"]
    unet = T.unet_layout(parts["unet"])
    assert set(unet["level_label"]) == {"level 0: 64 tokens", "level 1: 16 tokens", "level 2: 4 tokens",
                                        "level 3: 1 tokens"} and unet["block"].str.match(r"(down|mid|up)_").all()
    vae = T.unet_layout(parts["vae"])  # the VAE's levels are its own: its mid block at its level 3, 64 tokens
    assert vae[["block", "level_label"]].values.tolist() == [["vae.decoder.mid_block.attentions.0", "level 3: 64 tokens"]]
    assert T.mapped(unet) and T.mapped(T.unet_layout(parts["vae"])) and not T.mapped(T.unet_layout(
        parts["text_encoder"]))
    assert T.component_title("vae", T.unet_layout(parts["vae"])).startswith("The VAE: its mid block's attention")
    assert T.component_title("text_encoder", T.unet_layout(parts["text_encoder"])) == \
        "The text_encoder: its attention calls in order, one bar each (4 heads of 8; 77 tokens)"
    sweep = blocks.drop(columns=["component"])
    assert [c for c, _ in T.by_component(sweep)] == [""]
    cells = T.load_run(record_results["root"] / record_results["loaded"])[0]
    assert T.no_peaks_reason(cells).startswith("No peak memory to draw: these are generations recorded on the CPU")
    assert T.no_peaks_reason(cells.assign(attention_peak_mem_bytes=1.0)) == ""
    scale = T.scaling_table(blocks)  # the U-Net's calls only: no text encoder's 77 tokens as its finest level
    assert scale["tokens_max"].tolist() == [64]


def test_a_diffs_verdict_comes_first():
    matched = pd.DataFrame([{"model": "m", "settings": "{}", "width": 64, "height": 64, "batch": 1, "dtype": "f",
                             "backend": "sdpa", "backend_options": "{}", "time_a_ms": 1.0, "time_ratio": 1.0,
                             "time_verdict": "within noise", "verdict": "within noise", "note": ""}])
    assert list(T.verdicts_first(matched).columns)[:3] == ["verdict", "backend", "width"]
    assert set(T.verdicts_first(matched).columns) == set(matched.columns)


def test_a_recorded_generations_attention_is_told_as_its_core_and_its_projections(record_results):
    """profile on the CPU splits each call's time into its attention core's and its projections' (the hooks on
    to_q, to_k, to_v, to_out[0], CLIP's q/k/v/out_proj): the Generation page's and the report's component,
    per-generation and costliest-block tables and the cells table show the two, adding up to the attention time; a
    run stored before the split shows '-' in their place, never 0."""
    from dashboards.report import render

    cell, _, calls = _recorded(record_results, "loaded")
    comps = G.component_table(cell).set_index("component")
    for name in ("unet", "text_encoder", "vae"):
        core, proj = comps.loc[name, "attention_core_ms"], comps.loc[name, "attention_projections_ms"]
        assert core > 0 and proj > 0 and core + proj == pytest.approx(comps.loc[name, "attention_ms"])
    per = G.generations_table(calls, cell)
    assert (per["core_ms"] + per["projections_ms"]).tolist() == pytest.approx(per["attention_ms"].tolist())
    top = G.costliest_blocks(calls, "a", top=5)
    assert (top["core_ms"] + top["projections_ms"]).tolist() == pytest.approx(top["total_ms"].tolist())
    assert top["projections_ms"].gt(0).all() and (top["projections_ms"] < top["total_ms"]).all()
    cells = T.load_run(record_results["root"] / record_results["loaded"])[0]
    table = T.cells_table(cells)
    assert table["attention_core_ms"].tolist() == cells["attention_kernel_ms"].tolist()
    assert table["attention_projections_ms"].tolist() == cells["attention_proj_ms"].tolist()
    assert table["attention_core_ms"].iloc[0] > 0 and table["attention_projections_ms"].iloc[0] > 0
    shown = T.display(table)
    assert {"attention core", "attention projections"} <= set(shown.columns)
    old = T.display(T.cells_table(cells.drop(columns=["attention_kernel_ms", "attention_proj_ms"])))
    assert old[["attention core", "attention projections"]].values.tolist() == [["-", "-"]]
    unsplit = json.dumps([{k: v for k, v in r.items() if k not in ("attention_core_ms", "attention_proj_ms")}
                          for r in json.loads(cell["components"])])
    before = T.display(G.component_table({**cell, "components": unsplit})).set_index("component")
    assert before.loc["unet", "attention core"] == before.loc["unet", "attention projections"] == "-"
    assert before.loc["unet", "attention"] != "-"
    gone = calls.drop(columns=["attn_kernel_ms", "proj_kernel_ms"])
    assert T.display(G.costliest_blocks(gone, "a"))[["core", "projections"]].eq("-").all().all()
    html = render([record_results["root"] / record_results["loaded"]])
    assert "<th>attention core</th>" in html and "<th>attention projections</th>" in html
    assert "<th>core</th>" in html and "<th>projections</th>" in html and "q/k/v and output projections" in html
