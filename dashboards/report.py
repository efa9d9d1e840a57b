"""attnprof report RUN [RUN ...] --html FILE: one self-contained HTML file with each run's environment, the U-Net
map, the Compare and Scaling charts and the cells table. It opens in a browser with no server and no network: the
chart library (Vega, Vega-Lite and Vega-Embed, from vl-convert's bundle) and the data are inside the file. The
dashboard's Run and Compare pages offer the same file as a download."""
from __future__ import annotations

import datetime as dt
import html
import json
from pathlib import Path

import pandas as pd

from dashboards import charts as C
from dashboards import generations as G
from dashboards import transforms as T
from profiler.env import cache_dir
from profiler.report.compare import ATTENTION_SPLIT, ATTENTION_TIME
from profiler.store import Run, write_cache


def _bundle() -> str:
    """vl-convert's JavaScript bundle of Vega, Vega-Lite and vega-embed (sets window.vegaEmbed; about 0.9 MB, 1.8 s of
    CPU to build here), built once per vl-convert version and kept in attnprof's cache folder (profiler.env)."""
    import vl_convert

    path = cache_dir() / f"vega-bundle-vl-convert-{vl_convert.__version__}.js"
    try:
        return path.read_text()
    except OSError:  # not built yet (or unreadable): build it
        text = vl_convert.javascript_bundle()
        write_cache(path, text)
        return text


def _cell(v) -> str:
    """A table cell's text: empty for a missing value; a list (trace_files) as its items."""
    if hasattr(v, "__len__") and not isinstance(v, str):
        return ", ".join(map(str, v))
    return "" if v is None or v != v else str(v)


def _table(df: pd.DataFrame, cls: str = "") -> str:
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in df.columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_cell(v))}</td>" for v in row) + "</tr>"
                   for row in df.itertuples(index=False))
    return f'<div class="scroll"><table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


class _Charts:
    """The report's charts in order: each spec with its data inline, and its place in the page (a heading, a note,
    the element vegaEmbed draws into)."""

    def __init__(self):
        self.specs: list[dict] = []

    def add(self, title: str, spec: dict, data: pd.DataFrame, note: str = "", level: int = 3) -> str:
        self.specs.append(C.with_data(spec, data))
        return (f"<h{level}>{html.escape(title)}</h{level}>{f'<p>{html.escape(note)}</p>' if note else ''}"
                f'<div class="chart" id="chart{len(self.specs) - 1}"></div>')


def _maps(charts: _Charts, ok: pd.DataFrame, blocks: pd.DataFrame, runs: list[Run]) -> list[str]:
    """Each run's largest ok cell drawn per component, each in a chart of its own (transforms.by_component: a
    recorded generation's VAE and text encoder never in the U-Net's rows): on the U where its calls are, as bars
    (a text encoder's layers) where not, coloured by each call's median time."""
    sections = []
    for run in runs:
        mine = ok[ok["run_id"] == run.id].sort_values(["pixels", "attention_time_ms"], ascending=[False, False])
        if not len(mine) or not len(blocks):
            continue
        cell = mine.iloc[0]
        cell_blocks = blocks[(blocks["run_id"] == run.id) & (blocks["cell_id"] == cell["cell_id"])]
        unit = T.with_mem_unit(cell_blocks, ["peak_mem_bytes", "predicted_peak_bytes"])[1]
        for component, rows in T.by_component(cell_blocks):
            layout = T.with_mem_unit(T.unet_layout(rows), ["peak_mem_bytes", "predicted_peak_bytes"], unit)[0]
            what = f"{cell['model']} {cell['size']} {cell['backend_label']} {cell['dtype']}"
            if not component:
                sections.append(charts.add(f"The U-Net of run {run.id}: {what}", C.unet_map("time_ms", "time (ms)",
                                                                                            unit), layout,
                                           "down, mid and up by level; each tile one attention call (self | cross), "
                                           "coloured by its median time"))
                continue
            spec = C.unet_map("time_ms", "time (ms)", unit) if T.mapped(layout) else \
                C.call_bars("time_ms", "time per call (ms)", unit, len(layout))
            sections.append(charts.add(f"{T.component_title(component, layout)}; run {run.id}: {what}", spec,
                                       layout, "coloured by each call's median time"))
    return sections


def _memory_note(title: str, cells: pd.DataFrame) -> str:
    """In place of a memory chart with nothing to draw: its title and why it is empty."""
    return f"<h3>{html.escape(title)}</h3><p>{html.escape(T.no_peaks_reason(cells))}</p>"


def _charts_and_sections(cells: pd.DataFrame, blocks: pd.DataFrame, runs: list[Run],
                         charts: _Charts | None = None) -> tuple[list, list[str]]:
    charts = charts or _Charts()
    ok = cells[cells["status"] == "ok"] if len(cells) else cells
    sections = _maps(charts, ok, blocks, runs)
    compare = "Compare: attention time against peak memory, per size"
    if len(ok) and T.no_peaks_reason(ok):
        sections.append(_memory_note(compare, ok))
    elif len(ok):
        cmp, unit = T.with_mem_unit(ok, ["attention_peak_mem_bytes"])
        cmp, legend = T.labelled(cmp, T.CELL_SERIES)
        sections.append(charts.add(compare, C.time_against_peak(T.options(ok, "size"), unit, legend), cmp))
    points = T.roofline_points(blocks)
    lines = T.roofline_lines(cells, points)
    if len(lines):
        points, legend = T.labelled(points)
        sections.append(charts.add(
            "Roofline: each call against the device's measured limits", C.roofline(lines, legend), points,
            "each point one attention call: its FLOPs over its median time against its FLOPs per byte moved (the "
            "backend's model); dashed, the device's memory bandwidth and compute peak as the run measured them"))
    scale = T.scaling_table(blocks) if len(blocks) else pd.DataFrame()
    for title, spec, data in C.scaling_charts(scale) if len(scale) else []:
        peaks = "peak" in title and data["peak_bytes"].isna().all()
        sections.append(_memory_note(title, ok) if peaks else charts.add(title, spec, data))
    return charts.specs, sections


def _generations(charts: _Charts, cells: pd.DataFrame, runs: list[Run]) -> str:
    """Each recorded generation's page (the dashboard's Generation page): what it was, per component its forwards'
    time and attention's share (a table), per step its attention (a chart), per pipeline call, the costliest
    blocks."""
    out = []
    paths = {r.id: r.path for r in runs}
    for cell in G.recorded(cells).to_dict("records"):
        label = G.generation_label(cell)
        calls = G.load_calls(paths[cell["run_id"]], cell["cell_id"])
        steps = G.step_table(calls, label)
        out.append(f"<h3>{html.escape(label)}</h3><p>{html.escape(G.generation_line(cell))}</p>"
                   f"<h4>Per component</h4>{_table(T.display(G.component_table(cell).drop(columns=['cell'])))}")
        if not len(calls):
            out.append("<p>No attention call of this generation was recorded (its components' calls say why: "
                       "compiled, or a kind of module attnprof has no hook for); its forwards' times stand.</p>")
            continue
        if len(steps):
            steps, legend = T.labelled(steps, ("component", "generation"))
            out.append(charts.add("Per step: each denoising step's attention time",
                                  {**C.step_times(legend), "width": C.PANEL_WIDTH * 2}, steps, level=4))
        out.append(f"<h4>Per generation</h4>{_table(T.display(G.generations_table(calls, cell).drop(columns=['cell'])))}"
                   f"<h4>The costliest blocks (all their calls summed)</h4>"
                   f"{_table(T.display(G.costliest_blocks(calls, label).drop(columns=['cell'])))}")
        if cell.get("notes"):
            out.append(f"<p>Notes: {html.escape(cell['notes'])}</p>")
    return "".join(out)


def _json(spec: dict) -> str:
    """JSON that is safe inside a <script> element."""
    return json.dumps(spec, default=str).replace("</", "<\\/")


def _maps_section(cells: pd.DataFrame, blocks: pd.DataFrame) -> str:
    """The runs' processor maps (attnprof tune), where they hold any: each map's proof and its table per block."""
    tuned, proofs = T.tuned_maps(cells, blocks)
    if not len(tuned):
        return ""
    return (f"<h2>Processor maps</h2><p>attnprof tune: per block the fastest backend of its shape alone (within the "
            f"dtype's tolerance), the runner-up's time and why.</p>{''.join(f'<p>{html.escape(p)}</p>' for p in proofs)}"
            f"{_table(T.display(tuned), 'tuned')}")


def render(paths: list[Path]) -> str:
    runs = [Run.open(p) for p in paths]
    loaded = [T.load_run(r.path) for r in runs]
    cells, blocks = T.joined(c for c, _ in loaded), T.joined(b for _, b in loaded)
    env = T.run_envs(paths).set_index("run_id").T.reset_index(names="").fillna("")
    meta = pd.DataFrame([{"run": r.id, "created": r.manifest().get("created_at"),
                          "ended": r.manifest().get("ended_at"), "command": r.manifest().get("command")}
                         for r in runs])
    charts = _Charts()
    generations = _generations(charts, cells, runs) if len(cells) else ""
    specs, sections = _charts_and_sections(cells, blocks, runs, charts)
    found = "".join(f"<h3>{html.escape(run)}</h3><ul>{''.join(f'<li>{html.escape(s)}</li>' for s in sentences)}</ul>"
                    for run, sentences in T.run_findings(cells, blocks).items() if sentences)
    if len(cells):
        cells = cells.assign(_family=T.family_order(cells)).sort_values(["run_id", "_family"], kind="stable")
    shown = T.display(T.cells_table(cells)) if len(cells) else pd.DataFrame()
    families = T.display(T.family_table(cells)) if len(cells) else pd.DataFrame()
    maps = _maps_section(cells, blocks)
    names = ", ".join(r.id for r in runs)
    embeds = "\n".join(f'vegaEmbed("#chart{i}", {_json(s)}, {{actions: false, renderer: "svg"}}).then(() => done());'
                       for i, s in enumerate(specs))
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>attnprof report: {html.escape(names)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2rem; color: #222; }}
table {{ border-collapse: collapse; font-size: 12px; margin: 0.5rem 0 1.5rem; }}
th, td {{ border: 1px solid #ddd; padding: 3px 6px; text-align: left; white-space: nowrap; }}
th {{ background: #f3f3f3; }} p {{ color: #555; max-width: 60rem; }}
.scroll, .chart {{ max-width: 100%; overflow-x: auto; }} .chart {{ margin-bottom: 1.5rem; }}
</style></head>
<body data-charts="{len(specs)}" data-rendered="0">
<h1>attnprof report</h1>
<p>Runs {html.escape(names)}; written {dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")} by attnprof
report. Times: {html.escape(ATTENTION_TIME)} (a call's time: the median of its timed calls);
{html.escape(ATTENTION_SPLIT)}; peaks are each call's
transient peak over what was held when it began. Everything, the chart library included, is in this file: it needs no server and no network.</p>
<h2>Findings</h2>{found or "<p>No cells recorded.</p>"}
<h2>Runs and environment</h2>{_table(meta)}{_table(env, "env")}
{f"<h2>Recorded generations</h2>{generations}" if generations else ""}
<h2>Charts</h2>{"".join(sections) or "<p>No cell ended ok: nothing to draw.</p>"}
<h2>Backends by family</h2><p>Reference, chunked, fused exact and fused approximate: each backend's attention time
beside its error against the fp32 reference (max_rel_err; error_ok: within the dtype's tolerance).</p>
{_table(families, "families") if len(families) else "<p>No cell ended ok.</p>"}
<h2>Cells</h2>{_table(shown, "cells") if len(shown) else "<p>No cells recorded.</p>"}
{maps}
<script>{_bundle()}</script>
<script>
let rendered = 0;
function done() {{ rendered += 1; document.body.dataset.rendered = String(rendered); }}
{embeds}
</script>
</body></html>
"""


def write(paths: list[Path], out: Path) -> Path:
    """Render, then replace `out` in one step: a failed write leaves any file already there as it was."""
    out = Path(out)
    text = render(paths)
    part = out.with_name(f".{out.name}.part")
    try:
        part.write_text(text)
        part.replace(out)
    except OSError:
        part.unlink(missing_ok=True)
        raise
    return out


def main(argv=None) -> int:
    """python -m dashboards.report --html FILE RUN_FOLDER ...: what attnprof report runs, as a process of its own so
    that the core never imports its view. An unreadable run or a file that cannot be written: one line on stderr and
    exit code 2 (the CLI says it as its own error); the file's path on stdout."""
    import argparse
    import sys

    from profiler.spec import InputError

    p = argparse.ArgumentParser(prog="python -m dashboards.report")
    p.add_argument("--html", required=True)
    p.add_argument("runs", nargs="+")
    args = p.parse_args(argv)
    try:
        out = write([Path(r) for r in args.runs], Path(args.html))
    except OSError as e:
        print(f"cannot write the report to {args.html} ({e.strerror}): choose another --html path", file=sys.stderr)
        return 2
    except InputError as e:
        print(e, file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
