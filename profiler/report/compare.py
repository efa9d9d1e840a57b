"""Run B against run A (attnprof diff, the dashboard's Compare page): cells matched on (model, size, batch, dtype,
backend with options), each matched cell's time and peak-memory ratio, and a verdict that calls a change a
regression or an improvement only where it is larger than the noise of both runs.

The noise rule, on the stored samples of each cell's attention time (per timed forward, the sum over its calls;
the forward's samples for runs recorded before those were kept):
- time: a regression where B's median is more than `threshold` (5%) above A's AND B's interquartile range lies
  wholly above A's (B's first quartile over A's third); an improvement the other way round; else within noise.
  A cell with fewer than MIN_SAMPLES (3) samples in either run is within noise, with that reason: one sample has
  no spread (its interquartile range is zero, so any change would count), two have too little to judge by.
- peak memory (deterministic, so no spread): a regression where B's attention peak is more than `threshold` above
  A's, an improvement more than `threshold` below, and in both cases by at least PEAK_FLOOR (1 MiB: CPU kernels
  take per-thread scratch, allocators round up; a 0.5 MiB change in a 1 MiB peak is not a finding).
- a cell that ran in A but not in B (oom, error, ...) is a regression; the other way round an improvement.
"""
from __future__ import annotations

import statistics

import pandas as pd

from ..backends import label
from ..fmt import human_bytes, table

KEY = ["model", "settings", "width", "height", "batch", "dtype", "backend", "backend_options"]
REGRESSION, IMPROVEMENT, SAME = "regression", "improvement", "within noise"
PEAK_FLOOR = 2**20
THRESHOLD = 0.05  # the default smallest relative change that counts
MIN_SAMPLES = 3  # timed forwards per cell, in each run, before its time gets a verdict (the default repeats)


def rule_text(threshold: float | str = "--threshold") -> str:
    """The noise rule in one sentence, as attnprof diff (its output and --help) and the dashboard state it."""
    past = threshold if isinstance(threshold, str) else f"{100 * threshold:g}%"
    return (f"a time change counts past {past} and only where the interquartile ranges of the two runs' samples do "
            f"not overlap, each run holding at least {MIN_SAMPLES} samples of the cell (repeats {MIN_SAMPLES} or "
            f"more); a peak change counts past {past} and {human_bytes(PEAK_FLOOR)}")


def time_samples(cell: dict) -> list[float]:
    for key in ("attention_time_samples_ms", "forward_time_samples_ms"):
        value = cell.get(key)
        if value is not None and len(value):
            return [float(v) for v in value]
    return []


def quartiles(samples: list[float]) -> tuple[float, float, float]:
    if len(samples) == 1:
        return samples[0], samples[0], samples[0]
    q1, med, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return q1, med, q3


def time_verdict(a: list[float], b: list[float], threshold: float) -> tuple[float, str, str]:
    """(B's median / A's, the verdict by the noise rule, why it could not judge: '' where it could)."""
    (a1, am, a3), (b1, bm, b3) = quartiles(a), quartiles(b)
    ratio = bm / am
    if min(len(a), len(b)) < MIN_SAMPLES:
        return ratio, SAME, f"too few samples: {len(a)} in A, {len(b)} in B"
    if ratio > 1 + threshold and b1 > a3:
        return ratio, REGRESSION, ""
    if ratio < 1 - threshold and b3 < a1:
        return ratio, IMPROVEMENT, ""
    return ratio, SAME, ""


def peak_verdict(a: float, b: float, threshold: float) -> tuple[float, str]:
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


def compare(a: pd.DataFrame, b: pd.DataFrame, threshold: float = THRESHOLD) -> dict[str, pd.DataFrame]:
    """{"matched": one row per cell in both runs, "only_a": cells only in A, "only_b": cells only in B}."""
    a, b = (df if "settings" in df else df.assign(settings="{}") for df in (a, b))  # runs before settings existed
    a, b = (df.assign(settings=df["settings"].fillna("{}")) for df in (a, b))
    a, b = a.assign(_key=_keys(a)), b.assign(_key=_keys(b))
    by_key = b.drop_duplicates("_key").set_index("_key")
    rows = []
    for ka, ca in a.drop_duplicates("_key").set_index("_key").iterrows():
        if ka not in by_key.index:
            continue
        cb = by_key.loc[ka]
        row = {k: ca[k] for k in KEY} | {"status_a": ca["status"], "status_b": cb["status"]}
        ok_a, ok_b = ca["status"] == "ok", cb["status"] == "ok"
        if ok_a and ok_b:
            sa, sb = time_samples(ca.to_dict()), time_samples(cb.to_dict())
            row.update(time_a_ms=statistics.median(sa), time_b_ms=statistics.median(sb))
            row["time_ratio"], row["time_verdict"], row["time_note"] = time_verdict(sa, sb, threshold)
            row.update(peak_a_bytes=ca["attention_peak_mem_bytes"], peak_b_bytes=cb["attention_peak_mem_bytes"])
            row["peak_ratio"], row["peak_verdict"] = peak_verdict(row["peak_a_bytes"], row["peak_b_bytes"], threshold)
            verdicts = {row["time_verdict"], row["peak_verdict"]}
            row["verdict"] = REGRESSION if REGRESSION in verdicts else IMPROVEMENT if IMPROVEMENT in verdicts else SAME
        else:
            row["verdict"] = REGRESSION if ok_a else IMPROVEMENT if ok_b else SAME
        rows.append(row)
    columns = KEY + ["status_a", "status_b", "time_a_ms", "time_b_ms", "time_ratio", "time_verdict", "time_note",
                     "peak_a_bytes", "peak_b_bytes", "peak_ratio", "peak_verdict", "verdict"]
    matched = pd.DataFrame(rows, columns=columns)
    return {"matched": matched, "only_a": a[~a["_key"].isin(b["_key"])][KEY + ["status"]].reset_index(drop=True),
            "only_b": b[~b["_key"].isin(a["_key"])][KEY + ["status"]].reset_index(drop=True)}


def summary(result: dict) -> dict:
    matched = result["matched"]
    verdicts = matched["verdict"].value_counts().to_dict()
    return {"matched": len(matched), "regressions": verdicts.get(REGRESSION, 0),
            "improvements": verdicts.get(IMPROVEMENT, 0), "within_noise": verdicts.get(SAME, 0),
            "too_few_samples": int((matched["time_note"].fillna("") != "").sum()),
            "only_a": len(result["only_a"]), "only_b": len(result["only_b"])}


def summary_text(s: dict) -> str:
    """The summary line of attnprof diff and of the dashboard's comparison."""
    few = (f"; the time of {s['too_few_samples']} could not be judged: too few samples (a verdict needs "
           f"{MIN_SAMPLES} per cell in each run: repeats {MIN_SAMPLES} or more)") if s["too_few_samples"] else ""
    return (f"{s['matched']} cells matched: {s['regressions']} regressions, {s['improvements']} improvements, "
            f"{s['within_noise']} within noise{few}")


def format_diff(run_a: str, run_b: str, result: dict, threshold: float) -> str:
    rows = []
    for r in result["matched"].to_dict("records"):
        ran = r["status_a"] == "ok" and r["status_b"] == "ok"
        rows.append({"model": r["model"], "size": f"{r['width']}x{r['height']}", "batch": r["batch"],
                     "dtype": r["dtype"], "backend": label(r["backend"], r["backend_options"]),
                     "time A": f"{r['time_a_ms']:.2f} ms" if ran else r["status_a"],
                     "time B": f"{r['time_b_ms']:.2f} ms" if ran else r["status_b"],
                     "time": f"{r['time_ratio']:.3f}x" if ran else "-",
                     "peak A": human_bytes(r["peak_a_bytes"]) if ran else "-",
                     "peak B": human_bytes(r["peak_b_bytes"]) if ran else "-",
                     "peak": f"{r['peak_ratio']:.3f}x" if ran else "-", "verdict": r["verdict"],
                     "note": r["time_note"] if ran else ""})
    cols = [(c, c) for c in ("model", "size", "batch", "dtype", "backend", "time A", "time B", "time", "peak A",
                             "peak B", "peak", "verdict", "note")]
    lines = [f"A = {run_a}, B = {run_b}; time: the attention time's median over the timed forwards; "
             f"{rule_text(threshold)}", "", table(rows, cols) if rows else "(no cell in both runs)", "",
             summary_text(summary(result))]
    for side, name in (("only_a", run_a), ("only_b", run_b)):
        if len(result[side]):
            cells = ", ".join(f"{r['model']} {r['width']}x{r['height']} b{r['batch']} {r['dtype']} "
                              f"{label(r['backend'], r['backend_options'])}"
                              for r in result[side].to_dict("records"))
            lines.append(f"left out, only in {name}: {cells}")
    return "\n".join(lines)

