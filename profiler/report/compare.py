"""Run B against run A (attnprof diff, the dashboard's Compare page): cells matched on (model, settings, size, batch,
dtype, backend with options), each matched cell's time and peak-memory ratio, and a verdict that calls a change a
regression or an improvement only where it is larger than the noise of both runs. A compiled cell left unmatched
lines up with the eager (or otherwise compiled) cell of its shape and backend: that pair is judged on the forward's
time and peak, since a compiled call's time is its attention op alone and an eager call's its whole processor.

The noise rule, on the stored samples of each cell's attention time (ATTENTION_TIME: per timed forward, the sum
over its calls; the forward's samples for runs recorded before those were kept):
- time: a regression where B's median is more than `threshold` (5%) above A's AND B's interquartile range lies
  wholly above A's (B's first quartile over A's third); an improvement the other way round; else within noise.
  Samples too few or too spread to tell sameness from a change get no verdict: a cell with fewer than MIN_SAMPLES
  (3) samples in either run (one sample has no spread, so any change would count; two have too little to judge
  by), or whose interquartile range in either run is over NOISY_LIMIT (50%) of its median (samples that swung 30 ms
  to 1.4 s overlap whatever the change: a 10x slowdown read "within noise" once), is "not judged", with the reason.
  So is a cell the two runs timed by different clocks (time_source, frame.CLOCKS): a CUDA run stored before kernel
  timing holds CUDA events around each call, the host's time on a host-bound GPU, and a 9x "improvement" against
  its CUPTI kernel time would be the clock's, not the code's. Both kernel-timed: judged on kernel time.
- the machine's own state: each run holds calibrations (measure/calibrate.py: a fixed small workload timed at its
  start and its end). Where B's machine was up to k times slower than A's (B's calibration over A's at the start,
  and at the end: the larger), a regression must also clear k: B's median over (1 + threshold) k times A's and
  B's first quartile over k times A's third; where it was more than MACHINE_LIMIT (50%) slower or faster, no time
  is judged at all (nor called within noise: a cell 3x slower on a machine 3x faster reads the same). A change the
  plain rule calls but the machine explains is "not judged", with the machine's change named; the same the other
  way round for improvements on a faster machine. Runs without calibrations are judged by the plain rule.
- attnprof diff exits 1 where any cell is a regression, else NOT_JUDGED_EXIT (3) where any cell's time is not
  judged (a CI gate must not pass those silently), else 0. A run diffed with itself is said to be the same run,
  every cell within noise whatever its samples (nothing changed): 0.
- the environment (torch threads, versions, device) of the two runs: where it differs the verdicts stand and the
  differences are named beside them (a one-thread run against a two-thread run is a regression worth seeing).
- peak memory (deterministic, so no spread): a regression where B's attention peak is more than `threshold` above
  A's, an improvement more than `threshold` below, and in both cases by at least PEAK_FLOOR (1 MiB: CPU kernels
  take per-thread scratch, allocators round up; a 0.5 MiB change in a 1 MiB peak is not a finding).
- a cell that ran in A but not in B (oom, error, ...) is a regression; the other way round an improvement.
"""
from __future__ import annotations

import json
import statistics

import pandas as pd

from ..fmt import human_bytes, ms_text, table
from .frame import CLOCKS

KEY = ["model", "settings", "width", "height", "batch", "dtype", "backend", "backend_options"]
REGRESSION, IMPROVEMENT, SAME, NOT_JUDGED = "regression", "improvement", "within noise", "not judged"
PEAK_FLOOR = 2**20
THRESHOLD = 0.05  # the default smallest relative change that counts
MIN_SAMPLES = 3  # timed forwards per cell, in each run, before its time gets a verdict (the default repeats)
MACHINE_LIMIT = 0.5  # a machine this much slower (or faster) in B than in A: no time verdict at all
NOISY_LIMIT = 0.5  # a cell whose IQR is over this share of its median (in either run): no time verdict
NOT_JUDGED_EXIT = 3  # attnprof diff's exit status where no cell regressed and some cell's time is not judged
ENV_KEYS = ("device", "device_name", "cpu_count", "torch_threads", "torch", "diffusers", "python", "cuda", "cudnn",
            "driver")  # what a run's figures depend on beside the code: named where two runs differ in it
ATTENTION_TIME = ("a cell's attention time: per timed forward its attention calls' times summed, the median over "
                  "the timed forwards")  # what show, the findings, diff and the report give (measure/cell.py)
ATTENTION_SPLIT = ("an attention call's time holds its q/k/v and output projections: core, its attention core alone "
                   "(on CUDA the core's kernels; on the CPU its host time less its projections'), projections the "
                   "rest (on CUDA its other kernels: projections and layout copies; on the CPU the projection "
                   "modules' own time: to_q, to_k, to_v, to_out); '-' where a run recorded no split")
STEADY = (1.0, 1.0)  # (how many times slower B's machine was at most, how many times faster): no change known
DRIFT_LIMIT = 0.45  # a run whose like calibrations differ by more than this share: its machine moved


def rule_text(threshold: float | str = "--threshold") -> str:
    """The noise rule in one sentence, as attnprof diff (its output and --help) and the dashboard state it."""
    past = threshold if isinstance(threshold, str) else f"{100 * threshold:g}%"
    return (f"a time change counts past {past} and only where the interquartile ranges of the two runs' samples do "
            f"not overlap, and beyond what the machine's own speed explains (each run's calibrations at its start "
            f"and end, B's over A's); a time is not judged where a run holds fewer than {MIN_SAMPLES} samples of the "
            f"cell (repeats {MIN_SAMPLES} or more), where its IQR is over {100 * NOISY_LIMIT:g}% of its median, or "
            f"where B's machine was over {100 * MACHINE_LIMIT:g}% slower or faster than A's, or where the runs timed it "
            f"by different clocks (time_source: CUDA events before kernel timing, CUPTI kernels since); a peak "
            f"change counts past {past} and {human_bytes(PEAK_FLOOR)}")


def time_samples(cell: dict, forward: bool = False) -> list[float]:
    """The cell's attention time samples (the forward's where it has none, or with forward=True)."""
    for key in ("attention_time_samples_ms", "forward_time_samples_ms")[1 if forward else 0:]:
        value = cell.get(key)
        if value is not None and len(value):
            return [float(v) for v in value]
    return []


def _own(cell: dict) -> bool:
    """Whether the cell has attention time samples of its own."""
    value = cell.get("attention_time_samples_ms")
    return value is not None and not isinstance(value, float) and len(value) > 0


def compile_of(settings) -> str:
    """The cell's compile setting from its stored settings: none, regional or full."""
    return json.loads(settings).get("compile", "none")


def _loose(settings) -> str:
    """The stored settings without compile: the key that lines up a compiled cell with an eager one."""
    s = json.loads(settings)
    return json.dumps({k: v for k, v in s.items() if k != "compile"}, sort_keys=True)


def eager_twins(cells: pd.DataFrame) -> dict[str, dict]:
    """Per compiled cell of one run (by cell_id), the eager cell of its model, settings but compile, shape and
    backend with options, where the run holds one that ended ok."""
    if not len(cells):
        return {}
    key = ["model", "dtype", "batch", "width", "height", "backend", "backend_options"]
    records = [c for c in cells.to_dict("records") if c["status"] == "ok"]
    eager = {(*(c[k] for k in key), _loose(c["settings"])): c for c in records if compile_of(c["settings"]) == "none"}
    return {c["cell_id"]: eager[twin] for c in records if compile_of(c["settings"]) != "none"
            and (twin := (*(c[k] for k in key), _loose(c["settings"]))) in eager}


def quartiles(samples: list[float]) -> tuple[float, float, float]:
    if len(samples) == 1:
        return samples[0], samples[0], samples[0]
    q1, med, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return q1, med, q3


def time_verdict(a: list[float], b: list[float], threshold: float, machine: tuple[float, float] = STEADY,
                 clocks: tuple = (None, None)) -> tuple[float, str, str]:
    """(B's median / A's, the verdict by the noise rule, why it could not judge: '' where it could). machine: (how
    many times slower B's machine was at most, how many times faster at most), from the runs' calibrations; clocks:
    each side's time_source, where known."""
    (a1, am, a3), (b1, bm, b3) = quartiles(a), quartiles(b)
    ratio = bm / am
    unjudged = _unjudged(a, b, (a1, am, a3), (b1, bm, b3), machine, clocks)
    if unjudged:
        return ratio, NOT_JUDGED, unjudged
    slower, faster = max(machine[0], 1.0), min(machine[1], 1.0)
    if ratio > 1 + threshold and b1 > a3:
        if ratio > (1 + threshold) * slower and b1 > a3 * slower:
            return ratio, REGRESSION, ""
        return ratio, NOT_JUDGED, f"not judged: the machine was {100 * (slower - 1):.0f}% slower in B"
    if ratio < 1 - threshold and b3 < a1:
        if ratio < (1 - threshold) * faster and b3 < a1 * faster:
            return ratio, IMPROVEMENT, ""
        return ratio, NOT_JUDGED, f"not judged: the machine was {100 * (1 / faster - 1):.0f}% faster in B"
    return ratio, SAME, ""


def _unjudged(a: list[float], b: list[float], qa: tuple, qb: tuple, machine: tuple[float, float],
              clocks: tuple = (None, None)) -> str:
    """Why two cells' samples cannot be judged at all, whatever their change: timed by different clocks (each
    side's time_source, where both are known), too few of them, spread too wide (the runs named, the wider one's IQR
    over its median said), or a machine that moved past MACHINE_LIMIT either way; '' where they can be."""
    if all(c in CLOCKS for c in clocks) and clocks[0] != clocks[1]:
        return f"not judged (A timed by {CLOCKS[clocks[0]]}; B by {CLOCKS[clocks[1]]})"
    if min(len(a), len(b)) < MIN_SAMPLES:
        return f"too few samples: {len(a)} in A, {len(b)} in B"
    spread = {run: (q3 - q1) / med if med else float("inf") for run, (q1, med, q3) in (("A", qa), ("B", qb))}
    wide = [run for run, share in spread.items() if share > NOISY_LIMIT]
    if wide:
        return (f"not judged (too noisy: IQR {100 * max(spread[r] for r in wide):.0f}% of the median in "
                f"{' and '.join(wide)})")
    if machine[0] > 1 + MACHINE_LIMIT:
        return f"not judged: the machine was {100 * (machine[0] - 1):.0f}% slower in B"
    if machine[1] < 1 / (1 + MACHINE_LIMIT):
        return f"not judged: the machine was {100 * (1 / machine[1] - 1):.0f}% faster in B"
    return ""


def calibrations(manifest: dict, when: str | None = None) -> list[float]:
    """The medians of a run's calibrations (measure/calibrate.py) in ms, those taken at `when` (start, end) only
    where given: none for runs made before they were recorded."""
    return [float(c["median_ms"]) for c in manifest.get("calibration") or []
            if c.get("median_ms") and when in (None, c.get("when"))]


def drift(manifest: dict) -> float | None:
    """How far the machine moved while the run ran: of its start calibrations, and of its end ones, the slowest over
    the fastest, the larger (1.0: steady); with one of each (a sweep's), the one over the other; None where it has
    fewer than two. Like with like where it can: a start is
    taken in a process that has just begun, an end after the cell's forwards have kept every core busy, and on this
    project's 2-core virtual machine the two read 1.3-2.6x apart in every record child (a start 14-23 ms, its end
    7-13 ms, 2026-12-04)."""
    found = [max(c) / min(c) for when in ("start", "end") if len(c := calibrations(manifest, when)) > 1]
    every = calibrations(manifest)  # one start and one end (a sweep's): the one against the other
    return max(found) if found else max(every) / min(every) if len(every) > 1 else None


def unsteady(manifest: dict) -> str | None:
    """'the machine's speed moved 1.50x while it ran (its calibrations ...)' where the run's own calibrations of a
    kind differ by more than DRIFT_LIMIT, else None: such a run's times say as much about the machine as about the
    backends."""
    d = drift(manifest)
    if d is None or d <= 1 + DRIFT_LIMIT:
        return None
    return (f"the machine's speed moved {d:.2f}x while it ran (its calibrations: {calibrations_text(manifest)}; those "
            f"of a kind more than {100 * DRIFT_LIMIT:.0f}% apart)")


def calibrations_text(manifest: dict) -> str:
    """A run's calibrations as taken ('start 10 ms, end 10.5 ms'); '' where it has none."""
    return ", ".join(f"{c.get('when')} {float(c['median_ms']):.3g} ms" for c in manifest.get("calibration") or []
                     if c.get("median_ms"))


def machine_change(manifest_a: dict, manifest_b: dict) -> tuple[float, float]:
    """(how many times slower B's machine may have been than A's, how many times faster): B's calibration over A's at
    the same point of the run (the first start against the first start, the last end against the last end), the
    largest and the smallest of those; where the runs share no such point, B's slowest over A's fastest and B's
    fastest over A's slowest; STEADY where either run has none."""
    ratios = [b[i] / a[i] for when, i in (("start", 0), ("end", -1))
              if (a := calibrations(manifest_a, when)) and (b := calibrations(manifest_b, when))]
    if ratios:
        return max(ratios), min(ratios)
    a, b = calibrations(manifest_a), calibrations(manifest_b)
    return (max(b) / min(a), min(b) / max(a)) if a and b else STEADY


def environment_changes(manifest_a: dict, manifest_b: dict) -> list[str]:
    """'torch_threads 2 -> 1' for each of ENV_KEYS in which the two runs' recorded environments differ."""
    ea, eb = manifest_a.get("environment") or {}, manifest_b.get("environment") or {}
    return [f"{k} {ea.get(k)} -> {eb.get(k)}" for k in ENV_KEYS if str(ea.get(k)) != str(eb.get(k))]


def peak_verdict(a: float, b: float, threshold: float) -> tuple[float, str]:
    if a is None or b is None or a != a or b != b:  # a call with no memory of its own (compiled, fused away)
        return float("nan"), SAME
    ratio = b / a if a else float("nan")
    if abs(b - a) < PEAK_FLOOR:
        return ratio, SAME
    return ratio, REGRESSION if ratio > 1 + threshold else IMPROVEMENT if ratio < 1 - threshold else SAME


def _keys(df: pd.DataFrame) -> pd.Series:
    """Each cell's matching key: KEY's columns, a single-file checkpoint's model named by its header's SHA-256 (one
    checkpoint matches itself wherever the file lies)."""
    keyed = df[KEY].astype(str)
    if "model_header_sha256" in df:
        sha = df["model_header_sha256"]
        keyed["model"] = keyed["model"].where(sha.isna(), "file:" + sha.astype(str))
    return keyed.agg("|".join, axis=1)


def compare(a: pd.DataFrame, b: pd.DataFrame, threshold: float = THRESHOLD,
            manifests: tuple[dict, dict] | None = None, same: bool = False) -> dict:
    """{"matched": one row per cell in both runs, "only_a": cells only in A, "only_b": cells only in B (frames),
    "machine": (times slower, times faster) of B's machine, "environment": how the runs' environments differ}.
    manifests: the two runs' (A's, B's), for their calibrations and environments. Cells match on KEY; those left
    then match on KEY with the settings but compile, so that a compiled run lines up with an eager one: such a pair
    is judged on the forward's time and peak (a compiled call's time is its attention op alone, an eager call's its
    whole processor), with each side's largest call in its note. same: B is A itself (attnprof diff A A), whose every
    cell is within noise whatever its samples (too few, too noisy: nothing changed, so nothing is left to judge)."""
    a, b = (df.reset_index(drop=True) for df in (a, b))
    machine = machine_change(*manifests) if manifests else STEADY
    changed = environment_changes(*manifests) if manifests else []
    a, b = (df.assign(_key=_keys(df), _loose=_keys(df.assign(settings=df["settings"].map(_loose)))) for df in (a, b))
    pairs, used_a, used_b = [], set(), set()
    for column in ("_key", "_loose"):
        by_key = {k: i for i, k in reversed(list(b[column].items())) if i not in used_b}
        for i, k in a[column].items():
            if i not in used_a and k in by_key and by_key[k] not in used_b:
                pairs.append((i, by_key[k]))
                used_a.add(i)
                used_b.add(by_key[k])
    rows = [_matched_row(a.loc[i].to_dict(), b.loc[j].to_dict(), threshold, machine, changed) for i, j in pairs]
    if same:  # identical cells: a time the rule cannot judge (too few samples, too noisy) is unchanged all the same
        rows = [r | {"time_verdict": SAME, "time_note": "", "verdict": SAME} if r.get("time_verdict") == NOT_JUDGED
                else r for r in rows]
    columns = KEY + ["compile_a", "compile_b", "status_a", "status_b", "time_a_ms", "time_b_ms", "time_ratio",
                     "time_verdict", "time_note", "peak_a_bytes", "peak_b_bytes", "peak_ratio", "peak_verdict",
                     "verdict", "environment", "forward_a_ms", "forward_b_ms", "forward_peak_a_bytes",
                     "forward_peak_b_bytes", "attention_peak_a_bytes", "attention_peak_b_bytes", "note"]
    only = lambda df, used: df[~df.index.isin(used)].drop_duplicates("_key")[KEY + ["status"]]  # noqa: E731
    return {"matched": pd.DataFrame(rows, columns=columns), "only_a": only(a, used_a).reset_index(drop=True),
            "only_b": only(b, used_b).reset_index(drop=True), "machine": machine, "environment": changed}


def _matched_row(ca: dict, cb: dict, threshold: float, machine: tuple[float, float], changed: list[str]) -> dict:
    """One matched pair's figures and verdicts: the attention's time and largest call's peak, or where one side is
    compiled and the other not (or compiled otherwise), the forward's time and peak; the environments' differences
    beside a verdict that found a change."""
    row = {k: ca[k] for k in KEY} | {"status_a": ca["status"], "status_b": cb["status"],
                                     "compile_a": compile_of(ca["settings"]), "compile_b": compile_of(cb["settings"])}
    cross = row["compile_a"] != row["compile_b"]
    ok_a, ok_b = ca["status"] == "ok", cb["status"] == "ok"
    if not (ok_a and ok_b):
        verdict = REGRESSION if ok_a else IMPROVEMENT if ok_b else SAME
        return row | {"verdict": verdict, "environment": "; ".join(changed) if verdict != SAME else ""}
    forward = cross or not (_own(ca) and _own(cb))  # like with like: the forwards where a side has no attention
    sa, sb = time_samples(ca, forward=forward), time_samples(cb, forward=forward)
    if not (sa and sb):  # nothing timed (a module compiled whole: neither its calls nor its forwards)
        none = " and ".join(run for run, s in (("A", sa), ("B", sb)) if not s)
        row.update(time_ratio=float("nan"), time_verdict=NOT_JUDGED, time_note=f"not judged (no samples in {none})")
    else:
        row.update(time_a_ms=statistics.median(sa), time_b_ms=statistics.median(sb))
        row["time_ratio"], row["time_verdict"], row["time_note"] = time_verdict(
            sa, sb, threshold, machine, (ca.get("time_source"), cb.get("time_source")))
    if forward and not cross:
        row["note"] = "the forwards' times: a side's attention has no time of its own (compiled, or not recorded)"
    peak = "forward_peak_mem_bytes" if cross else "attention_peak_mem_bytes"
    row.update(peak_a_bytes=ca.get(peak), peak_b_bytes=cb.get(peak))
    row["peak_ratio"], row["peak_verdict"] = peak_verdict(row["peak_a_bytes"], row["peak_b_bytes"], threshold)
    verdicts = {row["time_verdict"], row["peak_verdict"]}
    row["verdict"] = next(v for v in (REGRESSION, IMPROVEMENT, NOT_JUDGED, SAME) if v in verdicts)
    row["environment"] = "; ".join(changed) if row["verdict"] in (REGRESSION, IMPROVEMENT) else ""
    row.update(forward_a_ms=ca.get("forward_time_ms"), forward_b_ms=cb.get("forward_time_ms"),
               forward_peak_a_bytes=ca.get("forward_peak_mem_bytes"),
               forward_peak_b_bytes=cb.get("forward_peak_mem_bytes"),
               attention_peak_a_bytes=ca.get("attention_peak_mem_bytes"),
               attention_peak_b_bytes=cb.get("attention_peak_mem_bytes"))
    if cross:
        row["note"] = (f"{_mode(row['compile_a'])} against {_mode(row['compile_b'])}: the forward's time and peak; "
                       f"largest call {human_bytes(ca.get('attention_peak_mem_bytes'))} in A, "
                       f"{human_bytes(cb.get('attention_peak_mem_bytes'))} in B")
    return row


def _mode(compile: str) -> str:
    return "eager" if compile == "none" else f"compiled ({compile})"


def summary(result: dict) -> dict:
    matched = result["matched"]
    verdicts = matched["verdict"].value_counts().to_dict()
    notes = matched["time_note"].fillna("")
    return {"matched": len(matched), "regressions": verdicts.get(REGRESSION, 0),
            "improvements": verdicts.get(IMPROVEMENT, 0), "within_noise": verdicts.get(SAME, 0),
            "not_judged": verdicts.get(NOT_JUDGED, 0), "too_few_samples": int(notes.str.startswith("too few").sum()),
            "times_not_judged": int(matched["time_verdict"].eq(NOT_JUDGED).sum()),
            "only_a": len(result["only_a"]), "only_b": len(result["only_b"])}


def exit_status(s: dict) -> int:
    """attnprof diff's exit status from its summary: 1 on a regression, else NOT_JUDGED_EXIT where a cell's time
    was not judged, else 0."""
    return 1 if s["regressions"] else NOT_JUDGED_EXIT if s["times_not_judged"] else 0


def summary_text(s: dict) -> str:
    """The summary line of attnprof diff and of the dashboard's comparison."""
    few = (f"; {s['too_few_samples']} with too few samples (a verdict needs {MIN_SAMPLES} per cell in each run: "
           f"repeats {MIN_SAMPLES} or more)") if s["too_few_samples"] else ""
    unjudged = (f", {s['not_judged']} not judged (too noisy, too few samples, timed by different clocks, or the "
                f"machine's own speed moved as much: see their notes)" if s.get("not_judged") else "")
    return (f"{s['matched']} cells matched: {s['regressions']} regressions, {s['improvements']} improvements, "
            f"{s['within_noise']} within noise{unjudged}{few}")


def machine_text(result: dict, manifests: tuple[dict, dict]) -> str:
    """What each run's calibrations were (the manifests': A's, B's) and what they say of B's machine against A's, as
    speed (A's calibration time over B's: below 1, B's was slower); how the environments differ."""
    said = [calibrations_text(m) for m in manifests]
    if not all(said):
        kept = next((f"; {run}'s: {text}" for run, text in zip("AB", said) if text), "")
        none = "either run" if not kept else "A" if not said[0] else "B"
        line = f"machine: no calibrations in {none} (made before they were recorded{kept}): the plain rule"
    else:
        line = (f"machine: calibrations (a fixed workload timed as the cells are) A {said[0]}; B {said[1]}: B's "
                f"machine ran at {speed_text(*result.get('machine', STEADY))}; a time change must clear that too")
    changed = result.get("environment") or []
    return line + (f"\nenvironment differs: {'; '.join(changed)} (the verdicts stand, named beside them)"
                   if changed else "")


def speed_text(slower: float, faster: float) -> str:
    """B's machine's speed as a share of A's, from machine_change's (times slower, times faster): '0.83x to 0.91x
    A's speed (slower)'."""
    low, high = f"{1 / slower:.2f}", f"{1 / faster:.2f}"
    way = " (slower)" if float(high) < 1 else " (faster)" if float(low) > 1 else ""
    return (f"{low}x" if low == high else f"{low}x to {high}x") + f" A's speed{way}"


def format_diff(run_a: str, run_b: str, result: dict, threshold: float, manifests: tuple[dict, dict],
                same: bool = False) -> str:
    """attnprof diff's text; manifests: the runs' (A's, B's); same: B is A itself (compare's `same`)."""
    from ..attention.backends import label
    from ..spec import settings_label

    records = result["matched"].to_dict("records")
    settings = any(settings_label(_loose(r["settings"])) for r in records)
    rows = [_diff_row(r) for r in records]
    compiled = any(r["compile"] != "none" for r in rows)
    cols = [(c, c) for c in ("model", *(["settings"] if settings else []), "size", "batch", "dtype", "backend",
                             *(["compile"] if compiled else []), "time A", "time B", "time", "peak A", "peak B",
                             "peak", "verdict", "note")]
    across = "" if not compiled else " (the forward's, for a compiled cell against an eager one: compile A / B)"
    machine = (f"A and B are the same run ({run_a}): each cell is compared with itself, identical; nothing to judge"
               if same else machine_text(result, manifests))
    lines = [f"A = {run_a}, B = {run_b}; time: {ATTENTION_TIME}{across}; {rule_text(threshold)}",
             machine, "", table(rows, cols) if rows else "(no cell in both runs)", "", summary_text(summary(result))]
    for side, name in (("only_a", run_a), ("only_b", run_b)):
        if len(result[side]):
            cells = ", ".join(f"{r['model']}{_settings(r)} {r['width']}x{r['height']} b{r['batch']} {r['dtype']} "
                              f"{label(r['backend'], r['backend_options'])}"
                              for r in result[side].to_dict("records"))
            lines.append(f"left out, only in {name}: {cells}")
    return "\n".join(lines)


def _settings(r: dict) -> str:
    from ..spec import settings_label

    return f" ({settings_label(r['settings'])})" if settings_label(r["settings"]) else ""


def _diff_row(r: dict) -> dict:
    from ..attention.backends import label
    from ..spec import settings_label

    ran = r["status_a"] == "ok" and r["status_b"] == "ok"
    note = "; ".join(n for n in (r["time_note"] if ran else "", r.get("note"), r["environment"])
                     if isinstance(n, str) and n)
    return {"model": r["model"], "settings": settings_label(_loose(r["settings"])) or "-",
            "compile": r["compile_a"] if r["compile_a"] == r["compile_b"] else f"{r['compile_a']} / {r['compile_b']}",
            "size": f"{r['width']}x{r['height']}", "batch": r["batch"],
            "dtype": r["dtype"], "backend": label(r["backend"], r["backend_options"]),
            "time A": ms_text(r["time_a_ms"], 2) if ran else r["status_a"],
            "time B": ms_text(r["time_b_ms"], 2) if ran else r["status_b"],
            "time": f"{r['time_ratio']:.3f}x" if ran and r["time_ratio"] == r["time_ratio"] else "-",
            "peak A": human_bytes(r["peak_a_bytes"]) if ran else "-",
            "peak B": human_bytes(r["peak_b_bytes"]) if ran else "-",
            "peak": f"{r['peak_ratio']:.3f}x" if ran and r["peak_ratio"] == r["peak_ratio"] else "-",
            "verdict": r["verdict"], "note": note}


def diff_command(run_a: str, run_b: str, results: str, threshold: float, json: bool) -> int:
    """attnprof diff: run B against run A, printed (or as JSON); the exit status says what was found."""
    import sys
    from json import dump

    from ..spec import InputError
    from ..store import find_run

    if not 0 <= threshold < 1:
        raise InputError(f"--threshold {threshold} is not a fraction: use e.g. 0.05 for 5%")
    a, b = find_run(results, run_a), find_run(results, run_b)
    manifests, same = (a.manifest(), b.manifest()), a.path.resolve() == b.path.resolve()
    result = compare(a.cells(), b.cells(), threshold, manifests, same)
    s = summary(result)
    if json:
        dump({"a": a.id, "b": b.id, "threshold": threshold, "summary": s,
              **{k: v.to_dict("records") if hasattr(v, "to_dict") else v for k, v in result.items()}},
             sys.stdout, indent=1, default=str)
        print()
    else:
        print(format_diff(a.id, b.id, result, threshold, manifests, same))
    return exit_status(s)
