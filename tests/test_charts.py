"""Issue 20: every chart spec of dashboards/charts.py, as the dashboard and the report really draw it over real runs
that differ in run, model, dtype and backend options (conftest's mixed_results), against the Vega-Lite rules that
matter: the schema, every tooltip entry a field definition with its type and title, and every series a chart draws
split by every field that varies in its data. Then the report in Chromium: no Vega warning in the console, a U-Net
tile's tooltip names its block, and the Scaling legend draws a solid and a dashed line."""
import inspect
import json
import os
from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("streamlit", reason="the dashboard needs streamlit (not on the lent GPU machine)")

from dashboards import charts as C  # noqa: E402
from tests.test_dashboard_app import _app, _charts  # noqa: E402
from tests.test_dashboard_e2e import _MISSING, CHROMIUM, sync_playwright  # noqa: E402

# Fields that say which measured thing a row is: rows that differ in one of them must not be drawn as one series.
IDENTITY = ("run_id", "model", "dtype", "batch", "backend", "backend_label", "aspect", "source", "block")
NOT_SPECS = {"tip", "num", "log_axis", "colour", "call_tooltip", "cell_tooltip", "with_data", "scaling_charts",
             "size_axis", "colours", "coloured"}
OUT = Path(__file__).resolve().parent.parent / "test-output" / "charts-e2e"


def _units(spec: dict, data: pd.DataFrame, encoding: dict | None = None):
    """(mark, encoding, data) of each single-view part of a spec, a layer inheriting its parent's encoding and data
    (filtered by its own transforms)."""
    encoding = {**(encoding or {}), **spec.get("encoding", {})}
    data = pd.DataFrame(spec["data"]["values"]) if "values" in spec.get("data", {}) else data
    for step in spec.get("transform", []):  # the field predicates the specs use
        data = data[data[step["filter"]["field"]] == step["filter"]["equal"]]
    if "concat" in spec:  # small multiples: each panel a view of its own over the same data
        for view in spec["concat"]:
            yield from _units(view, data, encoding)
    elif "layer" in spec:
        for layer in spec["layer"]:
            yield from _units(layer, data, encoding)
    else:
        mark = spec["mark"]["type"] if isinstance(spec["mark"], dict) else spec["mark"]
        yield mark, encoding, data


def violations(spec: dict, data: pd.DataFrame) -> list[str]:
    """What in a spec breaks the rules, given the data drawn with it."""
    found = []
    for mark, encoding, rows in _units(spec, data):
        for entry in encoding.get("tooltip", []):
            if not isinstance(entry, dict) or not {"field", "type", "title"} <= set(entry):
                found.append(f"{mark}: tooltip entry {entry!r} is not a field definition with type and title")
        fields = {ch: d for ch, d in encoding.items() if ch != "tooltip" and isinstance(d, dict) and "field" in d}
        for ch, d in [*fields.items(), *((f"tooltip {t.get('field')}", t) for t in encoding.get("tooltip", [])
                                          if isinstance(t, dict))]:
            if "type" not in d:
                found.append(f"{mark}: {ch} has no type")
            if d.get("field") not in rows:
                found.append(f"{mark}: {ch}'s field {d.get('field')!r} is not in the data")
        if not len(rows) or any(d["field"] not in rows for d in fields.values()):
            continue
        # What tells one drawn series from another: every channel but the measured (quantitative) positions.
        split = sorted({d["field"] for d in fields.values() if d.get("type") != "quantitative"})
        groups = rows.groupby(split, dropna=False) if split else [((), rows)]
        for key, group in groups:
            mixed = [f for f in IDENTITY if f in group and group[f].nunique(dropna=False) > 1]
            if mixed:
                found.append(f"{mark}: the series {dict(zip(split, key))} mixes rows of different {mixed}")
            if mark == "line" and group[fields["x"]["field"]].duplicated().any():
                found.append(f"{mark}: the line {dict(zip(split, key))} has two points at one x")
    return found


def _same(made: dict, shown: dict) -> bool:
    """Whether a spec a function made is the one Streamlit shows (which adds keys of its own, as the app's colours:
    charts.coloured's scales and its shapes or dashes by variant)."""
    def plain(spec):
        if isinstance(spec, dict):
            return {k: plain(v) for k, v in spec.items() if (k != "scale" or "range" not in (v or {}))
                    and not (k in ("shape", "strokeDash") and isinstance(v, dict) and v.get("field") == "variant")}
        return [plain(v) for v in spec] if isinstance(spec, list) else spec
    return all(plain(shown.get(k)) == plain(v) for k, v in json.loads(json.dumps(made)).items())


@pytest.fixture(scope="module")
def schema():
    import altair
    import jsonschema

    path = Path(altair.__file__).parent / "vegalite" / "v6" / "schema" / "vega-lite-schema.json"
    return jsonschema.Draft7Validator(json.loads(path.read_text()))


@pytest.fixture(scope="module")
def drawn(mixed_results, record_results):
    """(spec function, spec, data) of every chart the report and the dashboard's pages draw over the mixed runs, and
    over two recorded generations (conftest's record_results) the Generation page's and the report's."""
    pytest.importorskip("vl_convert", reason="the report embeds vl-convert-python's Vega bundle")
    from dashboards.report import _Charts, _charts_and_sections, _generations
    from dashboards import transforms as T
    from profiler.store import Run

    calls = []
    originals = {n: f for n, f in inspect.getmembers(C, inspect.isfunction) if f.__module__ == C.__name__
                 and not n.startswith("_") and n not in NOT_SPECS}

    def recording(name, fn):
        def wrapper(*args, **kwargs):
            spec = fn(*args, **kwargs)
            if isinstance(spec, dict) and ("mark" in spec or "layer" in spec or "concat" in spec):
                calls.append((name, spec))
            return spec
        return wrapper

    mp = pytest.MonkeyPatch()
    for name, fn in originals.items():
        mp.setattr(C, name, recording(name, fn))
    out = []
    try:
        root, runs = mixed_results.root, [mixed_results.mixed, mixed_results.bf16, mixed_results.again]
        loaded = [T.load_run(root / r) for r in runs]
        cells = pd.concat([c for c, _ in loaded], ignore_index=True)
        blocks = pd.concat([b for _, b in loaded], ignore_index=True)
        calls.clear()
        specs, _ = _charts_and_sections(cells, blocks, [Run.open(root / r) for r in runs])
        assert len(calls) == len(specs)
        out += [(name, spec, pd.DataFrame(s["data"]["values"])) for (name, spec), s in zip(calls, specs)]
        sdxl = cells[(cells["model"] == "tiny-sdxl") & (cells["status"] == "ok")].iloc[0]
        pages = [dict(page="Run", run=runs, cell=f"{sdxl['run_id']}/{sdxl['cell_id']}"),
                 dict(page="Run", run=runs, color="peak memory"), dict(page="Compare", run=runs, by="backend"),
                 dict(page="Compare", run=runs, by="run"), dict(page="Compare", run=runs, by="torch_threads"),
                 dict(page="Scaling", run=runs),
                 dict(page="Planner", plan_model="tiny-sd15", plan_size="128x128", plan_dtype="float32")]
        recorded = [record_results[k] for k in ("loaded", "sliced")]
        cells = pd.concat([T.load_run(record_results["root"] / r)[0] for r in recorded], ignore_index=True)
        calls.clear()
        charts = _Charts()
        _generations(charts, cells, [Run.open(record_results["root"] / r) for r in recorded])
        out += [(name, spec, pd.DataFrame(s["data"]["values"])) for (name, spec), s in zip(calls, charts.specs)]
        beside = f"{recorded[1]}/{cells['cell_id'].iloc[1]}"
        pages += [dict(page="Generation", run=recorded, beside=beside, _root=record_results["root"]),
                  dict(page="Run", run=recorded[:1], _root=record_results["root"])]
        for params in pages:
            calls.clear()
            at = _app(params.pop("_root", root), mp, **params)
            shown = _charts(at)
            assert shown, params
            for spec, data in shown:  # each chart on the page, with the function that made its spec
                name = next(n for n, s in calls if _same(s, spec))
                out.append((name, spec, data))
    finally:
        mp.undo()
    return out


def test_every_spec_function_is_drawn_and_keeps_the_rules(drawn, schema):
    spec_functions = {n for n, f in inspect.getmembers(C, inspect.isfunction)
                      if f.__module__ == C.__name__ and not n.startswith("_")} - NOT_SPECS
    assert {name for name, _, _ in drawn} == spec_functions  # a new spec function must be drawn here too
    for name, spec, data in drawn:
        assert violations(spec, data) == [], name
        errors = [e.message[:200] for e in schema.iter_errors(C.with_data(spec, data))]
        assert errors == [], (name, errors)


def test_the_data_really_varies_so_the_rules_bite(drawn):
    """The series rule is empty on data where nothing varies: here the charts that compare cells hold several runs,
    models, dtypes and backend options."""
    for name in ("time_against_peak", "scaling_time", "scaling_peak", "ratio_to_baseline"):
        data = next(d for n, _, d in drawn if n == name)
        assert {f: data[f].nunique() > 1 for f in ("run_id", "model", "dtype", "backend_label")} == dict.fromkeys(
            ("run_id", "model", "dtype", "backend_label"), True), name
        assert "sliced(slice_size=4)" in set(data["backend_label"]) and "sliced" in set(data["backend_label"])
    time = next(s for n, s, _ in drawn if n == "scaling_time")
    assert [v["title"] for v in time["concat"]] == ["tiny-sd15 float32", "tiny-sd15 bfloat16", "tiny-sdxl float32"]
    assert time["concat"][0]["encoding"]["color"]["title"] == "backend, run"  # bf16 and again hold the same sizes


def test_the_rules_catch_what_issue_20_found(drawn):
    """The specs as they were: bare tooltip names, and Scaling's lines split by backend and run only."""
    name, spec, data = next(d for d in drawn if d[0] == "scaling_time")
    old = {"mark": {"type": "line", "point": True, "tooltip": True}, "encoding": {
        "x": C.log_axis("pixels", "pixels"), "y": C.log_axis("attention_time_ms", "time (ms)"),
        "color": {"field": "backend_label", "type": "nominal", "title": "backend"},
        "detail": {"field": "run_id", "type": "nominal"}, "tooltip": ["size", "backend_label", "run_id"]}}
    found = violations(old, data)
    assert "line: tooltip entry 'size' is not a field definition with type and title" in found
    assert any("mixes rows of different ['model']" in f for f in found), found  # two models on one line
    unet = next(d for d in drawn if d[0] == "unet_map")
    old_unet = {**unet[1], "encoding": {**unet[1]["encoding"], "tooltip": ["block", "kind"]}}
    assert len(violations(old_unet, unet[2])) == 2


@pytest.mark.skipif(_MISSING and sync_playwright is None, reason="playwright is not installed: pip install playwright")
@pytest.mark.skipif(_MISSING and not os.access(CHROMIUM, os.X_OK), reason=f"no {CHROMIUM}: apt-get install chromium")
def test_the_report_draws_without_warnings_and_its_tooltips_and_legends_say_what_they_show(mixed_results, browser):
    pytest.importorskip("vl_convert", reason="the report embeds vl-convert-python's Vega bundle")
    from profiler.cli import main

    OUT.mkdir(parents=True, exist_ok=True)
    out = OUT / "report.html"
    assert main(["report", mixed_results.mixed, mixed_results.bf16, "--results", str(mixed_results.root),
                 "--html", str(out)]) == 0
    messages = []
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        page.on("console", lambda m: messages.append(f"{m.type}: {m.text}"))
        page.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file://")
                   else route.abort())
        page.goto(out.as_uri())
        page.wait_for_function("document.body.dataset.rendered === document.body.dataset.charts", timeout=60_000)
        assert int(page.locator("body").get_attribute("data-charts")) == 8  # 2 U-Nets, Compare, roofline, 4 Scaling
        page.locator("#chart0 svg .mark-rect path").first.hover()
        tooltip = page.locator("#vg-tooltip-element")
        tooltip.wait_for(state="visible", timeout=10_000)
        lines = tooltip.inner_text().split()
        assert lines[0] == "block" and lines[1].startswith("down_blocks.") and lines[1].endswith(".attn1")
        assert "kind" in lines and "tokens" in lines and "time" in lines
        dash = page.evaluate("""() => {
            const legends = Array.from(document.querySelectorAll('.chart svg .role-legend'));
            const mine = legends.find(l => l.textContent.includes('measured'));
            return Array.from(mine.querySelectorAll('.role-legend-symbol path')).map(p => [
                p.getAttribute('d'), p.getAttribute('stroke'), p.getAttribute('stroke-dasharray')]);
        }""")
        assert [(d.startswith("M-") and "L" in d and "A" not in d, stroke, dashes) for d, stroke, dashes in dash] \
            == [(True, "black", "1,0"), (True, "black", "6,4")]  # a solid and a dashed line, not two dots
        page.screenshot(path=str(OUT / "report.png"), full_page=True)
    finally:
        page.close()
    assert messages == []  # no 'Dropping ... from channel "tooltip"', no version mismatch, nothing


def test_a_backend_keeps_its_colour_and_no_two_series_of_a_chart_share_one():
    """Fourteen backends of ours, one series each: fourteen colours, each backend's own (the same on every page and
    in the report: the app's chart() and with_data() both colour through charts.coloured); with a second run beside
    (labels naming the run too), twenty-eight series still share no colour up to the palette's twenty, and where
    they pass it every one of the twenty is used before any repeats."""
    own = list(C.OWN_COLOUR)
    assert len(own) == 14 and len(set(C.colours(own))) == 14
    assert C.colours(own) == [C.OWN_COLOUR[b] for b in own]
    assert C.colours(["sdpa", "naive"]) == [C.OWN_COLOUR["sdpa"], C.OWN_COLOUR["naive"]]  # whatever else is drawn
    mixed = [f"{b} run-a" for b in own[:10]] + own[:10]
    assert len(set(C.colours(mixed))) == 20
    data = pd.DataFrame({"label": own, "x": range(14), "y": range(14)})
    spec = C.coloured({"layer": [{"mark": "point", "encoding": {"color": C.colour("label", "backend")}}]}, data)
    scale = spec["layer"][0]["encoding"]["color"]["scale"]
    assert sorted(scale["domain"]) == sorted(own) and len(set(scale["range"])) == 14
    assert dict(zip(scale["domain"], scale["range"]))["xformers"] == C.OWN_COLOUR["xformers"]


def test_the_second_dimension_is_a_dash_or_a_shape_and_the_main_variant_keeps_the_backends_colours():
    """Seven backends in one run, two of them in a second too (transforms.labelled names the run): the first run's
    series keep their backends' own colours, the second's take free ones; a line is dashed (and its points
    shaped: a dash alone draws a blank legend) and a point shaped by the run, unless the spec already uses that."""
    from dashboards import transforms as T

    rows = [(b, "run-a") for b in list(C.OWN_COLOUR)[:7]] + [("naive", "run-b"), ("sdpa", "run-b")]
    data, title = T.labelled(pd.DataFrame(rows, columns=["backend_label", "run_id"]))
    assert title == "backend, run" and list(data["variant"]) == ["run-a"] * 7 + ["run-b"] * 2
    line = C.coloured({"mark": {"type": "line"}, "encoding": {"color": C.colour("label", title)}}, data)
    enc = line["encoding"]
    colour_of = dict(zip(enc["color"]["scale"]["domain"], enc["color"]["scale"]["range"]))
    assert colour_of["naive run-a"] == C.OWN_COLOUR["naive"] and colour_of["sdpa run-a"] == C.OWN_COLOUR["sdpa"]
    assert len(set(colour_of.values())) == 9
    assert colour_of["naive run-b"] not in {C.OWN_COLOUR[b] for b in data["backend_label"]}
    assert enc["strokeDash"] == enc["shape"] and enc["shape"]["field"] == "variant" and enc["shape"]["title"] == "run"
    point = C.coloured({"mark": "point", "encoding": {"color": C.colour("label", title)}}, data)
    assert point["encoding"]["shape"]["field"] == "variant" and "strokeDash" not in point["encoding"]
    shaped = C.coloured({"mark": "point", "encoding": {"color": C.colour("label", title),
                                                      "shape": C.colour("size", "size")}}, data)
    assert shaped["encoding"]["shape"]["field"] == "size"  # the spec's own shape stays
    one_run = T.labelled(pd.DataFrame({"backend_label": ["naive", "sdpa"]}))[0]
    plain = C.coloured({"mark": {"type": "line"}, "encoding": {"color": C.colour("label", "backend")}}, one_run)
    assert set(plain["encoding"]) == {"color"}  # one variant: nothing to tell apart


@pytest.mark.skipif(_MISSING and sync_playwright is None, reason="playwright is not installed: pip install playwright")
@pytest.mark.skipif(_MISSING and not os.access(CHROMIUM, os.X_OK), reason=f"no {CHROMIUM}: apt-get install chromium")
def test_the_report_of_recorded_generations(record_results, browser, tmp_path):
    """Issue 53: `attnprof report` of two recorded generations, with no --out: written beside the runs and said so;
    each component's calls in a chart of its own (the VAE's mid-block call never in the U-Net's level rows, the
    text encoder's layers as bars); the memory charts, empty on the CPU, say why; the per-component table a real
    table (no JSON in it); every chart drawn in Chromium with no console message."""
    import contextlib
    import io
    import re
    import shutil

    pytest.importorskip("vl_convert", reason="the report embeds vl-convert-python's Vega bundle")
    from profiler.cli import main

    root = tmp_path / "results"
    ids = [record_results["loaded"], record_results["sliced"]]
    for run_id in ids:  # a copy: the shared runs are never written into
        shutil.copytree(record_results["root"] / run_id, root / run_id)
    with contextlib.redirect_stdout(io.StringIO()) as said:
        assert main(["report", *ids, "--results", str(root)]) == 0
    out = root / f"report-{ids[0]}-and-1-more.html"
    assert said.getvalue().startswith(f"attnprof report: wrote {out} (") and out.is_file()
    text = out.read_text()
    specs = [json.loads(s) for s in re.findall(r'vegaEmbed\("#chart\d+", (\{.*\}), \{actions', text)]
    blocks = [[r.get("block") for r in s["data"]["values"]] for s in specs if "block" in s["data"]["values"][0]]
    assert [(len(b), {x.split(".")[0] for x in b}) for b in blocks] == [
        (32, {"down_blocks", "mid_block", "up_blocks"}), (2, {"text_encoder"}), (1, {"vae"})] * 2
    page = re.sub(r"<script>.*?</script>", "", text, flags=re.S)
    for title in ("Compare: attention time against peak memory, per size",
                  "Scaling: the largest call&#x27;s peak memory, measured and predicted"):
        assert f"<h3>{title}</h3><p>No peak memory to draw: these are generations recorded on the CPU" in page
    components = page.split("<h4>Per component</h4>")[1].split("</table>")[0]
    assert "<th>component</th>" in components and "<td>CLIPTextModel</td>" in components
    assert '{"component"' not in page and "[{&quot;" not in page
    messages = []
    view = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        view.on("console", lambda m: messages.append(f"{m.type}: {m.text}"))
        view.goto(out.as_uri())
        view.wait_for_function("document.body.dataset.rendered === document.body.dataset.charts", timeout=60_000)
        assert int(view.locator("body").get_attribute("data-charts")) == len(specs) == 2 + 6 + 3
        view.screenshot(path=str(OUT / "report-recorded.png"), full_page=True)
    finally:
        view.close()
    assert messages == []
