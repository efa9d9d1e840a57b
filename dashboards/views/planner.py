"""The Planner page: what each backend needs at a model, size, batch and dtype, traced on fake tensors (no run
needed), the largest image per GPU size, predicted times."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import streamlit as st

from dashboards import charts as C
from dashboards import transforms as T
from dashboards import widgets as W


def sidebar(root: Path) -> tuple[dict, dict]:
    """The model, size, batch, dtype and budget to plan for, on the page itself; for the URL and for draw."""
    from profiler.unet.models import known_models

    a, b, c, d, e = st.columns(5)
    values = (W.choice_ui("Model", list(known_models()), "plan_model", "sd15", where=a),
              W.text_ui("Size (WxH pixels)", "plan_size", "512x512", where=b),
              W.text_ui("Batch", "plan_batch", "1", where=c),
              W.choice_ui("Dtype", ["float16", "bfloat16", "float32"], "plan_dtype", "float16", where=d),
              W.text_ui("Memory budget (or a GPU: 4090, L4, H100)", "budget", "24GiB", where=e))
    return (dict(zip(("plan_model", "plan_size", "plan_batch", "plan_dtype", "budget"), values)),
            dict(zip(("model", "size", "batch", "dtype", "budget"), values)))


def guidance(batch: int) -> str:
    """What the batch means for a pipeline with classifier-free guidance, which runs the U-Net at batch 2 an image."""
    if batch == 1:
        return " (a pipeline with classifier-free guidance runs batch 2 for one image: set Batch to 2 for it)"
    return " (one image under classifier-free guidance)" if batch == 2 else ""


def draw(model: str, size: str, batch: str, dtype: str, budget: str) -> None:
    """What each backend needs against the budget, the largest images by GPU memory, the predicted times."""
    from profiler.planner.forward import LEFT_OUT
    from profiler.spec import InputError, parse_batch, parse_bytes, parse_size, size_text

    try:
        (width, height), n, limit = parse_size(size), parse_batch(batch), parse_bytes(budget, "memory budget")
    except InputError as e:
        st.error(str(e))
        return
    traced = W.load_trace(model, width, height, n, dtype)
    plan = T.planner_table(traced, limit)
    shown, unit = T.with_mem_unit(plan, ["need_bytes", "budget_bytes"])
    fits = int(plan["fits"].sum())
    st.caption(f"{model} at {width}x{height}, batch {n}{guidance(n)}, {dtype}, on a CUDA GPU: "
               f"{fits} of {len(plan)} backends fit in {size_text(budget)}. Need = the whole forward's peak: "
               "weights, inputs and every activation, traced on fake tensors (no GPU and no run needed). Not "
               f"counted: {LEFT_OUT}.")
    W.chart(shown, C.planner_needs(unit, limit / T.UNITS[unit], len(shown)))
    W.table(plan, "planner")
    st.subheader(f"Largest square image per backend, by GPU memory ({model}, batch {n}, {dtype})")
    st.caption("Every 64-pixel step screened (the activations from two traced forwards, each attention call from its "
               "memory model); attnprof fit --model ... --budget ... traces the answer exactly.")
    W.table(T.largest_table(W.load_largest(model, n, dtype)), "largest")
    pipeline = W.choice_ui("A whole generation", ["sd15", "sdxl"], "plan_pipeline", "sd15", horizontal=True)
    st.subheader(f"Largest square image a whole {pipeline} generation fits, by GPU memory (sdpa, {dtype}, "
                 f"batch {n}, classifier-free guidance, every model resident)")
    st.caption("Every phase must fit: the text encoders, the U-Net at twice the batch, the VAE decode (float32 where "
               "its config forces it); screened as above; attnprof fit --pipeline ... traces the answer exactly, "
               "and takes offload, tiling, ControlNet, IP-Adapter and ToMe.")
    W.table(T.pipeline_table(W.load_pipeline(pipeline, n, dtype)), "pipeline")
    with st.expander("Per-call figures (tokens, score tables, FLOPs, traced peaks)"):
        W.table(pd.DataFrame([{k: v for k, v in r.items() if k != "traced_peak_bytes"} for r in traced["rows"]]),
                "planner-blocks")
    times_section(model, n, dtype)
    generation_section(pipeline, width, height, dtype)


def generation_section(pipeline: str, width: int, height: int, dtype: str) -> None:
    """A whole generation's predicted time on every GPU of the table, per backend (planner/generation.py)."""
    from profiler.spec import InputError

    steps = int(st.number_input("Steps of the generation", 1, 200, 30, key="plan_steps"))
    try:
        times = W.load_generation_times(pipeline, width, height, steps, dtype)
    except InputError as e:
        st.error(str(e))
        return
    st.subheader(f"Predicted time of a whole {pipeline} generation, {width}x{height}, {steps} steps, one image "
                 f"under classifier-free guidance, {dtype}: per GPU and backend")
    st.caption("Text encoding, every denoising step, the VAE decode: each GPU's published throughput and bandwidth "
               "at the efficiencies its architecture's kernels are published to reach (or assumed, and said so: "
               "attnprof plan --pipeline ... --gpu NAME names each figure's source). An estimate, not a measurement.")
    wide = times.pivot(index="gpu", columns="backend", values="total_s").reindex(columns=list(W.GENERATION_BACKENDS))
    W.table(wide.round(2).reset_index().rename(columns={b: f"{b} (s)" for b in W.GENERATION_BACKENDS}), "generation")


def times_section(model: str, n: int, dtype: str) -> None:
    """Predicted time per backend and size on a GPU of the table (profiler/gpus.py): its published figures at the
    efficiencies its architecture's kernels are published (or assumed) to reach."""
    from profiler import gpus
    from profiler.spec import InputError

    gpu = W.choice_ui("GPU for the time", gpus.names(), "plan_gpu", "H100-SXM")
    try:
        times = W.load_times(model, n, dtype, gpu)
    except InputError as e:  # no such tensor rate on this GPU (bfloat16 on a T4)
        st.error(str(e))
        return
    st.subheader(f"Predicted forward time per backend and size on the {gpu} ({model}, batch {n}, {dtype})")
    st.caption(f"{gpus.describe(gpus.get(gpu), dtype)}. Each call from its FLOPs and the bytes its backend moves, the "
               "rest of the forward from its own ops, at the efficiencies of the GPU's architecture "
               "(planner/timing.py; attnprof plan --model ... --gpu NAME names each figure's source); attnprof plan "
               "--results calibrates it on stored runs of the device you have. An estimate, not a measurement.")
    W.chart(times, C.planner_times([f"{s}x{s}" for s in W.TIME_SIZES]))
