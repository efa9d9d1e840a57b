"""A run's headline findings in a few plain sentences, computed from its cells and block rows: what `attnprof show`,
the end of a sweep (make profile) and the dashboard's Runs and Run pages say first.

Per shape (size, and model / dtype / batch where the run has several): the fastest backend that ran and the one
that needed the least memory, each against naive; per backend, where it stopped fitting (oom or skipped) and up to
which size it ran; the largest call; and the cells whose figures are doubtful (error over the dtype's tolerance,
noisy timings), with the cells that did not run at all."""
from __future__ import annotations

from functools import partial

import pandas as pd

from ..fmt import human_bytes, human_ms
from .compare import IMPROVEMENT, REGRESSION, SAME
from .frame import NO_SETTINGS

_ms = partial(human_ms, small=2)  # a finding's time: '0.40 ms', '12.34 ms', '1,234 ms'

SHAPE = ["model", "settings", "settings_label", "dtype", "batch", "width", "height"]  # settings_label: settings' words
STOPPED = ("oom", "skipped")


def _varying(cells: pd.DataFrame) -> list[str]:
    return [c for c in ("model", "settings", "dtype", "batch") if c in cells and cells[c].nunique() > 1]


def _qualified(text: str, key: dict, varying: list[str]) -> str:
    """text with what tells apart the run's cells of one size: 'naive (tiny-sd15, controlnet)'."""
    parts = [str(key["model"]) if "model" in varying else "",
             (key["settings_label"] if key["settings_label"] != NO_SETTINGS else "no settings")
             if "settings" in varying else "",
             str(key["dtype"]) if "dtype" in varying else "", f"batch {key['batch']}" if "batch" in varying else ""]
    extra = ", ".join(p for p in parts if p)
    return text + (f" ({extra})" if extra else "")


def _where(key: dict, varying: list[str]) -> str:
    return _qualified(f"At {key['width']}x{key['height']}", key, varying)


def _against_naive(row, naive, column: str, how: str, fmt) -> str:
    """', 3.93x faster than naive's 5,631 ms' (the fastest or smallest is never above naive, which ran too)."""
    if row["backend_label"] == "naive":
        return ""
    return f", {naive[column] / row[column]:.2f}x {how} than naive's {fmt(naive[column])}"


def _by_shape(df: pd.DataFrame) -> dict[tuple, dict]:
    """Rows as plain dicts by shape: a run may hold hundreds of shapes, too many for pandas work per shape."""
    return {tuple(r[k] for k in SHAPE): r for r in df.to_dict("records")}


def spread(cell: dict) -> float:
    """The interquartile range of a cell's attention time samples (0 with fewer than two)."""
    from .compare import quartiles

    samples = [float(v) for v in (cell.get("attention_time_samples_ms") if cell.get("attention_time_samples_ms")
                                  is not None else [])]
    if len(samples) < 2:
        return 0.0
    q1, _, q3 = quartiles(samples)
    return q3 - q1


def ranked(cells: pd.DataFrame) -> dict[tuple, tuple[dict, dict | None, bool]]:
    """Per shape, (the fastest cell, the runner-up or None, whether the fastest is clearly so: its lead over the
    runner-up beyond their summed IQRs). Cells on a GPU that moved while they ran (unsteady_gpu) are not ranked."""
    timed = cells["attention_time_ms"].notna() if "attention_time_ms" in cells else False  # none: compiled, fused
    ok = cells[(cells["status"] == "ok") & timed]
    if "unsteady_gpu" in ok:
        ok = ok[~ok["unsteady_gpu"].eq(True)]
    out = {}
    for key, group in ok.sort_values("attention_time_ms", kind="stable").groupby(SHAPE, sort=False):
        rows = group.to_dict("records")
        fast, runner = rows[0], rows[1] if len(rows) > 1 else None
        clear = runner is None or runner["attention_time_ms"] - fast["attention_time_ms"] > spread(fast) + spread(
            runner)
        out[key] = (fast, runner, clear)
    return out


def _fastest(fast: dict, runner: dict | None, clear: bool, base: dict | None, ran: bool) -> str:
    what = "kernel time" if fast.get("time_source") == "cupti" else "attention"
    if not clear:
        return (f"no backend is clearly the fastest: {fast['backend_label']} ({_ms(fast['attention_time_ms'])}) and "
                f"{runner['backend_label']} ({_ms(runner['attention_time_ms'])}) lie within their summed spread "
                f"(IQRs {_ms(spread(fast))} + {_ms(spread(runner))}); ")
    unit = "of attention kernels per forward (each call's GPU kernels, the median of the profiled forwards)" \
        if what == "kernel time" else "of attention per forward (the median of the timed forwards, each its calls " \
                                      "summed)"
    return (f"{fast['backend_label']} was the fastest: {_ms(fast['attention_time_ms'])} {unit}"
            f"{_against_naive(fast, base, 'attention_time_ms', 'faster', _ms) if ran else ''}; ")


def per_shape(cells: pd.DataFrame, judge_time: bool = True) -> list[str]:
    """The fastest (ranked: by kernel time on CUDA, clearly ahead of the runner-up) and the smallest-memory backend
    per shape, each against naive where naive ran; no fastest where judge_time is False (the machine moved while the
    run ran: unsteady; or its CUDA times are events, not kernels)."""
    varying = _varying(cells)
    cells = cells.sort_values("pixels", kind="stable")
    timed = cells["attention_time_ms"].notna() if "attention_time_ms" in cells else False
    ok = cells[(cells["status"] == "ok") & timed]
    fastest = ranked(cells) if len(ok) else {}
    peaked = ok[ok["attention_peak_mem_bytes"].notna()] if "attention_peak_mem_bytes" in ok else ok.iloc[:0]  # none:
    # compiled, fused, or a recorded CPU generation; no column: no cell ran
    smallest = _by_shape(peaked.loc[peaked.groupby(SHAPE, sort=False)["attention_peak_mem_bytes"].idxmin()]) \
        if len(peaked) else {}
    naive = _by_shape(cells[cells["backend_label"] == "naive"].drop_duplicates(SHAPE))
    statuses = cells.groupby(SHAPE, sort=False)["status"].agg(lambda s: ", ".join(sorted(set(s)))).to_dict()
    out = []
    for key in cells[SHAPE].drop_duplicates().itertuples(index=False, name=None):
        where = _where(dict(zip(SHAPE, key)), varying)
        if key not in smallest and key not in fastest:
            out.append(f"{where} no backend ran ({statuses[key]})." if statuses[key] != "ok" else
                       f"{where} no backend's attention had a time of its own (compiled: fused into Inductor's "
                       "kernels); their forwards' times stand.")
            continue
        small, base = smallest.get(key), naive.get(key)
        ran = base is not None and base["status"] == "ok" and base["attention_time_ms"] == base["attention_time_ms"]
        line = f"{where} " + (_fastest(*fastest[key], base, ran) if judge_time and key in fastest else
                              "no backend is named the fastest (the machine moved: above); " if judge_time is False
                              else "no backend is named the fastest (its times are events: above); "
                              if judge_time is None else
                              "no backend is named the fastest (the GPU moved while its cells ran: unsteady); ")
        line += (f"{small['backend_label']} needed the least memory: its largest call peaked at "
                 f"{human_bytes(small['attention_peak_mem_bytes'])}"
                 f"{_against_naive(small, base, 'attention_peak_mem_bytes', 'less', human_bytes) if ran else ''}"
                 if small else "no cell of it measured a per-call peak")
        if not ran:
            line += (" (no naive cell to compare)" if base is None else f" (naive {base['status']} here)"
                     if base["status"] != "ok" else " (naive's attention had no time of its own here: compiled)")
        out.append(line + ".")
    return out


def host_bound(cells: pd.DataFrame) -> list[str]:
    """Per shape whose forwards the host bound (bound 'host': the GPU busy under passes.BUSY_SHARE of the plain
    forward), what a user can act on: how busy the GPU was, what attention's kernels took, and what would remove the
    rest (CUDA graphs, torch.compile), with the graphed forward where one was captured."""
    if "bound" not in cells:
        return []
    varying, out = _varying(cells), []
    hosted = cells[(cells["status"] == "ok") & cells["bound"].eq("host")].sort_values("pixels", kind="stable")
    for key, group in hosted.groupby(SHAPE, sort=False):
        c = group.sort_values("attention_time_ms").iloc[0]
        line = (f"{_where(dict(zip(SHAPE, key)), varying)} the GPU was busy {c['gpu_busy_pct']:.0f}% of "
                f"{c['backend_label']}'s forward ({_ms(c['forward_gpu_ms'])} of kernels in "
                f"{_ms(c['forward_time_ms'])}):"
                f" at batch {c['batch']} the host sets the pace; attention's kernels took "
                f"{_ms(c['attention_time_ms'])} of it; CUDA graphs or torch.compile would remove the rest")
        graph = c.get("forward_graph_ms")
        out.append(line + (f" (its forward replayed from a CUDA graph took {_ms(graph)})." if graph == graph and
                           graph is not None else "."))
    return out


def event_timed(cells: pd.DataFrame) -> list[str]:
    """Where a run's CUDA cells were timed by events around each call (runs recorded before kernel timing), say so:
    their times are the host's on a host-bound GPU."""
    if "time_source" not in cells or not cells["time_source"].eq("cuda events").any():
        return []
    return ["Times not judged: this run's CUDA times are events around each call in a hooked forward, recorded "
            "before attnprof timed kernels: on a host-bound GPU they time the host's Python and launches, not the "
            "GPU, so no backend is named the fastest (each call's kernels are in gpu_time_ms, from its probe pass); "
            "measure it again for kernel times."]


def stopped_fitting(cells: pd.DataFrame) -> list[str]:
    """Per backend: the first size where it ran out of memory or was skipped by the budget, and how far it ran."""
    out, varying = [], _varying(cells)
    for _, g in cells.groupby(["backend_label", "model", "settings", "dtype", "batch"], sort=False):
        g = g.sort_values("pixels", kind="stable")
        stopped = g[g["status"].isin(STOPPED)]
        if not len(stopped):
            continue
        first = stopped.iloc[0]
        ran = g[(g["status"] == "ok") & (g["pixels"] < first["pixels"])]
        reach = f"it ran up to {ran.iloc[-1]['size']}" if len(ran) else "it ran at no smaller size"
        out.append(f"{_qualified(first['backend_label'], first, varying)} stopped fitting at {first['size']} "
                   f"({first['status']}: {str(first['error'])[:140]}); {reach}.")
    return out or ["Every backend that ran fitted at every size it was given."]


def largest_call(blocks: pd.DataFrame) -> list[str]:
    if not len(blocks) or "peak_mem_bytes" not in blocks:
        return []
    ok = blocks[(blocks["status"] == "ok") & blocks["peak_mem_bytes"].notna()]
    if not len(ok):
        return []
    b = ok.loc[ok["peak_mem_bytes"].idxmax()]
    return [f"The largest call was {b['block']} under {b['backend_label']} at "
            f"{b['width']}x{b['height']}: {b['tokens_q']} x {b['tokens_k']} tokens, {b['heads']} "
            f"head{'s' if b['heads'] != 1 else ''}, a peak of {human_bytes(b['peak_mem_bytes'])} in "
            f"{_ms(b['time_ms'])}."]


def compiled_effect(cells: pd.DataFrame) -> list[str]:
    """Per compiled cell with an eager cell of its shape and backend in the run (compare.eager_twins): its forward
    against the eager one, and the attention op's share of the forward in each (measure/compiled.py: a compiled
    call's time is its attention op; the eager cell's op time comes from its probe trace), or why it has none; its
    graph breaks and compile time."""
    from .compare import compile_of, eager_twins

    twins = eager_twins(cells) if "attention_op_time_ms" in cells else {}
    varying = [v for v in _varying(cells) if v != "settings"]
    out = []
    for c in (c for c in cells.to_dict("records") if c.get("cell_id") in twins):
        e = twins[c["cell_id"]]
        line = (f"{_where(c, varying)} compiled ({compile_of(c['settings'])}), {c['backend_label']}'s forward took "
                f"{_ms(c['forward_time_ms'])} against {_ms(e['forward_time_ms'])} eager")
        share = [r["attention_op_time_ms"] / r["forward_time_ms"] if isinstance(r["attention_op_time_ms"], float)
                 else float("nan") for r in (e, c)]  # None: no op per call (naive, or compiled and fused away)
        if all(v == v for v in share):
            line += (f"; its attention share (the attention op's time over the forward's) went from "
                     f"{100 * share[0]:.1f}% to {100 * share[1]:.1f}%")
        elif isinstance(c.get("attention_note"), str) and c["attention_note"]:
            line += f"; no attention share: {c['attention_note'].split(':')[0]}"
        if c.get("graph_breaks"):
            line += f"; Dynamo broke its graph {int(c['graph_breaks'])} times ({str(c['graph_break_reasons'])[:100]})"
        out.append(line + f" (compiled in {c['compile_s']:.1f} s, Inductor's cache {c['compile_cache']}).")
    return out


def doubtful(cells: pd.DataFrame) -> list[str]:
    """Cells whose figure is doubtful (output off the fp32 reference, noisy times) and cells that failed."""
    missing = cells[cells["status"] == "unavailable"].drop_duplicates("backend_label")  # a backend's reason, once
    varying = _varying(cells)
    noisy = cells[(cells["status"] == "ok") & cells["noisy"].eq(True)] if "noisy" in cells else cells.iloc[:0]
    cells = cells.assign(label=[_qualified(c["backend_label"], c, varying) for c in cells.to_dict("records")])
    ok = cells[cells["status"] == "ok"]
    off = ok[ok["error_ok"].eq(False)] if "error_ok" in ok else ok.iloc[:0]  # a replay has no reference: NaN
    out = []
    if len(off):
        out.append("Doubtful: " + "; ".join(f"{c['label']} at {c['size']} is {c['max_rel_err']:.1e} off the fp32 "
                                            f"reference, over the {c['dtype']} tolerance"
                                            for c in off.to_dict("records")) + ".")
    if len(noisy):  # one clause per shape: a busy machine can make most cells noisy
        by_shape = noisy.sort_values("pixels", kind="stable").groupby(SHAPE, sort=False)["backend_label"].agg(
            ", ".join)
        out.append("Noisy times (IQR over 10% of the median), so doubtful: " + "; ".join(
            f"{_where(dict(zip(SHAPE, key)), varying).replace('At', 'at', 1)}: {labels}"
            for key, labels in by_shape.items()) + ".")
    if not out and len(ok):
        out.append("No figure is doubtful: every cell that ran is within its error tolerance and none is noisy.")
    failed = cells[cells["status"].isin(("error", "timeout"))]
    if len(failed):
        out.append("Failed: " + "; ".join(f"{c['label']} at {c['size']} ({c['status']}: {str(c['error'])[:100]})"
                                          for c in failed.to_dict("records")) + ".")
    if len(missing):
        out.append("Not available here: " + "; ".join(f"{c['backend_label']} ({str(c['error'])[:100]})"
                                                      for c in missing.to_dict("records")) + ".")
    return out


BOUND_NOISE = 10.0  # percent: a call measured over its roofline bound by more beats it beyond the limits' own noise


def beyond_bound(blocks: pd.DataFrame) -> list[str]:
    """Calls measured faster than their roofline bound allows, by more than BOUND_NOISE: the bytes-moved model
    over-counts them or the device's limits read low, so their place on the roofline is doubtful."""
    if not len(blocks) or "pct_of_peak" not in blocks:
        return []
    over = blocks[blocks["pct_of_peak"].gt(100 + BOUND_NOISE)]
    if not len(over):
        return []
    top = over.loc[over["pct_of_peak"].idxmax()]
    each = ", ".join(f"{b} {n}" for b, n in over.groupby("backend_label", sort=False).size().items())
    return [f"Doubtful roofline: {len(over)} call{'s' if len(over) != 1 else ''} ran faster than the bound allows "
            f"({each}), up to {top['pct_of_peak']:.0f}% of it ({top['block']} under {top['backend_label']} at "
            f"{top['width']}x{top['height']}): the bytes-moved model over-counts them or the device's limits read "
            "low."]


def listed(value) -> list:
    """A stored list (Parquet gives arrays back), or [] where the run predates it."""
    return [] if value is None or isinstance(value, float) else list(value)


def recorded(cells: pd.DataFrame, blocks: pd.DataFrame) -> list[str]:
    """Per recorded cell (attnprof record, profiler.profile): each generation (pipeline call) with its own wall time
    (up to four; the median with the count beyond), the denoiser's forwards and its attention's share of the wall
    time, and the block whose calls took most."""
    from ..fmt import generations_text

    out = []
    for c in cells[cells["status"] == "ok"].to_dict("records"):
        mine = blocks[blocks["cell_id"] == c["cell_id"]] if len(blocks) else blocks
        total = mine["time_total_ms"].sum() if len(mine) else 0.0  # each block's calls, every forward
        times, steps = listed(c.get("generation_times_s")), listed(c.get("generation_steps"))
        forwards = len(listed(c.get("forward_time_samples_ms"))) or c["steps"]
        what = f"{c['pipeline']} ({c['backend_label']}, {c['steps']} steps at {c['size']}, batch {c['batch']}) took " \
               f"{c['generation_s']:.2f} s" if len(times) < 2 else \
            f"{c['pipeline']} ({c['backend_label']} at {c['size']}, batch {c['batch']}): " \
            f"{generations_text(steps, times)} ({c['generation_s']:.2f} s in all)"
        line = f"{what}; {forwards} denoiser forwards of {_ms(c['forward_time_ms'])} (median), " + (
            f"their attention {_ms(c['attention_time_ms'])} each; every attention call together {_ms(total)}, "
            f"{100 * total / 1e3 / c['generation_s']:.1f}% of the {'generation' if len(times) < 2 else 'wall time'}"
            if _known(c.get("attention_time_ms")) else "their attention not recorded (compiled, or modules of a "
            "kind attnprof has no hook for: the notes say)")
        if len(mine):
            top = mine.sort_values("time_total_ms").iloc[-1]
            line += (f"; the most, {top['block']} ({top['tokens_q']} x {top['tokens_k']} tokens): "
                     f"{_ms(top['time_total_ms'])}")
        out.append(line + ".")
    return out


def temporal(cells: pd.DataFrame, blocks: pd.DataFrame) -> list[str]:
    """Per video model and size (cells with temporal calls: a video U-Net's attention over frames), the share of
    attention time its temporal calls took, per backend that ran: the first thing to know of a video model."""
    if not len(blocks) or "kind" not in blocks or not blocks["kind"].eq("temporal").any():
        return []
    ok = cells[cells["status"] == "ok"].set_index("cell_id")
    mine = blocks[blocks["cell_id"].isin(ok.index) & blocks["time_ms"].notna()]
    out = []
    for (model, size), g in mine.groupby(["model", "size"], sort=False):
        shares = []
        for cid, calls in g.groupby("cell_id", sort=False):
            t = calls[calls["kind"] == "temporal"]
            if len(t):
                shares.append(f"{ok.loc[cid, 'backend_label']} {100 * t['time_ms'].sum() / calls['time_ms'].sum():.0f}%")
        if shares:
            frames = ok.loc[g["cell_id"].iloc[0], "frames"]
            n = (g[g["cell_id"] == g["cell_id"].iloc[0]]["kind"] == "temporal").sum()
            out.append(f"At {size} ({model}, {frames:g} frames) temporal attention (over the frames at each position: "
                       f"{n} of {len(g[g['cell_id'] == g['cell_id'].iloc[0]])} calls) took {', '.join(shares)} of "
                       "attention time.")
    return out


VERDICT_WORDS = {IMPROVEMENT: "faster by the noise rule", SAME: "within noise by the noise rule",
                 REGRESSION: "slower by the noise rule"}  # NOT_JUDGED: its note says why


def tune_line(c: dict) -> str:
    """A tune's closing sentence (attnprof tune's last line, show's and the findings'): the map's whole forward (or
    generation) against the best single backend's, interleaved, its speed-up with its range and the noise rule's
    verdict, and against sdpa; or why there was nothing to prove."""
    what = c.get("tune_what") or "forward"
    sdpa = (f"against sdpa's {_ms(c['sdpa_ms'])} a speed-up of {c['sdpa_speedup']:.2f}x, "
            f"{VERDICT_WORDS.get(c['sdpa_verdict'], c['sdpa_verdict'])}") if _known(c.get("sdpa_speedup")) else ""
    if not _known(c.get("speedup")):
        if isinstance(c.get("versus"), str) and c["versus"]:
            return (f"tuned: {c['versus']} is the fastest in every block, so the map runs it everywhere"
                    + (f"; its {what} took {_ms(c['proof_ms'])}, {sdpa}" if sdpa else " (nothing to prove it "
                       "against)") + _off_reference(c) + ".")
        why = c["tune_note"] if isinstance(c.get("tune_note"), str) and c["tune_note"] else \
            "no single backend runs every call within tolerance: the map runs them all (not proved against a single " \
            "backend)"
        return f"tuned: {why}" + (f"; its {what} took {_ms(c['proof_ms'])}, {sdpa}" if sdpa else "") + \
            _off_reference(c) + "."
    verdict = VERDICT_WORDS.get(c["verdict"], str(c.get("verdict_note") or c["verdict"]))
    line = (f"tuned: the mixed {what} took {_ms(c['proof_ms'])} against {c['versus']}'s {_ms(c['versus_ms'])} "
            f"({int(c['tune_rounds'])} rounds each, interleaved): a speed-up of {c['speedup']:.2f}x "
            f"({c['speedup_low']:.2f}x to {c['speedup_high']:.2f}x), {verdict}")
    if sdpa and c["versus"] != "sdpa":
        line += f"; {sdpa}"
    if c.get("kept_single") is True:
        why = c["kept_why"] if isinstance(c.get("kept_why"), str) and c["kept_why"] else "no faster"
        line += f"; {why}, so the map keeps {c['versus']} in every block"
    return line + _off_reference(c) + "."


def _off_reference(c: dict) -> str:
    """'; BEWARE: the map's U-Net forward is 5.0e-01 off the fp32 reference, beyond the float16 tolerance' where the
    forward the map runs was held to the reference and missed it."""
    ok = c.get("error_ok")
    if ok is None or ok != ok or bool(ok):  # within tolerance, or not held to the reference (a pipeline's)
        return ""
    return (f"; BEWARE: the map's {c.get('tune_what') or 'forward'} is {c['max_rel_err']:.1e} off the fp32 reference, "
            f"beyond the {c['dtype']} tolerance")


def _known(v) -> bool:
    return v is not None and v == v


def tuned(cells: pd.DataFrame, blocks: pd.DataFrame) -> list[str]:
    """Per processor map (a tune's cell): which backends it runs in how many blocks, its calls' kernels against the
    best single backend's, and the proof (tune_line)."""
    out = []
    for c in cells[cells["status"].eq("ok") & cells["backend"].eq("tuned")].to_dict("records"):
        mine = blocks[blocks["cell_id"] == c["cell_id"]] if len(blocks) else blocks
        if not len(mine) or "chosen" not in mine:
            continue
        counts = mine["chosen"].value_counts()
        single = cells[cells["backend_label"].eq(c.get("versus")) & cells["status"].eq("ok")]
        versus = (f" against {c['versus']}'s {_ms(single['attention_time_ms'].iloc[0])}"
                  if len(single) and c.get("versus") else "")
        out.append(f"The map {c['backend_label']} for {c['model']} at {c['size']} runs "
                   + ", ".join(f"{name} in {n} block{'s' if n != 1 else ''}" for name, n in counts.items())
                   + f"; its calls' kernels alone take {_ms(c['attention_time_ms'])} a forward{versus}.")
        out.append(tune_line(c)[0].upper() + tune_line(c)[1:])
    return out


def findings(cells: pd.DataFrame, blocks: pd.DataFrame, manifest: dict | None = None) -> list[str]:
    """The run's headline findings, each a plain sentence; none for a run with no cells. A recorded generation's
    cells (kind record) get their own sentences; the others are compared shape by shape. Where the run's own
    calibrations (its manifest's) say the machine moved while it ran, that comes first and no backend is named the
    fastest: its times say as much about the machine as about the backends."""
    from .compare import unsteady

    if not len(cells):
        return []
    moved = unsteady(manifest or {})
    out = [f"Times not judged: {moved}, so no backend is named the fastest; run it again on a quiet machine."] \
        if moved else []
    out += tuned(cells, blocks) if "backend" in cells else []
    mine = cells["kind"].eq("record") if "kind" in cells else pd.Series(False, index=cells.index)
    out += recorded(cells[mine], blocks) if mine.any() else []
    cells = cells[~mine]
    if not len(cells):
        return out
    events = event_timed(cells)
    return out + events + per_shape(cells, judge_time=None if events else not moved) + host_bound(cells) + \
        temporal(cells, blocks) + compiled_effect(cells) + stopped_fitting(cells) + largest_call(blocks) + \
        doubtful(cells) + beyond_bound(blocks)


def format_findings(sentences: list[str], width: int = 118) -> str:
    import textwrap

    return "\n".join(textwrap.fill(s, width, initial_indent="- ", subsequent_indent="  ", break_on_hyphens=False,
                                   break_long_words=False) for s in sentences)
