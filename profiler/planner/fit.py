"""attnprof fit: for each backend, the largest image whose forward fits a memory budget (planner/forward.py's
predicted_forward_peak_bytes), or the verdict for each of SDXL's trained aspect buckets.

Every size on the grid (64-pixel steps of width, the height following the aspect) is screened, then the answer is
checked exactly:
1. Two forwards are traced (near 512 and 1024 pixels wide). With both sides multiples of 64, every activation of
   the U-Net's levels scales exactly with the pixel count, so the bytes alive after each op outside attention, and
   at each attention call's start, are affine in it: two traces give them at every size.
2. Each size is screened with those and each attention call's memory model at that size.
3. For each backend the largest size the screen lets through is traced exactly, and so is the next step; the answer
   moves down (or up) a step at a time until the exact trace fits and the next step's does not. Memory need not grow
   smoothly with size (a chunked backend's chunk count jumps at sizes that do not divide), so the screen looks at
   every size, never bisects, and cannot step over a size that fits beyond one that does not.
"""
from __future__ import annotations

import json

import numpy as np

from ..attention import backends, kernel_choice
from ..unet import kinds, models
from ..fmt import human_bytes, table
from ..spec import InputError, parse_dtype
from ..unet.workload import Workload
from . import memory
from .forward import LEFT_OUT, how_traced, method_text, trace

# SDXL's trained aspect buckets (width x height), about 1024^2 pixels each
BUCKETS = [(1024, 1024), (1152, 896), (896, 1152), (1216, 832), (832, 1216), (1344, 768), (768, 1344),
           (1536, 640), (640, 1536)]
STEP = 64


def parse_aspect(text: str) -> tuple[int, int]:
    try:
        w, h = (int(x) for x in str(text).split(":"))
        if w < 1 or h < 1:
            raise ValueError
    except ValueError:
        raise InputError(f"aspect {text!r} is not W:H with whole numbers >= 1, e.g. 1:1 or 2:3") from None
    return w, h


def grid(aspect: tuple[int, int], limit: int) -> list[tuple[int, int]]:
    """(width, height) at 64-pixel steps of the width, the height following the aspect (a multiple of 64)."""
    aw, ah = aspect
    sizes = []
    for k in range(1, limit // STEP + 1):
        w = k * STEP
        h = max(STEP, round(w * ah / aw / STEP) * STEP)
        if h <= limit and (not sizes or sizes[-1] != (w, h)):
            sizes.append((w, h))
    return sizes


class _Exact:
    """Exact needs by size (one trace gives every backend), and the sizes traced."""

    def __init__(self, model, batch, dtype, device, names, say, gpu, settings=()):
        self.args, self.names, self.say, self.cache, self.gpu = (model, batch, dtype, device), names, say, {}, gpu
        self.settings = settings
        self.how: dict[str, str] = {}  # how each backend's calls were traced, as the trace says

    def __call__(self, size: tuple[int, int]) -> dict[str, int]:
        if size not in self.cache:
            model, batch, dtype, device = self.args
            t = trace(model, size[0], size[1], batch, dtype, device, self.names, gpu=self.gpu, settings=self.settings)
            self.cache[size] = {n: b["predicted_forward_peak_bytes"] for n, b in t["backends"].items()}
            for n, b in t["backends"].items():  # "processor, chunks" where any size needed the memory model
                self.how[n] = b["how"] if self.how.get(n) != "processor, chunks" else self.how[n]
            self.say(f"traced {size[0]}x{size[1]}")
        return self.cache[size]


def _affine(t1: dict, t2: dict, p1: int, p2: int):
    """The bytes alive after each op outside attention, at each call's start, and the inputs, as a + b * pixels."""
    m1, m2 = np.array(t1["moments"], dtype=float), np.array(t2["moments"], dtype=float)
    s1 = np.array([r["live_at_start_bytes"] for r in t1["rows"]], dtype=float)
    s2 = np.array([r["live_at_start_bytes"] for r in t2["rows"]], dtype=float)
    if m1.shape != m2.shape or s1.shape != s2.shape:
        raise RuntimeError("the two traced forwards ran different ops: sizes off the 64-pixel grid?")
    line = lambda y1, y2: ((y2 - y1) / (p2 - p1), y1 - (y2 - y1) / (p2 - p1) * p1)  # noqa: E731
    return line(m1, m2), line(s1, s2), line(float(t1["inputs_bytes"]), float(t2["inputs_bytes"]))


def _rows_at(rows: list[dict], p_ref: int, pixels: int) -> list[dict]:
    """The attention calls at another size: query tokens scale with the pixels (so do self-attention's keys, and an
    added-KV call's own positions among its keys); a temporal call's batch does (a sequence of frames per position),
    its tokens (the frames) do not."""
    out = []
    for r in rows:
        if r["kind"] == "temporal":
            batch, tq, tk = r["batch"] * pixels // p_ref, r["tokens_q"], r["tokens_k"]
        else:
            batch, tq = r["batch"], r["tokens_q"] * pixels // p_ref
            tk = tq if r["kind"] == "self" else r["tokens_k"] - r["tokens_q"] + tq if r["kind"] == "added-kv" else \
                r["tokens_k"]
        elements = batch * r["heads"] * tq * tk
        out.append({**r, "batch": batch, "tokens_q": tq, "tokens_k": tk, "score_elements": elements,
                    "score_bytes": elements * (r["score_bytes"] // r["score_elements"])})
    return out


def fit(model: str, budget: int, names: list[str] | None = None, dtype: str = "float16", batch: int = 1,
        aspect: tuple[int, int] = (1, 1), buckets: bool = False, device: str = "cuda", limit: int = 8192,
        say=lambda line: None, gpu_arch: str | None = None, settings: tuple = ()) -> dict:
    """{"model", "budget_bytes", ..., "backends": [{"backend", "method", "largest": [w, h] or None,
    "largest_need_bytes", "next": [w, h] or None, "next_need_bytes"} (with --buckets: {"backend", "method",
    "buckets": [{"width", "height", "need_bytes", "fits"}]})], "sizes_screened", "sizes_traced"}"""
    return fit_many(model, [budget], names, dtype, batch, aspect, buckets, device, limit, True, say, gpu_arch,
                    settings)[0]


def fit_many(model: str, budgets: list[int], names: list[str] | None = None, dtype: str = "float16",
             batch: int = 1, aspect: tuple[int, int] = (1, 1), buckets: bool = False, device: str = "cuda",
             limit: int = 8192, verify: bool = True, say=lambda line: None, gpu_arch: str | None = None,
             settings: tuple = ()) -> list[dict]:
    """fit() for several budgets, sharing the traces. verify=False stops at the screen (step 2 of the module's
    search; the dashboard's table of common GPU sizes), each answer then marked "screened"."""
    dtype = parse_dtype(dtype)
    names = names or backends.names()
    for n in names:
        backends.check_backend_name(n)
    compute = Workload(model, settings).dtype(dtype)  # what the model computes in (an upcast VAE: float32)
    runs = [n for n in names if how_traced(n, device, compute) is not None]
    gpu = kernel_choice.gpu_target(gpu_arch) if device == "cuda" else None
    exact = _Exact(model, batch, dtype, device, runs, say, gpu, settings)
    base = {"model": model, "kind": Workload(model, settings).kind.name, "dtype": dtype, "batch": batch,
            "device": device, "aspect": f"{aspect[0]}:{aspect[1]}",
            "buckets": buckets, "verified": verify, "gpu": gpu.describe() if gpu else None,
            "settings": dict(settings)}
    if buckets:
        needs = {(w, h): exact((w, h)) for w, h in BUCKETS}
        return [{**base, "budget_bytes": budget, "sizes_traced": [f"{w}x{h}" for w, h in exact.cache],
                 "backends": [{"backend": n, "method": method_text(exact.how[n]) if n in exact.how else
                               _method(n, device, dtype), "buckets": [
                     {"width": w, "height": h, "need_bytes": needs[(w, h)].get(n),
                      "fits": None if n not in runs else needs[(w, h)][n] <= budget} for w, h in BUCKETS]}
                     for n in names]} for budget in budgets]
    sizes = grid(aspect, limit)
    r1 = min(sizes, key=lambda s: abs(s[0] - 512))
    r2 = min((s for s in sizes if s[0] * s[1] != r1[0] * r1[1]), key=lambda s: abs(s[0] - 1024))
    say(f"screening {len(sizes)} sizes from {sizes[0][0]}x{sizes[0][1]} to {sizes[-1][0]}x{sizes[-1][1]}")
    t1, t2 = (trace(model, *r, batch, dtype, device, runs[:1], moments=True, gpu=gpu, settings=settings)
              for r in (r1, r2))
    p1, p2 = r1[0] * r1[1], r2[0] * r2[1]
    (ma, mb), (sa, sb), (ia, ib) = _affine(t1, t2, p1, p2)
    screened, refused = {}, {}
    for n in runs:  # every size's need, from the two traces and the calls' memory models
        options = backends.check_options(n, {})
        screened[n], refused[n] = [], []
        for w, h in sizes:
            pix = w * h
            rows = _rows_at(t1["rows"], p1, pix)
            calls = [memory.predicted_peak_bytes(n, r, compute, **options) for r in rows]
            transient = max(float((ma * pix + mb).max()), float((sa * pix + sb + np.array(calls)).max()))
            refused[n].append(backends.refusal(n, rows))  # a call the backend cannot run: it does not fit there
            screened[n].append(float("inf") if refused[n][-1] else t1["weights_bytes"] + ia * pix + ib + transient)
    results = []
    for budget in budgets:
        entries = []
        for n in names:
            entry = {"backend": n, "method": _method(n, device, dtype), "largest": None, "largest_need_bytes": None,
                     "next": None, "next_need_bytes": None}
            entries.append(entry)
            if n in runs:
                entry.update(_largest(n, sizes, screened[n], budget, exact if verify else None, refused[n]))
                if n in exact.how:
                    entry["method"] = method_text(exact.how[n])
        results.append({**base, "budget_bytes": budget, "backends": entries})
    for r in results:
        r.update(sizes_screened=len(sizes), sizes_traced=[f"{w}x{h}" for w, h in [r1, r2, *exact.cache]])
    return results


def _largest(name: str, sizes: list, screened: list, budget: int, exact, refused: list) -> dict:
    """The largest size the screen lets through; with exact, moved a step at a time until the exact trace fits
    and the next step's does not. A size at which the backend refuses a call (refused[i]: backends.refusal) does
    not fit, whatever its memory; the next step then says why (refused)."""
    ok = [i for i, need in enumerate(screened) if need <= budget]
    i = ok[-1] if ok else -1
    need = (lambda j: float("inf") if refused[j] else exact(sizes[j])[name]) if exact else \
        (lambda j: float(screened[j]))
    if exact:
        i = max(i, 0)
        while i >= 0 and need(i) > budget:  # the screen was optimistic here
            i -= 1
        while i + 1 < len(sizes) and need(i + 1) <= budget:  # or pessimistic
            i += 1
    out = {}
    if i >= 0:
        out.update(largest=list(sizes[i]), largest_need_bytes=int(need(i)))
    if i + 1 < len(sizes):
        refusal = refused[i + 1]
        out.update(next=list(sizes[i + 1]), next_need_bytes=None if refusal else int(need(i + 1)),
                   **({"refused": refusal} if refusal else {}))
    return out


MAX_FRAMES = 256  # the frames searched at most where the model sets no limit (SVD)


def most_frames(model: str, budget: int, size: tuple[int, int], names: list[str] | None = None,
                dtype: str = "float16", batch: int = 1, device: str = "cuda", say=lambda line: None,
                gpu_arch: str | None = None, settings: tuple = ()) -> dict:
    """For a video model at one size: per backend the most frames whose forward fits the budget (and whose every call
    the backend runs), each answer traced exactly; searched by halves from 1 to the model's limit (AnimateDiff: its
    motion modules' positional table, motion_max_seq_length; else MAX_FRAMES). {"model", "budget_bytes", "size",
    "max_frames", "backends": [{"backend", "frames", "need_bytes", "next_frames", "next_need_bytes", "refused"}]}"""
    source = models.resolve(model)
    if not kinds.KINDS[source.kind].frames:
        raise InputError(f"{model} is {kinds.KINDS[source.kind].what}, not a video model: fit --size searches frames "
                         "(AnimateDiff, SVD); for images give --budget alone")
    dtype = parse_dtype(dtype)
    names = names or backends.names()
    limit = (source.config.get("motion_adapter") or {}).get("motion_max_seq_length") or \
        source.config.get("motion_max_seq_length") or MAX_FRAMES
    gpu = kernel_choice.gpu_target(gpu_arch) if device == "cuda" else None
    compute = Workload(model, settings).dtype(dtype)
    runs = [n for n in names if how_traced(n, device, compute) is not None]
    traces: dict[int, dict] = {}
    others = tuple(x for x in settings if x[0] != "frames")

    def at(frames: int) -> dict:
        if frames not in traces:
            traces[frames] = trace(model, size[0], size[1], batch, dtype, device, runs, gpu=gpu,
                                   settings=(*others, ("frames", frames)))
            say(f"traced {frames} frames")
        return traces[frames]

    def need(name: str, frames: int) -> float:
        t = at(frames)
        return float("inf") if backends.refusal(name, t["rows"]) else t["backends"][name]["predicted_forward_peak_bytes"]

    entries = []
    for n in names:
        entry = {"backend": n, "method": _method(n, device, dtype), "frames": None, "need_bytes": None,
                 "next_frames": None, "next_need_bytes": None}
        if n in runs:
            lo, hi = 0, limit  # need(lo) fits (0: none tried yet), need(hi + 1) does not
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if need(n, mid) <= budget else (lo, mid - 1)
            if lo:
                entry.update(frames=lo, need_bytes=int(need(n, lo)))
            if lo < limit:
                why = backends.refusal(n, at(lo + 1)["rows"])
                entry.update(next_frames=lo + 1, next_need_bytes=None if why else int(need(n, lo + 1)),
                             **({"refused": why} if why else {}))
        entries.append(entry)
    return {"model": model, "budget_bytes": budget, "size": list(size), "dtype": dtype, "batch": batch,
            "device": device, "max_frames": limit, "gpu": gpu.describe() if gpu else None, "backends": entries,
            "frames_traced": sorted(traces)}


def format_most_frames(f: dict) -> str:
    on = f"{f['device']} ({f['gpu']})" if f.get("gpu") else f["device"]
    rows = [{"backend": b["backend"], "frames": str(b["frames"] or "none"), "needs": human_bytes(b["need_bytes"]),
             "next": str(b["next_frames"] or "-"),
             "next needs": "refused" if b.get("refused") else human_bytes(b["next_need_bytes"]),
             "how": b["method"] + (f"; at {b['next_frames']} frames: {b['refused']}" if b.get("refused") else "")}
            for b in f["backends"]]
    return "\n".join([f"{f['model']} at {f['size'][0]}x{f['size'][1]}, {f['dtype']}, batch {f['batch']} on {on}: the "
                      f"most frames whose forward fits {human_bytes(f['budget_bytes'])} (up to {f['max_frames']})",
                      table(rows, [(c, c) for c in ("backend", "frames", "needs", "next", "next needs", "how")]), "",
                      f"traced exactly at {', '.join(map(str, f['frames_traced']))} frames", f"not counted: {LEFT_OUT}"])


def _method(name: str, device: str, dtype: str) -> str:
    how = how_traced(name, device, dtype)
    return f"does not run on {device}" if how is None else method_text(how)


def distinct(entries: list[dict]) -> list[dict]:
    """One entry per kernel and answer: a diffusers dispatcher backend that runs one of ours (backends.kernel_of) and
    fits the same is named on that one's row ("also")."""
    rows: dict[tuple, dict] = {}
    for b in entries:
        answer = json.dumps({k: v for k, v in b.items() if k not in ("backend", "method")}, sort_keys=True,
                            default=str)
        key = (backends.kernel_of(b["backend"]), answer)
        if key in rows:
            rows[key]["also"].append(b["backend"])
        else:
            rows[key] = {**b, "also": []}
    for row in rows.values():  # our own name first where a dispatcher alias came before it
        names = [row["backend"], *row["also"]]
        own = next((n for n in names if not backends.dispatched(n)), names[0])
        row["backend"], row["also"] = own, [n for n in names if n != own]
    return list(rows.values())


GUIDED = ("unet", "controlnet", "animatediff", "svd")  # the kinds a pipeline runs at twice the batch under guidance


def batch_text(f: dict) -> str:
    """'batch 2', or at batch 1 of a denoiser 'batch 1 (no classifier-free guidance; --batch 2 for it)': a pipeline
    under guidance runs the U-Net on the prompt and the negative prompt at once."""
    guided = f["batch"] == 1 and f.get("kind") in GUIDED
    return f"batch {f['batch']}" + (" (no classifier-free guidance; --batch 2 for it)" if guided else "")


def format_fit(f: dict, every: bool = False) -> str:
    """The fit as a table: one row per distinct kernel and answer (distinct), or every backend with every=True."""
    f = {**f, "backends": f["backends"] if every else distinct(f["backends"])}
    on = f"{f['device']} ({f['gpu']})" if f.get("gpu") else f["device"]
    head = (f"{f['model']}, {f['dtype']}, {batch_text(f)} on {on}: the largest image whose forward fits "
            f"{human_bytes(f['budget_bytes'])}")
    if f["buckets"]:
        rows = []
        for b in f["backends"]:
            row = {"backend": b["backend"]}
            for v in b["buckets"]:
                row[f"{v['width']}x{v['height']}"] = "-" if v["fits"] is None else \
                    f"{'yes' if v['fits'] else 'NO'} {human_bytes(v['need_bytes'])}"
            rows.append(row)
        cols = [("backend", "backend")] + [(f"{w}x{h}", f"{w}x{h}") for w, h in BUCKETS]
        return "\n".join([head + " (SDXL's aspect buckets)", table(rows, cols)])
    rows = [{"backend": b["backend"] + (f" (+{len(b['also'])})" if b.get("also") else ""),
             "largest": f"{b['largest'][0]}x{b['largest'][1]}" if b["largest"] else "none",
             "needs": human_bytes(b["largest_need_bytes"]),
             "next step": f"{b['next'][0]}x{b['next'][1]}" if b["next"] else "-",
             "next needs": human_bytes(b["next_need_bytes"]) if not b.get("refused") else "refused",
             "how": b["method"] + (f"; from {b['next'][0]}x{b['next'][1]}: {b['refused']}" if b.get("refused") else
                                   "")} for b in f["backends"]]
    cols = [(c, c) for c in ("backend", "largest", "needs", "next step", "next needs", "how")]
    folded = [f"  {b['backend']} (+{len(b['also'])}): also {', '.join(b['also'])}" for b in f["backends"]
              if b.get("also")]
    folded = ["diffusers dispatcher backends that run one of these kernels and fit the same (--all: a row each):",
              *folded] if folded else []
    return "\n".join([f"{head} (aspect {f['aspect']}, 64-pixel steps)", table(rows, cols), "", *folded,
                      f"screened {f['sizes_screened']} sizes; traced exactly: {', '.join(f['sizes_traced'])}",
                      f"not counted: {LEFT_OUT}"])
