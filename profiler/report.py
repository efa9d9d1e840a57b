"""Plain-text summaries of a stored run (attnprof show)."""
from __future__ import annotations

from .fmt import human_bytes, table
from .store import Run


def format_run(run: Run) -> str:
    m = run.manifest()
    env = m.get("environment", {})
    cells, blocks = run.cells(), run.blocks()
    lines = [f"run {run.id}  ({run.path})",
             f"created {m.get('created_at')}  ended {m.get('ended_at') or 'not yet (running or stopped)'}",
             f"device {env.get('device')} ({env.get('device_name')}), torch {env.get('torch')}, "
             f"diffusers {env.get('diffusers')}, git {str(env.get('git_revision'))[:12]}",
             f"command: {m.get('command')}", ""]
    if not len(cells):
        return "\n".join(lines + [f"no cells recorded yet ({len(m.get('cells', []))} planned)"])
    rows = []
    for c in cells.to_dict("records"):
        ok = c["status"] == "ok"
        rows.append({
            "model": c["model"], "size": f"{c['width']}x{c['height']}", "batch": c["batch"], "dtype": c["dtype"],
            "backend": c["backend"], "status": c["status"],
            "forward": f"{c['forward_time_ms']:.1f} ms" if ok else "-",
            "attention": f"{c['attention_time_ms']:.1f} ms" if ok else "-",
            "attn peak": human_bytes(c["attention_peak_mem_bytes"]) if ok else "-",
            "predicted": human_bytes(c.get("predicted_peak_bytes")),
            "rel err": f"{c['max_rel_err']:.1e}{'' if c['error_ok'] else ' (!)'}" if ok else "-",
            "noisy": "noisy" if ok and c["noisy"] else "",
            "note": "" if ok else str(c["error"])[:90],
        })
    cols = ["model", "size", "batch", "dtype", "backend", "status", "forward", "attention", "attn peak",
            "predicted", "rel err", "noisy", "note"]
    lines.append(table(rows, [(c, c) for c in cols]))
    if len(blocks):
        ok = blocks[blocks["status"] == "ok"]
        top = ok.sort_values("peak_mem_bytes", ascending=False).head(5)
        lines += ["", "largest measured per-call peaks:"]
        lines.append(table([{
            "backend": b["backend"], "size": f"{b['width']}x{b['height']}", "block": b["block"],
            "tokens": f"{b['tokens_q']}x{b['tokens_k']}", "time": f"{b['time_ms']:.2f} ms",
            "peak": human_bytes(b["peak_mem_bytes"]), "predicted": human_bytes(b["predicted_peak_bytes"]),
            "kernel": b["kernel"]} for b in top.to_dict("records")],
            [(c, c) for c in ("backend", "size", "block", "tokens", "time", "peak", "predicted", "kernel")]))
    return "\n".join(lines)
