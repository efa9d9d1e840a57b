"""The per-call models of each backend: its transient peak memory (predicted_peak_bytes) and the bytes its attention
moves (bytes_moved, the x axis of the roofline: measure/limits.py places each call against the device's limits).
A backend's record names its model (backends.Backend.model, a key of MODELS; a plugin's may follow another
backend's instead: memory_like); each model is a few small functions of one call (Call).

Shapes: B batch, h heads, d head_dim, n = B*h, Tq / Tk query / key tokens, e the input dtype's bytes, a_q / a_k
one projection (n x T x d x e) on the query / key side.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable

import torch

from ..attention import backends
from ..attention.chunked import split_rows
from ..spec import torch_dtype


@dataclass(frozen=True)
class Call:
    """One attention call as the models read it: the recorder's row, the modelled backend's options, and the SDPA
    kernel it runs (the one it forces, or where PyTorch picks, row["sdpa_kernel"]: the planner's and the
    measurement's)."""
    row: dict
    dtype: str
    opts: dict
    kernel: str | None = None
    copies_qkv: bool = False

    @cached_property
    def e(self) -> int:
        return torch_dtype(self.dtype).itemsize

    @cached_property
    def n(self) -> int:
        return self.row["batch"] * self.row["heads"]

    @cached_property
    def d(self) -> int:
        return self.row["head_dim"]

    @cached_property
    def tq(self) -> int:
        return self.row["tokens_q"]

    @cached_property
    def tk(self) -> int:
        return self.row["tokens_k"]

    @cached_property
    def sb(self) -> int:
        """A score's bytes (4 where diffusers upcasts)."""
        return self.row["score_bytes"] // self.row["score_elements"]

    @cached_property
    def a_q(self) -> int:
        return self.n * self.tq * self.d * self.e

    @cached_property
    def a_k(self) -> int:
        return self.n * self.tk * self.d * self.e

    @cached_property
    def up(self) -> str:
        return _upcast(self.row, self.e)


def _upcast(row: dict, e: int) -> str:
    """How the call upcasts before its softmax: 'attention' (q and k to float32, scores in float32), 'softmax' (the
    scores to float32) or '' (none, or float32 inputs, where an upcast copies nothing). Stored rows of runs made
    before the field existed have it filled on read (report/frame.py)."""
    return "" if e == 4 else row.get("upcast") or ""


def _scores_phase(ns: int, row: dict, e: int, up: str, held: int) -> int:
    """The peak of diffusers' get_attention_scores over ns (batch*head) rows, `held` bytes alive besides: baddbmm
    with its empty input, an upcast copy of the scores, softmax with its input, the probabilities cast back."""
    tq, tk, d = row["tokens_q"], row["tokens_k"], row["head_dim"]
    n_s = ns * tq * tk  # score elements
    qk = ns * (tq + tk) * d * 4 if up == "attention" else 0  # float32 copies of q and k
    s1 = 4 if up == "attention" else e  # baddbmm's dtype
    s2 = 4 if up else e  # softmax's dtype
    moments = [held + qk + 2 * n_s * s1, held + qk + 2 * n_s * s2]
    if up == "softmax":
        moments.append(held + n_s * (s1 + 4))  # scores and their float32 copy
    if s2 != e:
        moments.append(held + qk + n_s * (s2 + e))  # probabilities and their cast to the input dtype
    return max(moments)


def cpu_flash_tiles(tokens_q: int, tokens_k: int, head_dim: int, itemsize: int, threads: int | None = None) -> int:
    """The per-thread buffers of aten's CPU flash kernel (_scaled_dot_product_flash_attention_for_cpu): per thread a
    float32 block of qs x kvs scores, its row max and sum and a qs x head_dim accumulator, and below float32 the
    block in the input dtype; qs = 256 query rows from 768 queries (64 from 192, else 32), kvs = 512 keys (fewer
    where there are fewer). Measured on this machine's 2 threads, float32, bfloat16 and float16, 64 to 4096 tokens,
    head_dim 8 to 160: exact."""
    qs = min(tokens_q, 256 if tokens_q >= 768 else 64 if tokens_q >= 192 else 32)
    kvs = min(512, tokens_k)
    per_thread = 4 * (qs * kvs + 2 * qs + qs * head_dim) + (itemsize < 4) * qs * kvs * itemsize
    return (threads or torch.get_num_threads()) * per_thread


def _on_cpu(row: dict) -> bool:
    """Whether the call runs on the CPU: row["device"] where the row has it (measured cells, the planner's trace),
    else the GPU that the planner targets by default."""
    return str(row.get("device", "cuda")).startswith("cpu")


# ---- peaks: each model's core, the bytes alive during attention over q, k and v (predicted_peak_bytes adds them)

def _naive_peak(c: Call) -> int:
    """AttnProcessor: scores, then the probabilities alive through bmm, head merge and to_out."""
    return max(_scores_phase(c.n, c.row, c.e, c.up, 0), c.n * c.tq * c.tk * c.e + 2 * c.a_q)


def _sliced_peak(c: Call) -> int:
    """The output zeros, and each slice's output alive into the next slice's scores."""
    n, tq, tk, d, e = c.n, c.tq, c.tk, c.d, c.e
    ns = min(c.opts["slice_size"], n)
    count, out_s = -(-n // ns), ns * tq * d * e
    last = (n - (count - 1) * ns) * tq * d * e
    loop = c.a_q + max(_scores_phase(ns, c.row, e, c.up, out_s if count > 1 else 0), ns * tq * tk * e + out_s)
    return max(loop, last + 2 * c.a_q)


def _split_peak(c: Call) -> int:
    """The output, one chunk's table in place, the chunk's probs @ v (upcast: float32 k and the query chunk)."""
    n, tk, d, e, sb = c.n, c.tk, c.d, c.e, c.sb
    r = min(c.tq, split_rows(n, tk, sb, c.opts["budget_bytes"]))
    s_c = n * r * tk * sb
    return c.a_q + s_c + (n * r * d * e if sb == e else 4 * n * tk * d + max(4 * n * r * d, n * r * (tk + d) * e))


def _subquad_peak(c: Call) -> int:
    """The output, one score block, the float32 accumulator, block @ v, running max / sum / rescale; upcast: a
    float32 query chunk, and each key chunk in float32 while its scores are taken."""
    n, d, e, sb = c.n, c.d, c.e, c.sb
    r, k = min(c.tq, c.opts["query_chunk"]), min(c.tk, c.opts["key_chunk"])
    s_c = n * r * k * sb
    if sb == e:
        return c.a_q + s_c + n * r * d * (4 + e) + 3 * n * r * 4
    return c.a_q + 8 * n * r * d + 8 * n * r + s_c + max(4 * n * k * d, 8 * n * r + n * r * (k + d) * e)


def _math_peak(c: Call) -> int:
    """aten's math kernel: float32 copies (below float32), scaled q and k, scores, softmax with its bool mask, the
    probabilities cast back, probs @ v in float32 and cast back."""
    e, a_q, a_k = c.e, c.a_q, c.a_k
    f = 4 / e
    ups = int((a_q + 2 * a_k) * f) if e < 4 else 0
    sq, sk, cl = int(a_q * f), int(a_k * f), c.row["batch"] > 1  # batches above 1 copy q, k and v for the bmms
    big = c.n * c.tq * c.tk
    return ups + sq + max(sk * (1 + cl) + sq * cl + 4 * big, 9 * big,
                          4 * big + (e < 4) * big * e + sq + max(cl * int(a_k * f), (e < 4) * a_q))


def _flex_eager_peak(c: Call) -> int:
    """FlexAttention uncompiled (torch's math_attention): float32 scores, their masked copy and softmax alive at
    once, a bool table of fully masked rows, below float32 the probabilities cast back (measured on the CPU in
    float32)."""
    big = c.n * c.tq * c.tk
    return c.a_q + 12 * big + big + (c.e < 4) * big * c.e


def _flex_peak(c: Call) -> int:
    """Compiled on the CPU: the output, and K and V reordered for its gemms; on CUDA a fused kernel's."""
    return c.a_q + 2 * c.a_k if _on_cpu(c.row) else _fused_peak(c)


def _sage_peak(c: Call) -> int:
    """Not measured here (CUDA only): the output, Q and K in int8 with head_dim padded to 64 / 128, and K smoothed
    (its mean over tokens taken off: a copy)."""
    d_pad = 64 if c.d <= 64 else 128
    return c.a_q + c.n * (c.tq + c.tk) * d_pad + c.a_k


def _fused_peak(c: Call) -> int:
    """Fused kernels: the output and a float32 logsumexp (mem-efficient: none, as no gradient is asked, but a
    float32 accumulator past head_dim 128), aten's CPU flash kernel its per-thread buffers, and where the kernel
    wants them so, copies of q, k and v."""
    n, tq, d, e = c.n, c.tq, c.d, c.e
    acc = n * tq * d * 4 if c.kernel == "efficient" and d > 128 and e < 4 else 0
    lse = 0 if c.kernel == "efficient" else n * tq * 4
    tiles = cpu_flash_tiles(tq, c.tk, d, e) if c.kernel == "flash" and _on_cpu(c.row) else 0
    return (c.a_q + 2 * c.a_k) * c.copies_qkv + c.a_q + lse + acc + tiles


# ---- bytes moved: QK^T, softmax, PV (the part `flops` counts; the projections left out of both)

def _table_moved(c: Call) -> int:
    """Q, K and V read and O written once, and each score's bytes through diffusers' get_attention_scores and PV
    (sliced: the same, a slice at a time): table_bytes_per_score."""
    return 2 * c.a_q + 2 * c.a_k + c.n * c.tq * c.tk * table_bytes_per_score(c.row.get("upcast") or "", c.e)


def table_bytes_per_score(upcast: str, e: int) -> int:
    """The bytes a score moves in diffusers' attention (baddbmm, softmax, the cast back, PV's bmm), e its inputs'
    size: the table written, read by the softmax, the probabilities written and read by PV (4e; 16 in float32);
    under upcast_softmax the table written in e, read and written again in float32 (.float()), the softmax in float32,
    its probabilities read and written back in e (.to(dtype)) and read by PV (4e + 16: 24 in half precision); under
    upcast_attention the table written in float32 from float32 inputs, the softmax in float32, cast back and read (16
    + 2e: 20)."""
    if e >= 4 or not upcast:
        return 4 * e
    return 4 * e + 16 if upcast == "softmax" else 16 + 2 * e


def _split_moved(c: Call) -> int:
    """The table's four passes, a chunk at a time, and K and V read again for each query chunk."""
    return 2 * c.a_q + 2 * c.a_k * _split_chunks(c) + 4 * c.row["score_bytes"]


def _subquad_moved(c: Call) -> int:
    """split's, and the float32 accumulator read and rewritten for each key chunk."""
    query_chunks, key_chunks = -(-c.tq // c.opts["query_chunk"]), -(-c.tk // c.opts["key_chunk"])
    return 2 * c.a_q + 2 * c.a_k * query_chunks + 4 * c.row["score_bytes"] + key_chunks * 2 * c.n * c.tq * c.d * 4


def _math_moved(c: Call) -> int:
    """The table's four passes in float32, after copying Q, K and V to float32 and before casting O back."""
    e, a_q, a_k = c.e, c.a_q, c.a_k
    f = 4 / e  # float32 operands
    casts = (a_q + 2 * a_k) * (1 + f) + a_q * (f + 1) if e < 4 else 0  # in: read, write f32; out: the reverse
    return int(f * (2 * a_q + 2 * a_k) + 4 * c.n * c.tq * c.tk * 4 + casts)


def _fused_moved(c: Call) -> int:
    """Q, K and V read once, O written once; where PyTorch picked its math kernel, the math kernel's."""
    return _math_moved(c) if c.kernel == "math" else 2 * c.a_q + 2 * c.a_k


# ---- tables: what a call allocates for its scores, as (bytes of one table, tables allocated per call)

def _no_tables(c: Call) -> tuple[int, int]:
    return 0, 0  # a table's bytes and how many such the call makes (or a list of such pairs)


def _whole_tables(c: Call) -> tuple[int, int]:
    """The scores and the probabilities: two tables of every score."""
    return c.n * c.tq * c.tk * c.sb, 2


def _sliced_tables(c: Call) -> tuple[int, int]:
    ns = min(c.opts["slice_size"], c.n)
    return ns * c.tq * c.tk * c.sb, 2 * _slices(c)


def _split_tables(c: Call) -> tuple[int, int]:
    """One table a chunk: its softmax runs in place (attention/chunked.py)."""
    return c.n * min(c.tq, split_rows(c.n, c.tk, c.sb, c.opts["budget_bytes"])) * c.tk * c.sb, _split_chunks(c)


def _subquad_tables(c: Call) -> list[tuple[int, int]]:
    """Each chunk's one table (its exponentials taken in place) at its own size: the last query and key chunks are
    the remainders. Counted in a user's process: 320 MiB of new pages a forward at 256x256, 1,622 at 384x384, where
    two tables a chunk said 640 and 3,240."""
    def sizes(n: int, chunk: int) -> list[int]:
        return [min(chunk, n - i) for i in range(0, n, chunk)]

    return [(c.n * r * k * c.sb, 1) for r in sizes(c.tq, c.opts["query_chunk"])
            for k in sizes(c.tk, c.opts["key_chunk"])]


def _math_tables(c: Call) -> tuple[int, int]:
    return c.n * c.tq * c.tk * 4, 2


# ---- chunks: how many a chunked backend cuts one call into

def _one(c: Call) -> int:
    return 1


def _slices(c: Call) -> int:
    return -(-c.n // c.opts["slice_size"])


def _split_chunks(c: Call) -> int:
    return -(-c.tq // split_rows(c.n, c.tk, c.sb, c.opts["budget_bytes"]))


def _subquad_chunks(c: Call) -> int:
    return -(-c.tq // c.opts["query_chunk"]) * -(-c.tk // c.opts["key_chunk"])


# ---- loops: a chunked core's Python loops, for the host's count of its ops (planner/host.py)

def _split_loops(c: Call) -> tuple[list[tuple[int, int]], Callable]:
    """One loop, over query rows (split_rows, from the budget); the budget under which a chunk is r rows."""
    return ([(c.tq, split_rows(c.n, c.tk, c.sb, c.opts["budget_bytes"]))],
            lambda r: {"budget_bytes": c.n * c.tk * c.sb * r})


def _subquad_loops(c: Call) -> tuple[list[tuple[int, int]], Callable]:
    """A loop of query chunks and, in each, one of key chunks."""
    return ([(c.tq, c.opts["query_chunk"]), (c.tk, c.opts["key_chunk"])],
            lambda q, k: {"query_chunk": q, "key_chunk": k})


@dataclass(frozen=True)
class Model:
    peak: Callable[[Call], int]  # the core's transient (predicted_peak_bytes adds q, k, v and the output)
    moved: Callable[[Call], int]
    chunks: Callable[[Call], int] = _one
    tables: Callable[[Call], tuple[int, int]] = _no_tables
    loops: Callable[[Call], tuple[list[tuple[int, int]], Callable]] | None = None  # a loop of many chunks, or None


MODELS = {
    "naive": Model(_naive_peak, _table_moved, tables=_whole_tables),
    "sliced": Model(_sliced_peak, _table_moved, _slices, _sliced_tables),
    "split": Model(_split_peak, _split_moved, _split_chunks, _split_tables, _split_loops),
    "subquad": Model(_subquad_peak, _subquad_moved, _subquad_chunks, _subquad_tables, _subquad_loops),
    "math": Model(_math_peak, _math_moved, tables=_math_tables),  # aten's math kernel (sdpa-math)
    "flex-eager": Model(_flex_eager_peak, _math_moved, tables=_math_tables),  # diffusers' uncompiled FlexAttention
    "flex": Model(_flex_peak, _fused_moved),
    "sage": Model(_sage_peak, _fused_moved),
    "fused": Model(_fused_peak, _fused_moved),  # SDPA's fused kernels, xformers, flash-attn
}


def _call(name: str, row: dict, dtype: str, options: dict) -> tuple[Model, Call]:
    """The model of the backend's calls (its own, or that of the backend it is memory_like at that one's default
    options; a processor map's: its block's backend's) and this call as the model reads it."""
    name, options = backends.for_call(name, options, row)
    opts, own = backends.check_options(name, options), backends.BACKENDS[name]
    b = backends.BACKENDS[own.memory_like] if own.memory_like else own
    if own.memory_like:
        opts = backends.check_options(own.memory_like, {})
    if b.model not in MODELS:
        raise ValueError(f"backend {name!r} names model {b.model!r}: use one of {', '.join(MODELS)}")
    kernel = b.sdpa_kernel or (row.get("sdpa_kernel") if b.picks_sdpa_kernel else None)
    return MODELS[b.model], Call(row, dtype, opts, kernel, own.copies_qkv)


def predicted_peak_bytes(name: str, row: dict, dtype: str, **options) -> int:
    """Transient peak of one processor call over what was allocated when it began (the output counts), following the
    processor op by op as it allocates and frees (tests/test_forward.py holds it to the fake-tensor trace of every
    call of SD 1.5, SD 2.1 and SDXL, both batch sizes, with and without upcast).

    Every processor first holds q, k, v (a_q + 2 a_k) and ends holding its head-merged output and to_out's output (2
    a_q); q, k and v are still alive then, but for the processors that free them first (Backend.frees_qkv: those of
    attention/fused.py, whose kernels write (B, Tq, h, d), so that their head merge is a view). Scores take
    row["score_bytes"] / row["score_elements"] bytes (4 where diffusers upcasts). `sdpa` on CUDA follows the kernel named in
    row["sdpa_kernel"]; a dispatcher backend (diffusers:<name>) follows the kernel it runs, flex on the CPU adds the
    K and V copies that the compiled CPU kernel reorders for its gemms (row["device"], default CUDA), and the CPU
    flash kernel its per-thread buffers (cpu_flash_tiles, at this process's thread count). Left out: compiled flex's
    per-thread tiles (under 0.5 MiB per thread), kernel workspaces other than the mem-efficient kernel's float32
    accumulator (head_dim > 128 in float16 / bfloat16), and the mask diffusers repeats per head."""
    model, c = _call(name, row, dtype, options)
    core, a_q, a_k = model.peak(c), c.a_q, c.a_k
    if backends.BACKENDS[backends.for_call(name, options, row)[0]].frees_qkv:  # attend() returns (B, Tq, C): q, k and v are gone before to_out runs
        return int(max(a_q + 2 * a_k + core, 2 * a_q))
    return int(a_q + 2 * a_k + max(core, 2 * a_q))  # every processor ends holding its merged output and to_out's


def bytes_moved(name: str, row: dict, dtype: str, **options) -> int:
    """The bytes one call's attention reads and writes in the backend's own model: the part that `flops` counts
    (QK^T, softmax, PV; the projections left out of both). A fused kernel reads Q, K and V and writes O once; a
    backend that materialises the score table passes over it four times (in float32 for aten's math kernel, sdpa's
    where PyTorch picks it included); the chunked backends pass over their chunks' tables and read K and V again for
    each query chunk. Tables take row["score_bytes"] (4 bytes a score where diffusers upcasts). A model of traffic to
    memory: tables small enough to stay in a cache move less."""
    model, c = _call(name, row, dtype, options)
    return int(model.moved(c))


def chunks(name: str, row: dict, dtype: str, **options) -> int:
    """How many chunks a chunked backend cuts one call into (1 for the others, a plugin's memory_like included)."""
    name, options = backends.for_call(name, options, row)
    opts, b = backends.check_options(name, options), backends.BACKENDS[name]
    return MODELS[b.model].chunks(Call(row, dtype, opts)) if b.model in MODELS else 1


def loops(name: str, row: dict, dtype: str, **options) -> tuple[list[tuple[int, int]], Callable] | None:
    """A chunked backend's loops over one call: each loop's (tokens, chunk), outer first, and made(*chunks), the
    backend's options under which the call runs chunks of those sizes; None for a backend whose own model has no loop
    of many chunks (sliced's, over batch*heads, runs a few dozen times at most; a plugin's memory_like runs its own
    processor)."""
    opts, b = backends.check_options(name, options), backends.BACKENDS[name]
    model = MODELS.get(b.model)
    return model.loops(Call(row, dtype, opts)) if model and model.loops else None


def working_set(name: str, row: dict, dtype: str, **options) -> int:
    """The bytes one pass of the call's attention works over at a time: its core's transient (the tables alive at
    once, one slice's or chunk's for the chunked backends; a fused kernel's tiles). Where that stays in the device's
    last-level cache, its traffic runs at the cache's bandwidth (planner/timing.py)."""
    model, c = _call(name, row, dtype, options)
    return int(model.peak(c))


def writes_tables(name: str, row: dict, dtype: str, **options) -> bool:
    """Whether the call's attention writes its scores to memory as tables (whole, a slice's or a chunk's) between
    separate GEMMs and a softmax, as the materialised and chunked backends and aten's math kernel do; a fused
    kernel's stay in its tiles."""
    model, _ = _call(name, row, dtype, options)
    return model.tables is not _no_tables


def new_page_bytes(name: str, row: dict, dtype: str, fresh_min: int | None, **options) -> int:
    """The bytes of the call's score tables that get new pages from the kernel: every table of at least fresh_min
    bytes (the CPU's allocator maps each anew: devices.Cpu.fresh_min_bytes); 0 where fresh_min is None (CUDA's
    caching allocator keeps its blocks)."""
    if not fresh_min:
        return 0
    model, c = _call(name, row, dtype, options)
    tables = model.tables(c)
    return int(sum(size * count for size, count in (tables if isinstance(tables, list) else [tables])
                   if size >= fresh_min))
