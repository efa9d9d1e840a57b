"""A cell whose U-Net runs compiled (the `compile` setting): `regional`, diffusers' compile_repeated_blocks (the
U-Net's BasicTransformerBlocks, each shape compiled once and shared by the blocks of that shape), or `full`,
torch.compile of the whole U-Net (nn.Module.compile, in place). Both with dynamic=False, a graph per shape, as a
pipeline at a fixed size runs. A ControlNet beside the U-Net stays eager.

The compiled graph is the user's: the backend's own processors, with no recorder around them (its Python would be
traced into the graph, and its pass counter would make Dynamo recompile every forward). So:
- the calls' rows (block, shapes) come from one eager forward with the recorder, before compiling;
- compile_s: the first compiled forward, in which Dynamo and Inductor compile (and which runs once), apart from the
  timed forwards; compile_cache says whether Inductor compiled its graphs (cold) or found them in its FX graph
  cache (warm). Dynamo's in-memory caches are emptied before and after each cell, so every cell traces afresh and
  its graph breaks (Dynamo's counters) are its own;
- forward times: warm-up and timed forwards as for eager (probes: the device's clock, the allocator's peak);
- per call: the attention op of the backend (its record's attention_op: SDPA's kernel, xformers', flash-attn's), which
  Inductor calls as it is, found in `repeats` traced forwards: the n-th op is the n-th call (a U-Net's attention
  calls run one after the other on the data path), checked against each call's shapes. Its time is the op's own
  (the GPU kernels it launched on CUDA), without the projections that eager per-call times hold; its memory is the
  allocation timeline within the op. Where there is no such op (naive, the chunked backends: matmuls and a softmax
  that Inductor fuses with what is around them) or the ops do not match the calls, the calls get no time and the
  cell says why in attention_note: the forward's time stands, never a made-up split.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from ..attention import backends
from ..unet import models
from ..attention.recorder import Recorder, swapped
from ..spec import CellSpec
from .limits import roof_of
from .probes import NvmlSampler, traced
from .trace import _CPU, _CUDA, attention_op, op_calls, trace_windows


@contextmanager
def compiled(unet: torch.nn.Module, mode: str):
    """The U-Net compiled in place for the duration (regional or full) and made eager again on exit; Dynamo's
    caches emptied before and after (flex's compiled kernels with them: CompileClock forgets its shapes, so that
    a flex cell after this one compiles in its compile pass again, not in a timed forward). A compile past Dynamo's
    recompile limit raises instead of running that frame eager unsaid."""
    from ..attention.fused import CompileClock

    torch._dynamo.reset()
    CompileClock.seen.clear()
    try:
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            if mode == "regional":
                unet.compile_repeated_blocks(dynamic=False)
            else:
                unet.compile(dynamic=False)
            yield unet
    finally:
        for module in unet.modules():
            module._compiled_call_impl = None
        torch._dynamo.reset()
        CompileClock.seen.clear()


def dynamo_counts() -> dict:
    """Dynamo's and Inductor's counters now (they only grow): graph breaks by reason, graphs, FX graph cache."""
    from torch._dynamo.utils import counters

    return {"breaks": dict(counters["graph_break"]), "graphs": counters["stats"]["unique_graphs"],
            **{k: counters["inductor"][f"fxgraph_cache_{k}"] for k in ("hit", "miss", "bypass")}}


def compile_report(before: dict, after: dict) -> dict:
    """What compiling did between two dynamo_counts(): graph breaks (and their commonest reasons), graphs
    compiled, and whether Inductor's FX graph cache was cold (it compiled every graph) or warm (it had them)."""
    breaks = {r: n - before["breaks"].get(r, 0) for r, n in after["breaks"].items() if n > before["breaks"].get(r, 0)}
    hit, miss, bypass = (after[k] - before[k] for k in ("hit", "miss", "bypass"))
    cache = ("warm" if hit and not (miss or bypass) else "cold" if not hit else
             f"partly warm: {hit} of {hit + miss + bypass} graphs from Inductor's cache")
    reasons = "; ".join(f"{n}x {r.splitlines()[0][:120]}" for r, n in sorted(breaks.items(), key=lambda x: -x[1])[:3])
    return {"graph_breaks": sum(breaks.values()), "graph_break_reasons": reasons,
            "compiled_graphs": after["graphs"] - before["graphs"], "compile_cache": cache}


def matched(rows: list[dict], ops: list[dict], backend: str) -> str:
    """'' where the ops are the calls one to one (as many, each with its call's query and key shapes); else why
    the calls get no time of their own."""
    if attention_op(backend) is None:
        return (f"{backends.label(backend)}'s attention is several ops (matmuls, a softmax) that Inductor compiles "
                "together with what is around them: no op of its own per call to time, so the forward's time stands "
                "alone")
    if len(ops) != len(rows):
        return f"the compiled forward ran {len(ops)} attention ops for {len(rows)} calls: no per-call time"
    for row, op in zip(rows, ops):
        q, k = (op["shapes"] + [[], []])[:2]
        if sorted(q) != sorted([row["batch"], row["heads"], row["tokens_q"], row["head_dim"]]) \
                or row["tokens_k"] not in k:
            return (f"the compiled forward's attention op {op['name']} {q} x {k} is not call {row['call_index']} "
                    f"({row['block']}, {row['tokens_q']} x {row['tokens_k']} tokens): no per-call time")
    return ""


def measure_compiled(spec: CellSpec, cache, repeats: int, warmup: int, dev, extra: dict,
                     trace_dir) -> tuple[dict, list[dict]]:
    """measure_cell for a compiled cell (see the module's text)."""
    from .rows import attention_summary, cell_row, timed_forwards

    reference = cache.reference(spec)
    forwards_s, cache.reference_forward_s = cache.reference_forward_s, 0.0
    work, unet = cache.get(spec.model, spec.dtype, spec.device, spec.settings)
    inputs = work.inputs(unet, spec.batch, spec.width, spec.height)
    factory = lambda: backends.make_processor(spec.backend, **spec.options)  # noqa: E731
    dev.begin_cell()
    with torch.no_grad(), NvmlSampler(dev) as nvml, work.applied(unet):
        weights = models.weights_bytes(unet)
        t0 = time.perf_counter()
        with Recorder(unet, processor=factory) as rec:  # eager, once: the calls' blocks and shapes
            work.forward(unet, inputs)
        mode = dict(spec.settings)["compile"]
        with swapped(unet, lambda block, original: factory()), compiled(work.unet(unet), mode):
            before, t1 = dynamo_counts(), time.perf_counter()
            work.forward(unet, inputs)
            dev.synchronize()
            compile_s, report = time.perf_counter() - t1, compile_report(before, dynamo_counts())
            timed = timed_forwards(work, unet, inputs, dev, warmup, repeats)
            traces, cpu_forward_peak = _traced_forwards(work, unet, inputs, dev, repeats, spec, trace_dir)
        forwards_s += time.perf_counter() - t0 - compile_s
    rows = rec.passes()[0]
    note = next((n for n in (matched(rows, ops, spec.backend) for ops in traces) if n), "")  # every traced forward
    roof = roof_of(extra)
    clock = {"time_source": "cupti" if dev.kernel_clock else "host clock"}  # an op's GPU kernels, or its own time
    blocks = [{**_call_row(spec, row, [] if note else [ops[i] for ops in traces], roof), **clock}
              for i, row in enumerate(rows)]
    cell = cell_row(spec, reference, inputs, weights, timed, None if dev.allocator else cpu_forward_peak, dev, nvml)
    cell.update(**attention_summary(blocks, roof), **report, **clock, forwards_total_s=forwards_s,
                compile_s=compile_s,
                attention_note=note, attention_timing="the attention op's time in a traced compiled forward")
    cell["attention_op_time_ms"] = cell["attention_time_ms"] if not note else None
    return cell, blocks


def _traced_forwards(work, unet, inputs, dev, repeats: int, spec: CellSpec, trace_dir) -> tuple[list, int]:
    """`repeats` compiled forwards under the profiler, with the device's allocation timeline: per forward the
    attention ops in order (op_calls); and the first one's whole-forward CPU peak. The first one's trace is kept
    under trace_dir."""
    pattern, memory = attention_op(spec.backend), _CUDA if dev.allocator else _CPU
    out, cpu_peak = [], 0
    for i in range(repeats):
        with traced(dev, memory=True) as prof:
            work.forward(unet, inputs)
        events = list(prof.profiler.kineto_results.events())
        out.append(op_calls(events, pattern, memory) if pattern else [])
        if i == 0:
            cpu_peak = trace_windows(prof, {})[1]
            if trace_dir:
                prof.export_chrome_trace(str(trace_dir / f"{spec.cell_id}.trace.json"))
    return out, cpu_peak


def _call_row(spec: CellSpec, row: dict, ops: list[dict], roof: tuple) -> dict:
    """One call's row from its op in each traced forward; where the calls have no op of their own (no ops), its
    shape and memory model with status `fused` and no time."""
    from .rows import block_row

    if not ops:
        out = block_row(spec, row, [], {}, None, roof)
        return {**out, "peak_mem_bytes": None, "status": "fused"}
    return block_row(spec, row, [op["time_ms"] for op in ops], ops[0], None, roof)
