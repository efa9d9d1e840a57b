"""The planner: per-block figures from a meta-device forward through the same recorder that measured runs use.
No weights, no kernels, no GPU."""
from __future__ import annotations

import torch

from .. import models
from ..fmt import human_bytes, human_count, table
from ..recorder import Recorder
from ..spec import parse_dtype


def plan(model: str, width: int, height: int, batch: int = 1, dtype: str = "float16", backend: str | None = None,
         backend_options: dict | None = None, unet: torch.nn.Module | None = None,
         memory_budget: int | None = None) -> dict:
    """One size: {model, width, height, batch, dtype, backend, blocks: [row per attention call], totals}.
    With a backend, the totals add the forward's predicted need; with a memory budget too, whether it fits."""
    dtype = parse_dtype(dtype)
    source = models.resolve(model)
    if unet is None:
        unet = models.build(source, weights="meta", dtype=dtype)
    inputs = models.example_inputs(unet, batch, width, height, source.text_tokens)
    from diffusers.models.attention_processor import AttnProcessor  # cheapest on meta: plain matmuls

    with torch.no_grad(), Recorder(unet, processor=AttnProcessor) as rec:
        unet(**inputs)
    blocks = rec.rows
    if backend is not None:
        from ..backends import predicted_peak_bytes

        for row in blocks:
            row["predicted_peak_bytes"] = predicted_peak_bytes(backend, row, dtype, **(backend_options or {}))
    for row in blocks:
        del row["pass_index"]
    p = {"model": model, "width": width, "height": height, "batch": batch, "dtype": dtype,
         "backend": backend, "blocks": blocks, "totals": totals(blocks, models.param_counts(unet))}
    if backend is not None:
        need = predicted_need_bytes(p, backend, backend_options)[0]
        p["totals"]["predicted_need_bytes"] = need
        if memory_budget is not None:
            p["totals"].update(memory_budget_bytes=memory_budget, fits=need <= memory_budget)
    return p


def predicted_need_bytes(p: dict, backend: str, options: dict | None = None,
                         reference_copy: bool = False) -> tuple[int, dict]:
    """What a forward needs at its worst attention call: the weights in the plan's dtype (plus an fp32 copy for the
    reference, where a measured run makes one) and that call's predicted transient peak. Returns (bytes, call row).
    Activations held between calls are not counted."""
    from ..backends import predicted_peak_bytes
    from ..spec import DTYPES

    params = p["totals"]["params_total"]
    weights = params * DTYPES[p["dtype"]].itemsize + (params * 4 if reference_copy and p["dtype"] != "float32" else 0)
    peaks = [predicted_peak_bytes(backend, r, p["dtype"], **(options or {})) for r in p["blocks"]]
    top = max(range(len(peaks)), key=peaks.__getitem__)
    return int(weights + peaks[top]), p["blocks"][top]


def totals(blocks: list[dict], params: dict) -> dict:
    largest = max(blocks, key=lambda r: r["score_elements"])
    out = {
        "calls": len(blocks),
        "calls_self": sum(r["kind"] == "self" for r in blocks),
        "calls_cross": sum(r["kind"] == "cross" for r in blocks),
        "largest_score_elements": largest["score_elements"],
        "largest_score_bytes": largest["score_bytes"],
        "largest_score_block": largest["block"],
        "flops_total": sum(r["flops"] for r in blocks),
        "score_bytes_total": sum(r["score_bytes"] for r in blocks),
    }
    if "predicted_peak_bytes" in blocks[0]:
        out["predicted_peak_bytes_max"] = max(r["predicted_peak_bytes"] for r in blocks)
    out.update(params)
    return out


def format_plan(p: dict) -> str:
    cols = [("block", "block"), ("stage", "stage"), ("lvl", "level"), ("kind", "kind"), ("heads", "heads"),
            ("hdim", "head_dim"), ("tokens_q", "tokens_q"), ("tokens_k", "tokens_k"), ("scores", "scores"),
            ("score table", "score_h"), ("FLOPs", "flops_h")]
    if p["backend"]:
        cols.append((f"peak ({p['backend']})", "peak_h"))
    rows = [dict(r, scores=human_count(r["score_elements"]), score_h=human_bytes(r["score_bytes"]),
                 flops_h=human_count(r["flops"]), peak_h=human_bytes(r.get("predicted_peak_bytes")))
            for r in p["blocks"]]
    t = p["totals"]
    head = f"{p['model']} at {p['width']}x{p['height']} (latent {p['width'] // 8}x{p['height'] // 8}), " \
           f"batch {p['batch']}, {p['dtype']}"
    share = lambda k: f"{t['params_' + k] / 1e6:.2f}M ({100 * t['share_' + k]:.1f}%)"  # noqa: E731
    facts = [("calls per forward", f"{t['calls']} ({t['calls_self']} self, {t['calls_cross']} cross)"),
             ("largest score table", f"{human_count(t['largest_score_elements'])} scores, "
                                     f"{human_bytes(t['largest_score_bytes'])} ({t['largest_score_block']})"),
             ("attention FLOPs", human_count(t["flops_total"]))]
    if "predicted_peak_bytes_max" in t:
        facts.append((f"predicted peak, {p['backend']}",
                      f"{human_bytes(t['predicted_peak_bytes_max'])} over what is held when the call begins"))
    if "fits" in t:
        verdict = "yes" if t["fits"] else "NO"
        facts.append(("fits the budget", f"{verdict}: needs {human_bytes(t['predicted_need_bytes'])} "
                                         f"(weights + the largest call) of {human_bytes(t['memory_budget_bytes'])}"))
    facts += [("params_total", f"{t['params_total'] / 1e6:.2f}M"),
              ("params_transformer_blocks", share("transformer_blocks")), ("params_attention", share("attention"))]
    lines = [head, table(rows, cols), ""] + [f"{k + ':':27s}{v}" for k, v in facts]
    return "\n".join(lines)
