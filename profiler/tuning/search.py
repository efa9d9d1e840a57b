"""attnprof tune's search: each distinct call shape of a forward (replay.SHAPE: batch, heads, head_dim, tokens of
queries and keys, kind, upcast), every candidate backend on that call alone, and per block the fastest.

- Candidates: the backends given, else every registered one whose kernel is its own (not a diffusers dispatcher
  alias of one of ours: backends.kernel_of) and that compiles nothing per shape (flex: --backend flex times it),
  that runs here at one of the model's head dims at least.
- Per shape: a backend that refuses the call (backends.call_refusal) or does not run at its head dim (availability)
  is left out with why; each other one's output on the shape's random Q, K, V (replay.output_of) against the fp32
  reference backend's on the same values, within the dtype's tolerance (rows.TOLERANCE); its kernel alone timed by
  replay.measure_shape (kernel time on CUDA, warm-up and repeats until the IQR is small), once per round in ABBA
  rounds across the shape's backends (rounds.interleaved). Its figure is the least of its rounds' medians: other
  work on the machine only adds time, and a round it disturbs draws more samples (measure_shape repeats until the
  IQR is small), so pooling them would weigh the disturbed round most; the rounds' samples pooled give the IQR and
  the noise rule between a block's choice and its runner-up.
- Per block (a call of the forward): the fastest backend of its shape within tolerance; with a budget, the fastest
  whose transient keeps the whole forward within it (planner/forward.py's trace: the bytes alive when the call
  begins plus the backend's transient, over the weights and inputs); the runner-up among those, and why.
- The best single backend: the one that runs every call within tolerance (and, with a budget, whose planned forward
  peak fits) with the least summed kernel time."""
from __future__ import annotations

from dataclasses import replace

from ..attention import backends
from .. import devices
from ..fmt import human_bytes
from ..measure.probes import summarize
from ..measure.replay import SHAPE, measure_shape, output_of, shape_of
from ..measure.rounds import interleaved
from ..measure.rows import TOLERANCE
from ..report.compare import IMPROVEMENT, THRESHOLD, time_verdict
from ..spec import CellSpec, InputError

ROUNDS = 2  # ABBA rounds per shape: each backend's kernel timed early and late


def key_of(name: str, options: dict) -> tuple:
    """A candidate: (backend, its options as sorted pairs), as a cell spec holds them."""
    return name, tuple(sorted(options.items()))


def label_of(key: tuple) -> str:
    return backends.label(key[0], dict(key[1]))


def spec_of(base: CellSpec, key: tuple) -> CellSpec:
    return replace(base, backend=key[0], backend_options=key[1])


def default_names() -> list[str]:
    """Every registered backend whose kernel is its own and that compiles nothing per shape."""
    return [n for n in backends.names() if backends.kernel_of(n) == n and not backends.compiles(n)]


def candidates(names: list[str] | None, options: dict, device: str, dtype: str,
               head_dims: tuple[int, ...]) -> tuple[list[tuple], dict[str, str]]:
    """(the candidates that run here at one of the head dims at least, {label: why} of those given or registered
    under their own name that do not; a dispatcher backend that runs nowhere here is left out unsaid)."""
    if options and not names:
        raise InputError(f"--option {', '.join(f'{k}={v}' for k, v in options.items())} needs --backend NAME: "
                         "options are a backend's, and tune times every backend by default")
    keys, left = [], {}
    for name in names or default_names():
        opts = backends.check_options(name, options)
        answers = [backends.availability(name, device, dtype, (d,)) for d in head_dims]
        if any(ok for ok, _ in answers):
            keys.append(key_of(name, opts))
        elif names or not backends.dispatched(name):
            left[backends.label(name, opts)] = answers[0][1]
    if not keys:
        raise InputError(f"no backend to tune runs on {device} in {dtype}: "
                         + "; ".join(f"{k}: {v}" for k, v in left.items())[:300])
    return keys, left


def distinct(rows: list[dict]) -> dict[tuple, dict]:
    """Each distinct shape of the calls, with its first call."""
    out: dict[tuple, dict] = {}
    for row in rows:
        out.setdefault(shape_of(row), row)
    return out


def _refusal(key: tuple, row: dict, base: CellSpec) -> str:
    why = backends.call_refusal(key[0], row, dict(key[1]))
    if why:
        return why
    ok, why = backends.availability(key[0], base.device, base.dtype, (row["head_dim"],))
    return "" if ok else why


def _errors(shape: dict, keys: list[tuple], base: CellSpec) -> tuple[dict, dict]:
    """({key: its output's largest error against the fp32 reference's, over the reference's largest value}, {key: why
    it could not run the shape})."""
    ref_spec = replace(base, backend=backends.REFERENCE_BACKEND, dtype=backends.REFERENCE_DTYPE, backend_options=())
    with devices.full_fp32():
        reference = output_of(shape, ref_spec)
    scale = max(float(reference.abs().max()), 1e-12)
    errors, failed = {}, {}
    for key in keys:
        try:
            errors[key] = float((output_of(shape, spec_of(base, key)) - reference).abs().max()) / scale
        except backends.KERNEL_ERRORS as e:  # a kernel that refuses the shape at run time, or runs out of memory:
            # left out of it, with what it said (anything else is a bug of ours: it propagates)
            failed[key] = _failure(e, base.device)
    return errors, failed


def _failure(e: Exception, device: str) -> str:
    devices.get(device).release()
    return devices.oom_message(e) or f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"


def _timed(shape: dict, keys: list[tuple], base: CellSpec, repeats: int, warmup: int,
           rounds: int) -> tuple[dict, dict]:
    """({key: measure_shape's figures: time_ms the least of its rounds' medians (rounds_ms), the rounds' samples
    pooled (time_samples_ms, their IQR and noisy flag)}, {key: why it failed}), each backend's kernel timed once per
    round in ABBA rounds."""
    runs: dict[tuple, list[dict]] = {key: [] for key in keys}
    failed: dict[tuple, str] = {}

    def sampler(key):
        def sample() -> float:
            if key in failed:
                return float("nan")
            try:
                runs[key].append(measure_shape(shape, spec_of(base, key), repeats, warmup))
                return runs[key][-1]["time_ms"]
            except backends.KERNEL_ERRORS as e:  # an OOM or a refusal at this shape: left out of it (not a bug)
                failed[key] = _failure(e, base.device)
                return float("nan")
        return sample

    interleaved({key: sampler(key) for key in keys}, rounds)
    pooled = {}
    for key, figures in runs.items():
        if key not in failed:
            samples = [s for f in figures for s in f["time_samples_ms"]]
            rounds_ms = [f["time_ms"] for f in figures]
            pooled[key] = {**figures[-1], **summarize(samples), "time_samples_ms": samples, "rounds_ms": rounds_ms,
                           "time_ms": min(rounds_ms)}
    return pooled, failed


def measure_shapes(rows: list[dict], keys: list[tuple], base: CellSpec, repeats: int, warmup: int,
                   rounds: int = ROUNDS, say=lambda line: None) -> dict[tuple, dict]:
    """Per distinct shape: {"row": its first call, "figures": {key: figures with max_rel_err and error_ok},
    "refused": {key: why it does not run the shape}}."""
    out = {}
    for shape_key, row in distinct(rows).items():
        shape = {**dict(zip(SHAPE, shape_key)), "block": row["block"]}
        refused = {key: why for key in keys if (why := _refusal(key, row, base))}
        errors, failed = _errors(shape, [k for k in keys if k not in refused], base)
        timed, failed_timing = _timed(shape, list(errors), base, repeats, warmup, rounds)
        refused.update(failed)
        refused.update(failed_timing)
        tolerance = TOLERANCE[base.dtype]
        out[shape_key] = {"row": row, "refused": refused, "figures": {
            key: {**f, "max_rel_err": errors[key], "error_ok": errors[key] <= tolerance} for key, f in timed.items()}}
        best = min(timed, key=lambda k: timed[k]["time_ms"], default=None)
        say(f"{row['kind']} {row['heads']}x{row['head_dim']} {row['tokens_q']}x{row['tokens_k']}: "
            + ", ".join(f"{label_of(k)} {f['time_ms']:.3f} ms" for k, f in sorted(
                timed.items(), key=lambda kf: kf[1]["time_ms"])) + (f" (fastest {label_of(best)})" if best else ""))
    return out


def fits_budget(traced: dict, budget: int):
    """fits(row, key): whether the call under that backend keeps the forward within the budget, by the planner's
    trace of this forward (traced: planner/forward.trace's output for the candidates): the bytes alive when the call
    begins plus the backend's transient, over the weights and inputs. A backend the trace has no figure for does
    not fit."""
    base = traced["weights_bytes"] + traced["inputs_bytes"]
    if base + traced["outside_peak_bytes"] > budget:
        raise InputError(f"the forward outside attention alone peaks at "
                         f"{human_bytes(base + traced['outside_peak_bytes'])} (weights, inputs and activations): over "
                         f"the budget {human_bytes(budget)} whatever the backends; give a larger --budget, a smaller "
                         "--size or --batch")
    by_block = {r["block"]: r for r in traced["rows"]}

    def fits(row: dict, key: tuple) -> bool:
        t = by_block[row["block"]]
        return key[0] in t["traced_peak_bytes"] and base + t["live_at_start_bytes"] + \
            t["traced_peak_bytes"][key[0]] <= budget
    return fits


def check_budget(traced: dict, keys: list[tuple], budget: int):
    """fits_budget's fits, once every call has a candidate that fits (before anything is timed); else one line
    naming the first call none fits and the least it needs."""
    fits = fits_budget(traced, budget)
    for row in traced["rows"]:
        if not any(fits(row, key) for key in keys):
            least = min((n for k in keys if (n := need_bytes(traced, row, k)) is not None), default=None)
            raise InputError(f"no backend keeps the forward within the budget {human_bytes(budget)} at {row['block']} "
                             f"({row['tokens_q']}x{row['tokens_k']} tokens; the least it needs: "
                             f"{human_bytes(least)}): give a larger --budget, a smaller --size, or more backends")
    return fits


def need_bytes(traced: dict, row: dict, key: tuple) -> int | None:
    """The forward's peak at this call under that backend (planner/forward.py's trace)."""
    t = next(r for r in traced["rows"] if r["block"] == row["block"])
    peak = t["traced_peak_bytes"].get(key[0])
    return None if peak is None else traced["weights_bytes"] + traced["inputs_bytes"] + t["live_at_start_bytes"] + peak


def choose(rows: list[dict], shapes: dict[tuple, dict], fits=None, need=None, budget: int | None = None) -> dict:
    """Per block: the fastest backend of its shape within tolerance (with fits: that keeps the forward within the
    budget), as a map entry: its backend, options and time, the runner-up among those it was chosen from, why."""
    out = {}
    for row in rows:
        m = shapes[shape_of(row)]
        figures = m["figures"]
        ranked = sorted((k for k, f in figures.items() if f["error_ok"]), key=lambda k: figures[k]["time_ms"])
        fitting = [k for k in ranked if fits is None or fits(row, k)]
        if not fitting:
            raise InputError(f"no backend runs {row['block']} ({row['tokens_q']}x{row['tokens_k']} tokens) within "
                             + (f"the budget {human_bytes(budget)}: give a larger --budget, or more backends"
                                if ranked else "its dtype's tolerance: " + _others(m, None)[:200]))
        pick, runner = fitting[0], (fitting[1:] or [None])[0]
        f = figures[pick]
        out[row["block"]] = {
            "backend": pick[0], "options": dict(pick[1]), "head_dim": row["head_dim"], "heads": row["heads"],
            "batch": row["batch"], "kind": row["kind"], "tokens_q": row["tokens_q"], "tokens_k": row["tokens_k"],
            "time_ms": f["time_ms"], "iqr_ms": f["iqr_ms"], "max_rel_err": f["max_rel_err"],
            "runner_up": label_of(runner) if runner else None,
            "runner_up_ms": figures[runner]["time_ms"] if runner else None,
            "why": _why(row, pick, runner, ranked, m, need, budget)}
    return out


def _others(m: dict, pick) -> str:
    """The shape's other backends that could not be chosen: refused, or off the reference."""
    off = [f"{label_of(k)} {f['max_rel_err']:.1e} off the fp32 reference" for k, f in m["figures"].items()
           if not f["error_ok"] and k != pick]
    return "; ".join([*(f"{label_of(k)}: {why[:90]}" for k, why in m["refused"].items()), *off])


def _why(row: dict, pick: tuple, runner, ranked: list, m: dict, need, budget) -> str:
    """Why this backend for this block: the only one that runs the shape; the fastest that fits the budget (and what
    the faster would have needed); the fastest (and whether beyond the noise rule of its runner-up)."""
    if len(ranked) == 1 and (m["refused"] or len(m["figures"]) > 1):
        return f"the only one that runs this shape within tolerance ({_others(m, pick)})"
    if pick != ranked[0]:
        faster = ranked[0]
        peak = need(row, faster) if need else None
        return (f"fits the budget: {label_of(faster)} ({m['figures'][faster]['time_ms']:.3f} ms) would take the forward"
                f" to {human_bytes(peak)}, over {human_bytes(budget)}")
    if runner is None:
        return "fastest (the only one timed)"
    _, verdict, _ = time_verdict(m["figures"][runner]["time_samples_ms"], m["figures"][pick]["time_samples_ms"],
                                 THRESHOLD)
    return "fastest" + ("" if verdict == IMPROVEMENT else f" (within noise of {label_of(runner)})")


def best_single(rows: list[dict], shapes: dict[tuple, dict], keys: list[tuple], planned=None,
                budget: int | None = None) -> tuple[tuple | None, float | None, str]:
    """(the single backend with the least summed kernel time over the forward's calls, among those that run every
    call within tolerance and, with a budget, whose planned forward peak (planned(key)) fits; that sum; why there is
    none: none runs every call, or none that does keeps the forward within the budget). A backend over the budget is
    never the single one: the map could fall back to it."""
    totals = {}
    for key in keys:
        figures = [shapes[shape_of(r)]["figures"].get(key) for r in rows]
        if all(f is not None and f["error_ok"] for f in figures):
            totals[key] = sum(f["time_ms"] for f in figures)
    if not totals:
        return None, None, "no single backend runs every call within tolerance"
    fitting = {k: t for k, t in totals.items() if budget is None or (planned(k) or budget + 1) <= budget}
    if not fitting:
        over = ", ".join(f"{label_of(k)} {human_bytes(planned(k))}" if planned(k) else f"{label_of(k)} (no plan)"
                         for k in sorted(totals, key=totals.get))
        return None, None, (f"no single backend keeps the forward within the budget {human_bytes(budget)} ({over}): "
                            "the map is not proved against one")
    best = min(fitting, key=fitting.get)
    return best, fitting[best], ""


def entries_text(blocks: dict[str, dict], default: tuple | None) -> dict:
    """A map's document as mix.entries reads it: the blocks' backends and options, the default."""
    return {"blocks": {b: {"backend": e["backend"], "options": e["options"], "head_dim": e["head_dim"]}
                       for b, e in blocks.items()},
            "default": {"backend": default[0], "options": dict(default[1])} if default else None}
