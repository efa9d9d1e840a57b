"""The judges of a run's CUDA times (make gpu-check's fifth pass, the audit's checks N1-N7 and N10-N12): each a pure
function of one run's (cells, blocks) that judges every cell or call it names, reports the share it judged, and
FAILs where a figure breaks its rule. Kernel times (time_source cupti) are the headline on CUDA: these check that
they are the kernels', steady, independent of our hooks, consistent across passes and backends, and that the
machine's state and the forward's bound are said (measure/passes.py, measure/state.py)."""
from __future__ import annotations

import statistics

import pandas as pd

from .verdicts import Skip, Verdict, evidence, num, records, span, what

N1_DEFINITION = 0.001  # the cell's attention time against its calls' per-forward kernel sums
N2_CELL, N2_CALL, N2_SHARE, N2_MIN_MS = 0.03, 0.05, 0.95, 0.02
N3_KERNELS, N3_GRAPH, N3_FORWARD = (0.97, 1.03), (0.97, 1.03), (0.95, 1.05)
N4_SDXL_NAIVE, N4_SD15_EFFICIENT = 2.0, 1.5
N5_CALLS, N5_FORWARD = (0.95, 1.10), (1.00, 1.15)
N6_CLOCKS = (0.97, 1.03)
N7_HOOKS = 0.02
N10_RATIO, N10_ABS_MS, N10_SHARE = (0.8, 1.25), 0.005, 0.95
N11_MOVED = 0.05


def _cuda(cells: pd.DataFrame, blocks: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The run's ok cells timed by kernels (time_source cupti) and their calls; Skip where there are none."""
    ok = cells[(cells["status"] == "ok") & cells.get("time_source", pd.Series(dtype=object)).eq("cupti")] \
        if len(cells) else cells
    if not len(ok):
        raise Skip("no ok cell timed by its kernels (time_source cupti): kernel times need a CUDA device")
    return ok, blocks[blocks["cell_id"].isin(ok["cell_id"])] if len(blocks) else blocks


def _iqr_share(samples) -> float:
    values = [float(v) for v in samples]
    if len(values) < 2 or not statistics.median(values):
        return 0.0
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return (q3 - q1) / statistics.median(values)


def _judged(figure: str, judged: int, of: int) -> str:
    return f"{figure} ({judged} of {of} judged, {100 * judged / of:.0f}%)" if of else figure


def attention_is_its_calls_kernels(cells, blocks, device) -> Verdict:
    """N1: each cell's attention_time_ms is its calls' kernel time (the median over the profiled forwards of each
    forward's calls summed, from the blocks' time_samples_ms) within 0.1%, every call's time_source cupti, and no
    more than the kernels of the whole forward (forward_gpu_ms)."""
    ok, calls = _cuda(cells, blocks)
    rows, failed = [], []
    for r in records(ok):
        mine = calls[calls["cell_id"] == r["cell_id"]]
        sums = [sum(s) for s in zip(*mine["time_samples_ms"])]
        again = statistics.median(sums) if sums else float("nan")
        off = abs(r["attention_time_ms"] - again) / again if again else float("inf")
        share = r["attention_time_ms"] / r["forward_gpu_ms"] if r.get("forward_gpu_ms") else float("nan")
        clocks = set(mine["time_source"])
        good = off <= N1_DEFINITION and share <= 1.0 and clocks == {"cupti"}
        rows.append(evidence({**r, "calls_kernel_ms": again, "attention_share": share}, "cells",
                             ["attention_time_ms", "calls_kernel_ms", "attention_share"], "forward_gpu_ms",
                             f"within 0.1% of the calls' per-forward kernel sums ({100 * off:.3f}%), share <= 1, "
                             f"every call cupti ({', '.join(sorted(clocks))})", good))
        if not good:
            failed.append(f"{what(r)}: attention {num(r['attention_time_ms'])} ms, calls' kernels {again:.6g} ms "
                          f"({100 * off:.2f}%), {100 * share:.1f}% of the forward's kernels, clocks {sorted(clocks)}")
    return Verdict(_judged(f"{len(ok)} cells: attention is its calls' kernels", len(ok), len(ok)), rows, failed)


def kernel_times_are_steady(cells, blocks, device) -> Verdict:
    """N2: per cell, the IQR of its K forwards' attention kernel sums within 3% of their median; of the calls of 0.02
    ms and more, at least 95% with their own samples' IQR within 5% of their median."""
    ok, calls = _cuda(cells, blocks)
    rows, failed = [], []
    for r in records(ok):
        spread = _iqr_share(r["attention_time_samples_ms"])
        mine = calls[(calls["cell_id"] == r["cell_id"]) & (calls["time_ms"] >= N2_MIN_MS)]
        steady = sum(_iqr_share(s) <= N2_CALL for s in mine["time_samples_ms"])
        share = steady / len(mine) if len(mine) else 1.0
        good = spread <= N2_CELL and share >= N2_SHARE
        rows.append(evidence({**r, "attention_iqr_share": spread, "steady_call_share": share}, "cells",
                             ["attention_iqr_share", "steady_call_share"], rule=f"<= {N2_CELL:g}; >= {N2_SHARE:g} of "
                             f"{len(mine)} calls of {N2_MIN_MS:g} ms and more", ok=good))
        if not good:
            failed.append(f"{what(r)}: attention IQR {100 * spread:.1f}% of its median; {steady} of {len(mine)} "
                          "calls steady")
    return Verdict(_judged(f"{len(ok)} cells", len(ok), len(ok)), rows, failed)


def _pairs(ok: pd.DataFrame, a: str, b: str) -> list[tuple[dict, dict]]:
    shape = ["model", "width", "height", "batch", "dtype", "settings"]
    out = []
    for _, g in ok.groupby(shape, sort=False):
        by = {r["backend"]: r for r in records(g)}
        if a in by and b in by:
            out.append((by[a], by[b]))
    return out


def chosen_and_forced_agree(cells, blocks, device) -> Verdict:
    """N3: where sdpa ran the very kernels sdpa-cudnn forced (their calls' GPU kernels alike, call by call), their
    attention kernel times within 3%, their graphed forwards within 3%, their plain forwards within 5%: one kernel
    timed twice, in interleaved rounds (the first H200 run read 1.42x apart, cells run once each in a fixed order)."""
    ok, calls = _cuda(cells, blocks)
    rows, failed, judged = [], [], 0
    pairs = _pairs(ok, "sdpa", "sdpa-cudnn")
    for a, b in pairs:
        ka, kb = (list(calls[calls["cell_id"] == r["cell_id"]].sort_values("call_index")["gpu_kernels"])
                  for r in (a, b))
        if ka != kb:
            rows.append(evidence(a, "cells", "sdpa_kernel", rule="sdpa ran other kernels than sdpa-cudnn: not judged"))
            continue
        judged += 1
        for column, (low, high) in (("attention_time_ms", N3_KERNELS), ("forward_graph_ms", N3_GRAPH),
                                    ("forward_time_ms", N3_FORWARD)):
            if a.get(column) is None or b.get(column) is None:
                rows.append(evidence(a, "cells", column, rule=f"{column}: none (not judged)", ok=column ==
                                     "forward_graph_ms"))
                continue
            ratio = a[column] / b[column]
            good = low <= ratio <= high
            rows.append(evidence({**a, f"cudnn_{column}": b[column]}, "cells", column, f"cudnn_{column}",
                                 f"sdpa / sdpa-cudnn in [{low}, {high}] (ratio {ratio:.4f})", good))
            if not good:
                failed.append(f"{a['model']} {a['width']}x{a['height']}: {column} sdpa {num(a[column])} / sdpa-cudnn "
                              f"{num(b[column])} = {ratio:.3f}")
    if not judged:
        raise Skip(f"no shape where sdpa ran sdpa-cudnn's kernels ({len(pairs)} pairs of cells)")
    return Verdict(_judged("sdpa against sdpa-cudnn", judged, len(pairs)), rows, failed)


def kernels_rank_the_backends(cells, blocks, device) -> Verdict:
    """N4: by kernel time, SDXL's naive at least 2x sdpa's attention and SD 1.5's mem-efficient at least 1.5x
    cuDNN's (the first H200 run's kernels: 2.44x and 1.93x; its events 1.07x and 0.93x); and the findings name sdpa
    or sdpa-cudnn the fastest at both sizes."""
    from ..report.findings import ranked

    ok, _ = _cuda(cells, blocks)
    rows, failed = [], []
    for model, slow, fast, least in (("sdxl-base", "naive", "sdpa", N4_SDXL_NAIVE),
                                     ("sd15", "sdpa-efficient", "sdpa-cudnn", N4_SD15_EFFICIENT)):
        for a, b in _pairs(ok[ok["model"] == model], slow, fast):
            ratio = a["attention_time_ms"] / b["attention_time_ms"]
            rows.append(evidence({**a, "against_ms": b["attention_time_ms"]}, "cells", "attention_time_ms",
                                 "against_ms", f"{slow} / {fast} >= {least} (ratio {ratio:.3f})", ratio >= least))
            if ratio < least:
                failed.append(f"{model}: {slow} / {fast} attention kernels {ratio:.2f}x, under {least}x")
    from ..report.frame import normalised

    for key, (fast, runner, clear) in ranked(normalised(ok)).items():
        good = clear and fast["backend"] in ("sdpa", "sdpa-cudnn")
        rows.append(evidence(fast, "cells", ["backend", "attention_time_ms"], rule="the findings' fastest is sdpa or "
                             "sdpa-cudnn, clearly (" + ("clear" if clear else "within the spread of " +
                                                         runner["backend"]) + ")",
                             ok=good))
        if not good:
            failed.append(f"{what(fast)}: the findings' fastest is {fast['backend']}{'' if clear else ' (not clear)'}")
    if not rows:
        raise Skip("neither SDXL's naive and sdpa nor SD 1.5's mem-efficient and cuDNN ran")
    return Verdict(f"{len(rows)} rankings", rows, failed)


def graphs_agree_with_cupti(cells, blocks, device) -> Verdict:
    """N5: per cell, its calls' graphed times (CUDA events recorded as nodes of a captured graph: the kernels back to
    back, no host) summed against their CUPTI kernel time summed, in [0.95, 1.10]; the graphed forward against the
    plain profiled forward's kernels, in [1.00, 1.15]. A cell with no graph SKIPs with capture's reason."""
    ok, calls = _cuda(cells, blocks)
    rows, failed, judged, why = [], [], 0, []
    for r in records(ok):
        if r.get("forward_graph_ms") is None:
            why.append(f"{what(r)}: {r.get('forward_graph_error') or 'no graph'}")
            continue
        judged += 1
        mine = calls[calls["cell_id"] == r["cell_id"]]
        graphed, kernels = mine["graph_time_ms"].sum(), mine["time_ms"].sum()
        for measured, against, (low, high), ratio in (
                ("graph_calls_ms", "calls_kernel_ms", N5_CALLS, graphed / kernels if kernels else float("nan")),
                ("forward_graph_ms", "forward_gpu_ms", N5_FORWARD, r["forward_graph_ms"] / r["forward_gpu_ms"]
                 if r.get("forward_gpu_ms") else float("nan"))):
            good = low <= ratio <= high
            rows.append(evidence({**r, "graph_calls_ms": graphed, "calls_kernel_ms": kernels}, "cells", measured,
                                 against, f"in [{low}, {high}] (ratio {ratio:.4f})", good))
            if not good:
                failed.append(f"{what(r)}: {measured} / {against} = {ratio:.3f}")
    if not judged:
        raise Skip("no cell's forward was captured in a CUDA graph: " + "; ".join(why[:3]))
    return Verdict(_judged("graphed against CUPTI", judged, len(ok)), rows, failed + why)


def events_match_the_wall_clock(cells, blocks, device) -> Verdict:
    """N6: per cell, its plain forwards timed by CUDA events (forward_time_ms) against the same forwards by the
    host's clock to a synchronize after each (forward_host_ms): within 3%. Two clocks on the very same forwards, so
    that a drifting host cannot tell them apart (the first H200 run's check took them one after the other: 1.42x)."""
    ok, _ = _cuda(cells, blocks)
    rows, failed = [], []
    for r in records(ok):
        ratio = r["forward_time_ms"] / r["forward_host_ms"] if r.get("forward_host_ms") else float("nan")
        good = N6_CLOCKS[0] <= ratio <= N6_CLOCKS[1]
        rows.append(evidence(r, "cells", "forward_time_ms", "forward_host_ms", f"in {list(N6_CLOCKS)} (ratio "
                             f"{ratio:.4f})", good))
        if not good:
            failed.append(f"{what(r)}: events / wall clock {ratio:.3f}")
    ratios = [r["forward_time_ms"] / r["forward_host_ms"] for r in records(ok) if r.get("forward_host_ms")]
    return Verdict(_judged(f"events / wall clock {span(ratios)}", len(ok), len(ok)), rows, failed)


def hooks_change_no_kernel(cells, blocks, device) -> Verdict:
    """N7: the hooks' cost is reported (hooked_forward_ms, hook_overhead_pct: hooked against plain forwards, in the
    same rounds) and changes no kernel: the attention cores' kernels of the hooked profiled forwards
    (attention_kernel_ms) within 2% of those of a plain profiled forward (plain_attn_kernel_ms)."""
    ok, _ = _cuda(cells, blocks)
    rows, failed = [], []
    for r in records(ok):
        plain = r.get("plain_attn_kernel_ms")
        off = abs(r["attention_kernel_ms"] / plain - 1) if plain else float("inf")
        reported = r.get("hook_overhead_pct") is not None and r.get("hooked_forward_ms") is not None
        good = reported and off <= N7_HOOKS
        rows.append(evidence(r, "cells", ["attention_kernel_ms", "hook_overhead_pct"], "plain_attn_kernel_ms",
                             f"within 2% ({100 * off:.2f}%), the overhead reported", good))
        if not good:
            failed.append(f"{what(r)}: hooked {num(r['attention_kernel_ms'])} ms against plain {num(plain)} ms; "
                          f"overhead reported {reported}")
    overheads = [r["hook_overhead_pct"] for r in records(ok) if r.get("hook_overhead_pct") is not None]
    return Verdict(f"hooks cost {span(overheads)}% of a forward", rows, failed)


def call_kernels_agree_across_passes(cells, blocks, device) -> Verdict:
    """N10 (the first pass's check 7, now on the stored headline and every call): each call's stored time_ms (its
    kernels, median of the profiled forwards) against the kernels of the same call in the memory pass (gpu_time_ms,
    launched on an idle device): within [0.8, 1.25] or 5 microseconds. Judged: every call with both; at least 95%
    of the calls must have both."""
    ok, calls = _cuda(cells, blocks)
    both = calls[calls["time_ms"].notna() & calls["gpu_time_ms"].notna()]
    share = len(both) / len(calls) if len(calls) else 0.0
    ratio = both["time_ms"] / both["gpu_time_ms"]
    bad = ~((ratio.between(*N10_RATIO)) | ((both["time_ms"] - both["gpu_time_ms"]).abs() <= N10_ABS_MS))
    shown = pd.concat([both[bad], *(c.loc[[(c["time_ms"] / c["gpu_time_ms"]).idxmin(),
                                           (c["time_ms"] / c["gpu_time_ms"]).idxmax()]]
                                    for _, c in both.groupby("cell_id", sort=False))]).drop_duplicates(
        ["cell_id", "call_index"])
    rows = [evidence(r, "blocks", "time_ms", "gpu_time_ms", f"in {list(N10_RATIO)} or within {N10_ABS_MS} ms "
                     f"(ratio {r['time_ms'] / r['gpu_time_ms']:.4f})", i not in bad[bad].index)
            for i, r in zip(shown.index, records(shown))]
    failed = [f"{what(r)} {r['block']}: {r['time_ms'] / r['gpu_time_ms']:.3f}x" for r in records(both[bad])]
    if share < N10_SHARE:
        failed.append(f"only {len(both)} of {len(calls)} calls ({100 * share:.0f}%) have both figures")
    return Verdict(_judged(f"stored kernel time / memory pass's {span(ratio)}", len(both), len(calls)), rows, failed)


def machine_held_still(cells, blocks, device) -> Verdict:
    """N11: every cell carries the machine's state (the launch probe and the fixed GEMM before and after, the SM
    clock's median and highest, NVML's clock-event reasons) and its verdict agrees with it: a cell where either probe
    moved over 5%, the clock's median fell under 0.9 of its highest or the hardware slowed is `unsteady` (and a GPU
    that moved keeps it from the findings' ranking); one that held still is not. The share unsteady is reported."""
    from ..measure.state import verdict

    ok, _ = _cuda(cells, blocks)
    rows, failed, moved = [], [], 0
    need = ("host_launch_us_before", "host_launch_us_after", "gpu_ref_ms_before", "gpu_ref_ms_after")
    for r in records(ok):
        missing = [c for c in need if r.get(c) is None]
        hardware = 0x8 if r.get("clock_reasons") and "hw " in str(r["clock_reasons"]) else 0
        again = verdict(r, hardware) if not missing else {"unsteady": None}
        moved += bool(r.get("unsteady"))
        good = not missing and (again["unsteady"] is None) == (r.get("unsteady") is None)
        rows.append(evidence(r, "cells", [*need, "sm_clock_mhz_median", "sm_clock_mhz_max", "clock_reasons",
                                          "unsteady"], rule="the state read and its verdict said", ok=good))
        if not good:
            failed.append(f"{what(r)}: missing {missing}" if missing else
                          f"{what(r)}: the state says {again['unsteady']!r}, the cell {r.get('unsteady')!r}")
    return Verdict(_judged(f"{moved} of {len(ok)} cells unsteady", len(ok), len(ok)), rows, failed)


def bound_is_labelled(cells, blocks, device) -> Verdict:
    """N12: every cell says what bound its forward (bound: host or gpu, from the GPU's busy share of the plain
    forward) and every call whether its launches outlasted its kernels (launch_bound); the shares are reported (for
    eager SD at batch 1 on a fast GPU, expect the host)."""
    ok, calls = _cuda(cells, blocks)
    rows, failed = [], []
    for r in records(ok):
        mine = calls[calls["cell_id"] == r["cell_id"]]
        labelled = mine["launch_bound"].notna().all() if len(mine) else False
        good = r.get("bound") in ("host", "gpu") and bool(labelled)
        share = float(mine["launch_bound"].astype(float).mean()) if labelled else float("nan")
        rows.append(evidence({**r, "launch_bound_share": share}, "cells", ["bound", "gpu_busy_pct",
                                                                          "launch_bound_share"],
                             rule="bound is host or gpu; every call's launch_bound said", ok=good))
        if not good:
            failed.append(f"{what(r)}: bound {r.get('bound')!r}, calls labelled {bool(labelled)}")
    hosts = sum(r.get("bound") == "host" for r in records(ok))
    return Verdict(f"{hosts} of {len(ok)} cells bound by the host", rows, failed)


JUDGES = [attention_is_its_calls_kernels, kernel_times_are_steady, chosen_and_forced_agree, kernels_rank_the_backends,
          graphs_agree_with_cupti, events_match_the_wall_clock, hooks_change_no_kernel,
          call_kernels_agree_across_passes, machine_held_still, bound_is_labelled]
