"""Plain-text summaries of a stored run (attnprof show)."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq

from ..attention import backends
from ..attention.backends import label
from ..fmt import fitted_table, generations_text, human_bytes, human_count, ms_text, table
from ..store import BLOCKS, CELLS, DONE_STATUSES, Run, Unreadable, kind_of, list_runs
from .compare import ATTENTION_SPLIT, ATTENTION_TIME, eager_twins
from .frame import NO_SETTINGS

UNREADABLE = (OSError, ValueError, KeyError, TypeError)  # JSON, Arrow (ValueError) and missing-key errors


def runs_index(root: Path) -> pd.DataFrame:
    """One row per run folder under root, newest last; a run that cannot be read gets a row with `warning` set."""
    rows = [_index_row(path) for path in list_runs(root)]
    columns = ["run_id", "created", "kind", "models", "device", "backends", "cells", *DONE_STATUSES, "pending",
               "warning", "versions", "git", "readable"]
    return pd.DataFrame(rows, columns=columns)


def _index_row(path: Path) -> dict:
    row = {"run_id": path.name, "readable": False, "warning": ""}
    try:
        run = Run.open(path)
        m = run.manifest()
        env, sweep = m.get("environment") or {}, m.get("sweep") or m.get("replay") or {}
        planned = m.get("cells") or []  # a record's (profile's) cells, where it has no sweep: their models, backends
        row.update(created=str(m.get("created_at", ""))[:16].replace("T", " "), kind=kind_of(m).name,
                   models=", ".join(sweep.get("models") or dict.fromkeys(c["model"] for c in planned
                                                                          if c.get("model"))),
                   device=f"{env.get('device')} ({env.get('device_name')})",
                   backends=", ".join(dict.fromkeys([label(*b) for b in sweep.get("backends", [])] or [
                       label(c["backend"], c.get("backend_options") or "{}") for c in planned if c.get("backend")])),
                   cells=len(planned),
                   versions=f"torch {env.get('torch')}, diffusers {env.get('diffusers')}, python {env.get('python')}",
                   git=str(env.get("git_revision") or "")[:12])
        for name in (CELLS, BLOCKS):  # the footer is enough to tell a truncated file
            if (path / name).is_file():
                pq.read_metadata(path / name)
        cells = run.cells()
        counts = cells["status"].value_counts() if len(cells) else pd.Series(dtype=int)
    except UNREADABLE as e:
        e = e.__cause__ if isinstance(e, Unreadable) and e.__cause__ else e  # the reader's own error
        row["warning"] = f"unreadable: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return row
    row.update({s: int(counts.get(s, 0)) for s in DONE_STATUSES}, readable=True)
    row["pending"] = max(0, row["cells"] - int(counts.sum()))
    left = left_backends(m, cells) if m.get("interrupted") else []
    if left:  # an interrupted record run: what it lacks
        row["warning"] = (f"interrupted: no complete cell of {', '.join(b or 'loaded' for b in left)} "
                          "(attnprof record --resume finishes it)")
    elif row["pending"] and not m.get("ended_at"):
        row["warning"] = f"unfinished: {int(counts.sum())} of {row['cells']} cells recorded (running, or stopped)"
    elif row["pending"]:
        row["warning"] = f"incomplete: {row['pending']} of {row['cells']} cells never recorded"
    elif m.get("interrupted") and m.get("ended_at"):  # stopped with every planned cell stored: nothing left
        row["warning"] = "interrupted"
    return row


def format_runs(root: Path) -> str:
    index = runs_index(root)
    if not len(index):
        return f"no runs under {root}: make one with make profile, attnprof run or attnprof sweep"
    rows = []
    for r in index.astype(object).where(index.notna(), None).to_dict("records"):  # NaN: not read, so blank
        if not r["readable"]:
            rows.append({"run": r["run_id"], "created": "", "models": "", "device": "", "cells": "-",
                         "note": r["warning"]})
            continue
        counts = ", ".join(f"{int(r[s])} {s}" for s in DONE_STATUSES if r.get(s))
        rows.append({"run": r["run_id"], "created": r["created"] or "", "models": r["models"] or "",
                     "device": r["device"] or "", "cells": f"{int(r['cells'] or 0)}: {counts or '-'}",
                     "note": r["warning"]})
    return table(rows, [(c, c) for c in ("run", "created", "models", "device", "cells", "note")])


def status_table(run: Run) -> str:
    """Statuses per backend (rows) and size (columns): the closing table of a run or sweep. Where a run holds more
    than one model or setting, each row names them too."""
    cells = run.cells()
    if not len(cells):
        return "no cells recorded"
    what = cells["model"] + cells["settings_label"].map(lambda s: "" if s == NO_SETTINGS else f" ({s})")
    cells = cells.assign(backend=cells["backend_label"], what=what)
    if cells["what"].nunique() > 1:
        cells["backend"] = cells["what"] + " " + cells["backend"]
    sizes = list(dict.fromkeys(cells["size"]))
    rows = []
    for backend, group in cells.groupby("backend", sort=False):
        row = {"backend": backend}
        for size in sizes:
            counts = group[group["size"] == size]["status"].value_counts()
            row[size] = ", ".join(s if n == 1 else f"{s} x{n}" for s, n in counts.items()) or "-"
        rows.append(row)
    return table(rows, [("backend", "backend")] + [(s, s) for s in sizes])


def _limits_line(m: dict) -> list[str]:
    """The device's measured limits, as the manifest holds them."""
    if not m.get("device_peak_bytes_per_s"):
        return []
    flops = ", ".join(f"{human_count(v)}FLOP/s {d}" for d, v in (m.get("device_peak_flops") or {}).items())
    refused = [f"device limit refused: {line}" for line in (m.get("device_limits") or {}).get("refused") or []]
    return [f"device limits (measured): {flops}; {human_bytes(m['device_peak_bytes_per_s'])}/s memory bandwidth",
            *refused]


def _ratio(measured, predicted) -> str:
    """measured / predicted, where both are there."""
    if not (_known(measured) and _known(predicted) and predicted):
        return ""
    return f"{measured / predicted:.3f}"


def _known(value) -> bool:
    return value is not None and value == value


def _of_peak(pct, bound) -> str:
    """'12.3% of memory': the percent of the roofline bound that applies (compute or memory bandwidth)."""
    return f"{pct:.1f}% of {bound}" if _known(pct) else "-"


def _files_lines(m: dict) -> list[str]:
    """The run's single-file checkpoints: what each is, its size and its header's SHA-256 (unet/checkpoint.py)."""
    return [f"model file {path}: {f['model_file_kind']} (U-Net config {f['model_file_config']}), "
            f"{human_bytes(f['model_file_bytes'])}, header sha256 {f['model_header_sha256'][:16]}"
            for path, f in (m.get("model_files") or {}).items()]


def _rel_err(c: dict) -> str:
    if c["backend"] == backends.REFERENCE_BACKEND and c["max_rel_err"] == 0:  # the reference itself: 0 by construction
        return "0 (= ref)"
    return f"{c['max_rel_err']:.1e}{'' if c['error_ok'] else ' (!)'}"


def _references(cells) -> str:
    """What the run's errors are measured against, as its cells record it (sdpa/float32, where it ran)."""
    named = sorted({str(r) for r in cells.get("reference", []) if isinstance(r, str) and r})
    return "; ".join(named) or f"{backends.REFERENCE_BACKEND}/{backends.REFERENCE_DTYPE}"


# what show leaves out first to fit a terminal, in order (--wide: none)
NARROW_DROP = ["eager fwd peak", "eager attn peak", "eager forward", "note", "fwd predicted", "attn host", "ratio",
               "predicted", "family", "dtype", "batch", "fwd peak", "bound", "settings", "compile", "graph breaks",
               "noisy", "of peak", "clock", "rel err", "projections", "core"]


LEGEND_HINT = "(attnprof show --legend says what each column is)"


def format_run(run: Run, width: int | None = None, legend: bool = False) -> str:
    """The run's summary; its tables and notes fitted to width characters (None: every column, unwrapped). The
    columns' legend with legend=True, else one line that says where it is."""
    import textwrap

    from .findings import findings, format_findings

    m = run.manifest()
    env = m.get("environment", {})
    cells, blocks = run.read()
    found = findings(cells, blocks, m)
    ended = f"{m['ended_at']}{' (interrupted)' if m.get('interrupted') else ''}" if m.get("ended_at") else \
        "not yet (running or stopped)"
    lines = ([f"findings ({run.id}):", format_findings(found), ""] if found else []) + [
             f"run {run.id}  ({run.path})", f"created {m.get('created_at')}  ended {ended}",
             f"device {env.get('device')} ({env.get('device_name')}), torch {env.get('torch')}, "
             f"diffusers {env.get('diffusers')}, git {str(env.get('git_revision'))[:12]}",
             f"command: {m.get('command')}", *_limits_line(m), *_files_lines(m), ""]
    unfinished = _unfinished(run, m, cells)
    if not len(cells):
        return "\n".join(lines + (unfinished or [f"no cells recorded yet ({len(m.get('cells', []))} planned)"]))
    twins = eager_twins(cells)
    rows = _cell_rows(cells, twins, m)
    columns = [(c, c) for c in _cell_columns(rows, twins)]
    note = _footnote(cells) if legend else LEGEND_HINT
    if width is None:
        lines += [table(rows, columns), "", note]
    else:
        shown, dropped = fitted_table(_short_models(rows), columns, width, NARROW_DROP)
        lines += [shown, ""] + ([f"(left out to fit {width} columns: {', '.join(dropped)}; --wide shows them)"]
                               if dropped else []) + [textwrap.fill(note, width)]
    lines += _events_line(cells)
    lines += _recorded_lines(cells, m) + _tuned_lines(run, cells, blocks, width) + \
        ([""] + unfinished if unfinished else [])
    if len(blocks) and blocks["peak_mem_bytes"].notna().any():
        lines += ["", "largest measured per-call peaks:", _largest_calls(blocks, width)]
    if width is None:
        return "\n".join(lines)
    return "\n".join(textwrap.fill(line, width, subsequent_indent="  ", break_on_hyphens=False)
                     if len(line) > width and "  " not in line.strip() else line for line in lines)


def resume_record(run: Run) -> str:
    """The command that finishes an interrupted record run."""
    return f"attnprof record --out {run.path.parent} --resume {run.id}"


def _partial(cells) -> set:
    """The backends of a record run's partial cells (the generations of a script stopped before it ended)."""
    return set(cells[cells["partial"].eq(True)]["backend"]) if len(cells) and "partial" in cells else set()


def left_backends(m: dict, cells) -> list:
    """The backends of a record run (as record names them: None, the script's own processors) with no complete cell:
    none at all, or only the partial cells of a script stopped before it ended; what --resume runs again."""
    partial = _partial(cells)
    done = {b for b in cells["backend"] if b not in partial} if len(cells) else set()
    return [b for b in (m.get("record") or {}).get("backends") or [] if (b or "loaded") not in done]


def _unfinished(run: Run, m: dict, cells) -> list[str]:
    """An interrupted record run: the backends it has no complete cell of, and the command that finishes it."""
    left = left_backends(m, cells) if m.get("interrupted") else []
    if not left:
        return []
    partial = _partial(cells)
    names = ", ".join(("the script's own processors (loaded)" if b is None else b) +
                      (" (its cells partial: the generations that ended before the stop)"
                       if (b or "loaded") in partial else "") for b in left)
    return [f"interrupted: no {'complete ' if partial else ''}cell of {names}: its run of "
            f"{(m.get('record') or {}).get('script')} was stopped or made no pipeline call; finish it with: "
            f"{resume_record(run)}"]


PARTIAL = "partial: the script was stopped; its generations that ended (attnprof record --resume runs it again)"
PARTIAL_STEPS = "partial: a Ctrl-C stopped the profile block; its steps that ended"


def _partial_text(m: dict) -> str:
    """What a partial cell holds: a script's generations that ended (attnprof record), or a profile block's steps."""
    return PARTIAL if (m.get("record") or {}).get("script") else PARTIAL_STEPS


def _short_models(rows: list[dict]) -> list[dict]:
    """A recorded generation's model column, 'StableDiffusionPipeline UNet2DConditionModel 7f3af43b', as its
    pipeline and config hash."""
    return [{**r, "model": " ".join(w for i, w in enumerate(r["model"].split()) if i != 1)}
            if len(r["model"].split()) == 3 else r for r in rows]


def component_rows(components: list[dict], wall_ms: float) -> list[dict]:
    """A recorded generation's components for a table (profile's summary, show): per component its class, forwards,
    time and share of the generation's wall time, its attention calls, their time (core and projections apart:
    ATTENTION_SPLIT; '-' for a run stored without them) and share; 'not recorded' where its attention was not
    (compiled, or modules the recorder has no hook for), never as 0 calls."""
    rows = []
    for r in components:
        recorded = r["attention_calls"] == r["attention_calls"] and r["attention_calls"] is not None  # not NaN
        missing = r.get("not_recorded") or ""
        rows.append({"component": r["component"], "class": r["class"], "forwards": str(r["forwards"]),
                     "time": f"{r['time_ms']:.1f} ms", "share": f"{100 * r['time_ms'] / wall_ms:.1f}%",
                     "calls": (f"{int(r['attention_calls'])}" + (f" (not recorded: {missing})" if missing else ""))
                     if recorded else f"not recorded ({missing})" if missing else "not recorded",
                     "attention": f"{r['attention_ms']:.1f} ms" if recorded else "-",
                     "core": ms_text(r.get("attention_core_ms")) if recorded else "-",
                     "projections": ms_text(r.get("attention_proj_ms")) if recorded else "-",
                     "attention share": f"{100 * r['attention_ms'] / wall_ms:.1f}%" if recorded else "-"})
    return rows


COMPONENT_COLUMNS = ("component", "class", "forwards", "time", "share", "calls", "attention", "core", "projections",
                     "attention share")


def _recorded_lines(cells, m: dict) -> list[str]:
    """A recorded generation's cells (kind record): per component its forwards, their time, its attention calls and
    theirs, against the generation's wall time; the run's notes."""
    import json

    from .findings import listed

    out = []
    for c in (c for c in cells.to_dict("records") if c.get("kind") == "record" and c["status"] == "ok"):
        wall = c["generation_s"] * 1e3
        rows = component_rows(json.loads(c["components"]), wall)
        times, steps = listed(c.get("generation_times_s")), listed(c.get("generation_steps"))
        calls = generations_text(steps, times) if len(times) > 1 else f"{c['steps']} steps"
        out += ["", f"{c['pipeline']}, {c['backend_label']} ({c['processors']}): {calls}, scheduler "
                    f"{c['scheduler']}, guidance {c['guidance']}; {c['generation_s']:.3f} s of wall time"
                    + (f" ({_partial_text(m)})" if _known(c.get("partial")) and c["partial"] else ""),
                table(rows, [(k, k) for k in COMPONENT_COLUMNS])]
    return out + [f"note: {n}" for n in m.get("notes") or []]


def _cell_rows(cells, twins: dict, m: dict) -> list[dict]:
    """A row per cell of the run (its manifest m), grouped by family (stable within one)."""
    rows = []
    order = {name: i for i, name in enumerate(n for _, group in backends.by_family(cells["backend"]) for n in group)}
    for c in sorted(cells.to_dict("records"), key=lambda c: order[c["backend"]]):
        ok = c["status"] == "ok"
        rows.append({**_beside_eager(c, twins.get(c["cell_id"]), ok),
            "model": c["model"], "settings": c["settings_label"] if c["settings_label"] != NO_SETTINGS else "-",
            "size": c["size"], "batch": c["batch"], "dtype": c["dtype"], "family": c["family"],
            "backend": c["backend_label"], "status": c["status"],
            "forward": ms_text(c.get("forward_time_ms")) if ok else "-",  # a replay has no forward
            "compile": _compile(c) if ok and _known(c.get("compile_s")) else "",
            "attention": ms_text(c["attention_time_ms"]) if ok else "-",
            "core": ms_text(c.get("attention_kernel_ms")) if ok else "-",
            "projections": ms_text(c.get("attention_proj_ms")) if ok else "-",
            **_clock(c, ok),
            "attn peak": human_bytes(c["attention_peak_mem_bytes"]) if ok else "-",
            "predicted": human_bytes(c.get("predicted_peak_bytes")),
            "fwd peak": human_bytes(c.get("forward_peak_total_bytes")) if ok else "-",
            "fwd predicted": human_bytes(c.get("predicted_forward_peak_bytes")),
            "ratio": _ratio(c.get("forward_peak_total_bytes"), c.get("predicted_forward_peak_bytes")) if ok else "",
            "of peak": _of_peak(c.get("attention_pct_of_peak"), c.get("attention_roofline_bound")) if ok else "-",
            "rel err": _rel_err(c) if ok and _known(c.get("max_rel_err")) else "-",
            "noisy": "noisy" if ok and c["noisy"] else "",
            "note": (_partial_text(m) if _known(c.get("partial")) and c["partial"] else
                     str(c.get("attention_note") or "")[:90]) if ok else
            str(c["error"])[:90],
        })
    return rows


def _cell_columns(rows: list[dict], twins: dict) -> list[str]:
    """The columns the rows need: settings, compile and graph breaks only where a row has them."""
    eager = ["eager forward", "eager attn peak", "eager fwd peak"] if twins else []
    return ["model"] + (["settings"] if any(r["settings"] != "-" for r in rows) else []) + [
            "size", "batch", "dtype", "family", "backend", "status", "forward"] + (
            ["compile"] if any(r["compile"] for r in rows) else []) + (
            ["graph breaks"] if any(r["graph breaks"] for r in rows) else []) + [
            "attention", *(["core", "projections"] if any(r["core"] != "-" for r in rows) else []),
            *[k for k in ("clock", "bound", "attn host") if any(r[k] for r in rows)], "rel err",
            "attn peak", "predicted", "fwd peak", "fwd predicted", "ratio", "of peak", "noisy",
            *eager, "note"]


def _clock(c: dict, ok: bool) -> dict:
    """A CUDA cell's clock (its time_source), the bound of its plain forward with the GPU's busy share, and its
    attention calls' host time; blank on the CPU, whose one clock is the host's."""
    clock = c.get("time_source")
    if clock in (None, "host clock") or clock != clock:
        return {"clock": "", "bound": "", "attn host": ""}
    busy, bound = c.get("gpu_busy_pct"), c.get("bound")
    return {"clock": clock, "bound": f"{bound}, GPU {busy:.0f}% busy" if ok and isinstance(bound, str) and
            _known(busy) else "", "attn host": ms_text(c.get("attention_host_ms")) if ok and _known(
                c.get("attention_host_ms")) else ""}


def _events_line(cells) -> list[str]:
    """The note under an event-timed CUDA run's table (frame.normalised's time_source "cuda events")."""
    if "time_source" not in cells or not cells["time_source"].eq("cuda events").any():
        return []
    return ["note: this run's CUDA times are cuda events around each call in a hooked forward (recorded before "
            "attnprof timed kernels): the host's time on a host-bound GPU, not kernel time; measure again for it."]


def _footnote(cells) -> str:
    return (f"Rows by family ({', '.join(backends.FAMILIES)}). attention: {ATTENTION_TIME}; {ATTENTION_SPLIT}. "
            "rel err: the output's "
            f"largest error against the reference output ({_references(cells)}: the same weights and inputs), over "
            "its largest value ((!): past the dtype's tolerance); '0 (= ref)': the cell is the reference itself. "
            "compile: seconds flex spent compiling its kernels, or a compiled U-Net its first forward (cold: "
            "Inductor compiled its graphs; warm: they came from its cache), apart from every timed forward; graph "
            "breaks: Dynamo's, where a compiled cell has any. A compiled cell's attention is its attention op alone "
            "(no time where Inductor fused it away: note); eager forward / attn peak / fwd peak: the eager cell of "
            "the same shape and backend in this run. attn peak: the largest call's measured transient; predicted: "
            "its memory model. fwd peak: the forward's peak counted as the planner counts it (weights + inputs + "
            "the forward's transient), beside the planner's prediction from fake tensors (attnprof plan), and their "
            "ratio. of peak: the attention's achieved FLOP/s against the roofline bound that applies (the device's "
            "measured compute peak, or its bandwidth x the calls' FLOPs per byte moved)." + _clock_legend(cells))


def _clock_legend(cells) -> str:
    """The CUDA columns' legend, where the run has them (_clock)."""
    if "time_source" not in cells or cells["time_source"].fillna("host clock").eq("host clock").all():
        return ""
    from ..measure.passes import BUSY_SHARE  # torch: only for a CUDA run's legend

    return (" clock: what timed the attention (time_source: cupti, each call's GPU kernels; cuda events, for CUDA "
            "runs recorded before kernel timing: the host's time on a host-bound GPU). bound: what set the plain "
            f"forward's pace (host where the GPU was busy under {100 * BUSY_SHARE:.0f}% of it), with the GPU's "
            "busy share. attn host: the attention calls' host time (Python, launches) summed.")


def _largest_calls(blocks, width: int | None = None) -> str:
    top = blocks[blocks["status"] == "ok"].sort_values("peak_mem_bytes", ascending=False).head(5)
    rows = [{
        "backend": b["backend_label"], "size": b["size"],
        "block": b["block"], "tokens": f"{b['tokens_q']}x{b['tokens_k']}", "time": f"{b['time_ms']:.2f} ms",
        "peak": human_bytes(b["peak_mem_bytes"]), "predicted": human_bytes(b["predicted_peak_bytes"]),
        "of peak": _of_peak(b.get("pct_of_peak"), b.get("roofline_bound")),
        "kernel": b["kernel"]} for b in top.to_dict("records")]
    columns = [(c, c) for c in ("backend", "size", "block", "tokens", "time", "peak", "predicted", "of peak", "kernel")]
    return table(rows, columns) if width is None else \
        fitted_table(rows, columns, width, ["kernel", "of peak", "predicted", "time", "size"])[0]


def _compile(c: dict) -> str:
    """'18.9 s' (flex's kernels), '18.9 s warm' / '41.0 s cold' (a compiled U-Net, by Inductor's cache)."""
    cache = c.get("compile_cache")
    return f"{c['compile_s']:.1f} s" + (f" {str(cache).split(':')[0]}" if isinstance(cache, str) else "")


def _beside_eager(c: dict, eager: dict | None, ok: bool) -> dict:
    """A compiled cell's graph breaks and, where the run holds its eager twin, the eager figures beside its own."""
    breaks = c.get("graph_breaks")
    out = {"graph breaks": str(int(breaks)) if ok and _known(breaks) and breaks else ""}
    if eager is None:
        return out | {"eager forward": "", "eager attn peak": "", "eager fwd peak": ""}
    return out | {"eager forward": ms_text(eager["forward_time_ms"]),
                  "eager attn peak": human_bytes(eager["attention_peak_mem_bytes"]),
                  "eager fwd peak": human_bytes(eager.get("forward_peak_total_bytes"))}


def tuned_table(blocks: list[dict], width: int | None = None) -> str:
    """A processor map per block (a tune's cell's rows): its shape, the backend chosen, its kernel's time alone, the
    runner-up's and why."""
    rows = [{"block": b["block"], "kind": b["kind"], "shape": f"{b['heads']}x{b['head_dim']} "
             f"{b['tokens_q']}x{b['tokens_k']}", "backend": b["chosen"], "time": f"{b['time_ms']:.3f} ms",
             "runner-up": b.get("runner_up") or "-",
             "its time": f"{b['runner_up_ms']:.3f} ms" if _known(b.get("runner_up_ms")) else "-",
             "why": str(b["why"])} for b in blocks]
    columns = [(c, c) for c in ("block", "kind", "shape", "backend", "time", "runner-up", "its time", "why")]
    return table(rows, columns) if width is None else fitted_table(rows, columns, width, ["its time", "kind"])[0]


def format_tuned(cell: dict, blocks: list[dict], path=None, width: int | None = None) -> str:
    """A tune's map (attnprof tune's output, show's section of a tune run): per block its backend, time, runner-up
    and why; the planned forward peak; the proof's line (findings.tune_line); where the map is."""
    from .findings import tune_line

    if not cell:
        return "no map"
    budget = f", budget {human_bytes(cell['budget_bytes'])}" if _known(cell.get("budget_bytes")) else ""
    lines = [f"the map for {cell['model']} at {cell['width']}x{cell['height']}, batch {cell['batch']}, "
             f"{cell['dtype']} on {cell['device']}{budget}: per block the fastest backend of its shape alone (kernel "
             "time, within the dtype's tolerance of the fp32 reference)", tuned_table(blocks, width)]
    if _known(cell.get("predicted_forward_peak_bytes")):
        lines.append(f"planned forward peak with the map: {human_bytes(cell['predicted_forward_peak_bytes'])} "
                     "(the planner's fake-tensor forward, each block's backend)")
    if path:
        lines.append(f"map: {path}  (attnprof run --backend {path}; profiler.apply(pipe, \"{path}\"))")
    return "\n".join(lines + [tune_line(cell)])


def _tuned_lines(run: Run, cells, blocks, width: int | None) -> list[str]:
    """A tune run's map (format_tuned), where it holds one."""
    mine = cells[cells["backend"].eq("tuned") & cells["status"].eq("ok")] if len(cells) else cells
    out = []
    for c in mine.to_dict("records"):
        rows = blocks[blocks["cell_id"] == c["cell_id"]].sort_values("call_index").to_dict("records")
        if rows and "chosen" in rows[0]:
            out += ["", format_tuned(c, rows, run.path / "tuned.json" if (run.path / "tuned.json").is_file()
                                     else None, width)]
    return out


def format_replay(run: Run) -> str:
    """attnprof replay's output: per cell, each distinct shape's kernel alone (time, TFLOP/s, place on the
    roofline, peak memory) and, for a run's replay, beside the same calls inside the model and the gap."""
    from ..measure.replay import SHAPE

    m = run.manifest()
    env, source = m.get("environment") or {}, (m.get("replay") or {}).get("source")
    cells, blocks = run.read()
    lines = [f"replay {run.id} of {source} on {env.get('device')} ({env.get('device_name')}): each distinct attention "
             "shape, the backend's kernel alone on random Q, K, V (projections handed in), median of the timed "
             "calls", *_limits_line(m)]
    for c in cells.to_dict("records"):
        head = f"{c['model']} {c['size']} batch {c['batch']} {c['dtype']} {c['backend_label']}"
        if c["status"] != "ok":
            lines += ["", f"{head}: {c['status']}: {c['error']}"]
            continue
        mine = blocks[blocks["cell_id"] == c["cell_id"]]
        rows, inside_total = [], 0.0
        for _, g in mine.groupby(list(SHAPE), sort=False):
            b, inside = g.iloc[0], g["in_model_time_ms"].dropna() if "in_model_time_ms" in g else pd.Series([])
            inside_total += float(inside.sum())
            rows.append({"kind": b["kind"], "heads": b["heads"], "hdim": b["head_dim"],
                         "tokens": f"{b['tokens_q']}x{b['tokens_k']}", "calls": len(g),
                         "time": f"{b['time_ms']:.3f} ms", "iqr": f"{b['iqr_ms']:.3f} ms",
                         "n": len(b["time_samples_ms"]), "TFLOP/s": f"{b['achieved_flops_per_s'] / 1e12:.3g}",
                         "of peak": _of_peak(b.get("pct_of_peak"), b.get("roofline_bound")),
                         "peak mem": human_bytes(b["peak_mem_bytes"]), "noisy": "noisy" if b["noisy"] else "",
                         "in model": f"{inside.median():.3f} ms" if len(inside) else "-",
                         "gap": f"{inside.median() - b['time_ms']:+.3f} ms" if len(inside) else "-"})
        alone = f"attention {c['attention_time_ms']:.1f} ms per forward alone"
        versus = f", {inside_total:.1f} ms inside the model" if inside_total else ""
        lines += ["", f"{head}: {c['calls']} calls, {len(rows)} distinct shapes; {alone}{versus}",
                  table(rows, [(k, k) for k in rows[0]])]
    lines += ["", "n: timed calls (at least --repeats, more until the IQR is within 10% of the median); gap: the "
              "call inside the model (projections, launches, copies) less the kernel alone.",
              f"stored: {run.path}  (attnprof show {run.id} --results {run.path.parent}; the dashboard and attnprof "
              "diff read it)"]
    return "\n".join(lines)


def runs_command(results: str) -> int:
    """attnprof runs: the runs under the results folder."""
    print(format_runs(Path(results)))
    return 0


def show_command(run: str, results: str, wide: bool, legend: bool) -> int:
    """attnprof show: a run's summary, fitted to the terminal unless wide."""
    from ..fmt import terminal_width
    from ..store import find_run

    print(format_run(find_run(results, run), None if wide else terminal_width(), legend))
    return 0


def report_command(runs: list[str], html: str | None, results: str) -> int:
    """attnprof report. The HTML file is the view's (dashboards/report.py: the dashboard's charts and tables): it is
    written by `python -m dashboards.report` in a process of its own, so that the core never imports its view."""
    import subprocess
    import sys

    from ..spec import InputError
    from ..store import find_run

    found = [find_run(results, name) for name in runs]
    paths = [str(r.path) for r in found]
    html = html or str(report_path([r.path for r in found]))
    done = subprocess.run([sys.executable, "-m", "dashboards.report", "--html", html, *paths],
                          capture_output=True, text=True)
    if done.returncode == 2:  # an unreadable run, a file that cannot be written: its one line
        raise InputError((done.stderr.strip().splitlines() or ["the report failed"])[-1])
    if done.returncode:
        sys.stderr.write(done.stderr)
        return done.returncode
    out = Path(done.stdout.strip().splitlines()[-1]).resolve()
    print(f"attnprof report: wrote {out} ({out.stat().st_size / 2**20:.1f} MiB, {len(paths)} run(s)); it opens in a "
          "browser with no server and no network")
    return 0


def report_path(runs: list[Path]) -> Path:
    """Where `attnprof report` writes without --out: beside the runs, in the first one's results folder, named by
    them (report-<id>.html; report-<first id>-and-<n>-more.html for several)."""
    more = f"-and-{len(runs) - 1}-more" if len(runs) > 1 else ""
    return runs[0].parent / f"report-{runs[0].name}{more}.html"
