"""The planner: per-block figures from a forward through the same recorder that measured runs use, on the meta
device (shapes) or on fake tensors (memory: forward.py). No weights, no kernels, no GPU."""
from __future__ import annotations

import functools
import json

import torch

from ..attention import backends
from ..unet import models
from ..fmt import human_bytes, human_count, table
from ..attention.recorder import Recorder
from ..spec import parse_dtype
from ..unet.workload import Workload


def plan(model: str, width: int, height: int, batch: int = 1, dtype: str = "float16", backend: str | None = None,
         backend_options: dict | None = None, memory_budget: int | None = None, device: str = "cuda",
         gpu_arch: str | None = None, settings: tuple = ()) -> dict:
    """One size: {model, width, height, batch, dtype, settings, backend, device, blocks: [row per attention call],
    totals}. Without a backend, the calls' shapes from a meta-device forward. With one, the whole forward on fake
    tensors (planner/forward.py): each call's traced transient beside its memory model's, and the forward's peak
    memory (predicted_forward_peak_bytes); with a memory budget too, whether that fits. On CUDA the kernels are
    those of the GPU target: gpu_arch (e.g. sm89), else this machine's GPU, else an assumed H100-class sm90.
    settings: the model's (spec.SETTINGS: a ControlNet, IP-Adapter tokens, ToMe; a VAE's part, tiling, ...)."""
    from ..spec import InputError

    dtype = parse_dtype(dtype)
    from ..attention.backends import check_options, label
    from .memory import predicted_peak_bytes

    options = check_options(backend, backend_options or {}) if backend else {}
    from ..unet.models import facts_of

    p = {"model": model, **facts_of(model), "width": width, "height": height, "batch": batch, "dtype": dtype,
         "settings": dict(settings), "backend": backend, "backend_options": options,
         "backend_label": label(backend, options) if backend else None, "device": device if backend else None}
    if backend is None:
        w, module = meta_model(model, dtype, tuple(settings))
        inputs = w.inputs(module, batch, width, height)
        from diffusers.models.attention_processor import AttnProcessor  # cheapest on meta: plain matmuls

        with torch.no_grad(), w.applied(module), Recorder(module, processor=AttnProcessor) as rec:
            w.forward(module, inputs)
            params = models.param_counts(module)
        blocks = [{k: v for k, v in row.items() if k != "pass_index"} for row in rec.rows]
        return {**p, "blocks": blocks, "totals": totals(blocks, params)}
    from ..attention import kernel_choice
    from .forward import LEFT_OUT, fake_model, method_text, trace

    gpu = kernel_choice.gpu_target(gpu_arch) if device == "cuda" else None
    traced = trace(model, width, height, batch, dtype, device, [backend], {backend: options}, gpu=gpu, ops=True,
                   settings=tuple(settings))
    if backend not in traced["backends"]:
        raise InputError(f"backend {backend!r} does not run on {device}: plan it for another device (--device)")
    w, module = fake_model(model, dtype, tuple(settings))
    blocks = []
    for row in traced["rows"]:
        blocks.append({**row, "predicted_peak_bytes": predicted_peak_bytes(backend, row, w.dtype(dtype), **options),
                       "traced_peak_bytes": row["traced_peak_bytes"][backend],
                       "refused": backends.call_refusal(backend, row)})
    t = totals(blocks, models.param_counts(module))
    t["refused"] = backends.refusal(backend, blocks)  # the calls it cannot run: a run records this as the reason
    b = traced["backends"][backend]
    t.update(weights_bytes=traced["weights_bytes"], inputs_bytes=traced["inputs_bytes"],
             forward_transient_peak_bytes=b["transient_peak_bytes"],
             predicted_forward_peak_bytes=b["predicted_forward_peak_bytes"], forward_method=method_text(b["how"]),
             not_counted=LEFT_OUT, gpu=gpu.describe() if gpu else None)
    if memory_budget is not None:
        t.update(memory_budget_bytes=memory_budget, fits=b["predicted_forward_peak_bytes"] <= memory_budget)
    return {**p, "blocks": blocks, "totals": t}


@functools.lru_cache(maxsize=8)
def meta_part(model: str, which: str, dtype: str) -> torch.nn.Module:
    """A part of a model on the meta device, built once per process (shapes only: nothing in it changes between
    plans)."""
    return Workload(model).make_part(which, "meta", "cpu", dtype)


def meta_model(model: str, dtype: str, settings: tuple = ()) -> tuple[Workload, torch.nn.Module]:
    w = Workload(model, settings)
    return w, w.build(lambda which: meta_part(model, which, w.dtype(dtype)))


def totals(blocks: list[dict], params: dict) -> dict:
    largest = max(blocks, key=lambda r: r["score_elements"])
    out = {
        "calls": len(blocks),
        "calls_self": sum(r["kind"] == "self" for r in blocks),
        "calls_cross": sum(r["kind"] == "cross" for r in blocks),
        "calls_image": sum(r["kind"] == "image" for r in blocks),
        "calls_temporal": sum(r["kind"] == "temporal" for r in blocks),
        "calls_added_kv": sum(r["kind"] == "added-kv" for r in blocks),
        "largest_score_elements": largest["score_elements"],
        "largest_score_bytes": largest["score_bytes"],
        "largest_score_block": largest["block"],
        "flops_total": sum(r["flops"] for r in blocks),
        "score_bytes_total": sum(r["score_bytes"] for r in blocks),
    }
    for key in ("predicted_peak_bytes", "traced_peak_bytes"):
        if key in blocks[0]:
            out[f"{key.removesuffix('_bytes')}_bytes_max"] = max(r[key] for r in blocks)
    out.update(params)
    return out


def _versus(predicted, traced) -> str:
    """The memory model's figure where it differs from the trace by more than 1%."""
    if predicted is None or traced is None:
        return ""
    return "same" if abs(predicted - traced) <= 0.01 * max(traced, 1) else human_bytes(predicted)


def _beyond_every_gpu(t: dict) -> list[tuple[str, str]]:
    """A fact where the largest score table alone outgrows the largest GPU of the table (plan --size 100000x100000)."""
    from .. import gpus

    largest = max((gpus.get(n) for n in gpus.names()), key=lambda g: g["memory_bytes"])
    if t["largest_score_bytes"] <= largest["memory_bytes"]:
        return []
    return [("beyond every GPU", f"the largest score table alone needs {human_bytes(t['largest_score_bytes'])}: no "
                                 f"GPU of the table holds it (the largest, the {largest['name']}, has "
                                 f"{largest['memory_gib']} GiB); only a backend that never holds it whole (sdpa, "
                                 "sliced, subquad) can run this size, and the time is another matter")]


def _plan_columns(p: dict) -> list[tuple[str, str]]:
    cols = [("block", "block"), ("stage", "stage"), ("lvl", "level"), ("kind", "kind"), ("heads", "heads"),
            ("hdim", "head_dim"), ("tokens_q", "tokens_q"), ("tokens_k", "tokens_k"), ("scores", "scores"),
            ("score table", "score_h"), ("FLOPs", "flops_h")]
    if p["backend"]:
        cols += [(f"peak ({p['backend_label']})", "peak_h"), ("model", "model_h")]
    if p["blocks"] and "predicted_time_ms" in p["blocks"][0]:
        cols += [("time (ms)", "time_h")]
    return cols


def format_plan(p: dict) -> str:
    cols = _plan_columns(p)
    rows = [dict(r, scores=human_count(r["score_elements"]), score_h=human_bytes(r["score_bytes"]),
                 flops_h=human_count(r["flops"]), peak_h=human_bytes(r.get("traced_peak_bytes")),
                 model_h=_versus(r.get("predicted_peak_bytes"), r.get("traced_peak_bytes")),
                 time_h=f"{r.get('predicted_time_ms', 0):.3g}")
            for r in p["blocks"]]
    t = p["totals"]
    from ..spec import settings_label

    settings = settings_label(json.dumps(p.get("settings") or {}))
    from ..unet.checkpoint import describe

    if (p.get("settings") or {}).get("compile", "none") != "none":
        settings += " (predicted as eager: the planner does not model Inductor)"
    head = f"{p['model']}{describe({k: v for k, v in p.items() if k.startswith('model_file')})} at {p['width']}x{p['height']} (latent {p['width'] // 8}x{p['height'] // 8}), " \
           f"batch {p['batch']}, {p['dtype']}" + (f", {settings}" if settings else "")
    share = lambda k: f"{t['params_' + k] / 1e6:.2f}M ({100 * t['share_' + k]:.1f}%)"  # noqa: E731
    more = "".join(f", {t['calls_' + k]} {w}" for k, w in (("image", "image"), ("temporal", "temporal"),
                                                           ("added_kv", "added-KV")) if t.get(f"calls_{k}"))
    facts = [("calls per forward", f"{t['calls']} ({t['calls_self']} self, {t['calls_cross']} cross{more})"),
             ("largest score table", f"{human_count(t['largest_score_elements'])} scores, "
                                     f"{human_bytes(t['largest_score_bytes'])} ({t['largest_score_block']})"),
             ("attention FLOPs", human_count(t["flops_total"]))]
    facts[2:2] = _beyond_every_gpu(t)
    if "predicted_forward_peak_bytes" in t:
        facts += [(f"largest call, {p['backend_label']}",
                   f"{human_bytes(t['traced_peak_bytes_max'])} "
                   f"{'modelled' if t['forward_method'].startswith('attention calls from') else 'traced'} over "
                   "what is held when the call begins "
                   f"(memory model: {human_bytes(t['predicted_peak_bytes_max'])})"),
                  (f"forward peak on {p['device']}",
                   f"{human_bytes(t['predicted_forward_peak_bytes'])} = weights {human_bytes(t['weights_bytes'])} "
                   f"+ inputs {human_bytes(t['inputs_bytes'])} + the forward's transient "
                   f"{human_bytes(t['forward_transient_peak_bytes'])} ({t['forward_method']})"),
                  ("not counted", t["not_counted"])]
        if t.get("gpu"):
            facts.insert(-1, ("GPU planned for", t["gpu"]))
    if t.get("refused"):
        facts.insert(0, (f"{p['backend_label']} refused", t["refused"]))
        for r in rows:
            r["peak_h"] = "refused" if r.get("refused") else r["peak_h"]
    if "fits" in t:
        verdict = "yes" if t["fits"] else "NO"
        facts.append(("fits the budget", f"{verdict}: the forward peak "
                                         f"{human_bytes(t['predicted_forward_peak_bytes'])} of "
                                         f"{human_bytes(t['memory_budget_bytes'])}"))
    from .timing import format_times

    facts += format_times(t)
    facts += [("params_total", f"{t['params_total'] / 1e6:.2f}M"),
              ("params_transformer_blocks", share("transformer_blocks")), ("params_attention", share("attention"))]
    return "\n".join([head, table(rows, cols), "", *facts_lines(facts)])


def facts_lines(facts: list[tuple[str, str]]) -> list[str]:
    """'name: value' lines, the values aligned past the longest name and wrapped at the terminal's width
    (fmt.wrapped), each continuation under its value."""
    from ..fmt import terminal_width, wrapped

    width = max(len(k) for k, _ in facts) + 2  # the longest name, its colon and a space
    return wrapped([f"{k + ':':{width}s}{v}" for k, v in facts], max(terminal_width(), width + 40), hang=width)
