"""make gpu-check: the GPU path proven in one command (under 8 minutes on one H200-class GPU).

1. The GPU checks (the same functions `pytest -m gpu` runs, in tests/test_gpu.py), each PASS / FAIL / SKIP with
   its figure: random and folder builds on cuda (and cuda:1 where there is one); the naive backend's allocator
   peak against its memory model; CUDA-event time against a synchronized wall clock, and each call's event time
   against the GPU time of the kernels it launched; kernels credited to the call that launched them, named by
   probes.sdpa_kernel from GPU kernels only; NVML's memory of this process against the allocator; a provoked OOM
   followed by a cell that runs; a sweep's parent that holds no CUDA context.
2. configs/sweeps/default.yaml at 512, 768 and 1024 (SD 1.5 and SDXL base, every backend, fp16), through workers;
   then the checks on its cells: every ok cell's measured forward peak against the planner's
   predicted_forward_peak_bytes (within 5%), the SDPA kernel each sdpa call ran against the one the planner names
   for this GPU (and against torch._fused_sdp_choice), and the allocator holding nothing beside the model under
   test and its forward but the libraries' workspaces.
3. docs/gpu-validation.md: the machine, each check with its figure, and the backends' table.

On a machine without CUDA it says so in one line and exits 0, writing nothing; where NVML sees a GPU but torch has
no CUDA (a CPU-only torch on a GPU box) it says so in one line and exits 1. `--device cpu` runs the same flow on the
CPU to try the script (the checks that need CUDA SKIP; those on the sweep's cells run on the CPU's cells); give
--report to write its report somewhere else.
"""
from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import pandas as pd
import torch

from . import backends, devices, models
from .fmt import human_bytes, table
from .store import REPO, Run, environment
from .execute.grid import Sweep, load
from .execute.sweep import execute

REPORT = REPO / "docs" / "gpu-validation.md"
SDPA_BACKENDS = {"sdpa-flash": "flash", "sdpa-efficient": "efficient", "sdpa-cudnn": "cudnn"}  # forced kernels
PEAK_TOLERANCE = 0.05  # measured forward peak against the planner's prediction
WORKSPACES_MAX = 2**30  # what the allocator may hold beyond the model and its forward: the libraries' workspaces


class Skip(Exception):
    """A check that cannot run here, with the reason; never reported as PASS."""


@dataclass
class Context:
    device: str = "cuda"
    out: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="attnprof-gpu-")))
    models: tuple[str, ...] | None = None  # of the default sweep (None: default.yaml's)
    sizes: tuple[int, ...] = (512, 768, 1024)
    _sweep: tuple | None = None

    def need_cuda(self) -> None:
        if not self.device.startswith("cuda") or not torch.cuda.is_available():
            raise Skip(f"needs a CUDA device (here: {self.device})")

    def run(self, model: str, sizes, backends_, force=False, workers=False, repeats=3, warmup=1,
            **kw) -> tuple[pd.DataFrame, pd.DataFrame]:
        sweep = Sweep(models=(model,), sizes=tuple((s, s) for s in sizes), dtypes=("float16",),
                      backends=tuple((b, ()) for b in backends_), device=self.device, repeats=repeats, warmup=warmup,
                      out=str(self.out), **kw)
        return Run.open(execute(sweep, workers=workers, force=force, progress=False, command="gpu-check").run_path)\
            .read()

    def default_sweep(self) -> Sweep:
        default = load(REPO / "configs" / "sweeps" / "default.yaml")
        return replace(default, models=tuple(self.models or default.models), sizes=tuple((s, s) for s in self.sizes),
                       repeats=3, warmup=1, device=self.device, out=str(self.out / "sweep"), also=(),
                       dtypes=default.dtypes if self.device.startswith("cuda") else ("float32",))

    def sweep(self) -> tuple[Run, pd.DataFrame, pd.DataFrame]:
        """The default sweep through workers, run once (by the first check that needs it): (run, cells, blocks)."""
        if self._sweep is None:
            sweep = self.default_sweep()
            run = Run.open(execute(sweep, progress=True, command="gpu-check").run_path)
            self._sweep = (run, *run.read())
        return self._sweep


def _ok(cells: pd.DataFrame) -> None:
    bad = cells[cells["status"] != "ok"]
    assert not len(bad), "; ".join(f"{r.backend} {r.width}: {r.status} {r.error}" for r in bad.itertuples())


# ---- the checks: each returns its figure, raises Skip, or fails an assert

def check_random_build_on_cuda(ctx: Context) -> str:
    ctx.need_cuda()
    t0 = time.perf_counter()
    unet = models.build("sd15", weights="random", device="cuda", dtype="float16")
    seconds = time.perf_counter() - t0
    placed = {p.device for p in unet.parameters()}
    assert placed == {torch.device("cuda", 0)}, placed
    assert all(torch.isfinite(p).all() for p in unet.parameters())
    n = sum(p.numel() for p in unet.parameters())
    del unet
    torch.cuda.empty_cache()
    return f"sd15 ({n / 1e6:.2f}M parameters) built with random weights on cuda:0 in {seconds:.1f} s"


def check_cuda1_is_measured_on_cuda1(ctx: Context) -> str:
    ctx.need_cuda()
    if torch.cuda.device_count() < 2:
        raise Skip(f"one CUDA device here ({torch.cuda.get_device_name(0)}): cuda:1 needs a second")
    before = torch.cuda.memory_allocated(0)
    cells, blocks = replace(ctx, device="cuda:1").run("tiny-sd15", [512], ["naive"], repeats=2)
    _ok(cells)
    assert torch.cuda.memory_allocated(0) == before, "cuda:0's allocator moved while cuda:1 was measured"
    c = cells.iloc[0]
    assert c["device"] == "cuda:1" and c["attention_peak_mem_bytes"] > 0 and blocks["time_ms"].gt(0).all()
    return f"naive on cuda:1: attention peak {human_bytes(c['attention_peak_mem_bytes'])}, cuda:0 untouched"


def check_folder_build_on_cuda(ctx: Context) -> str:
    ctx.need_cuda()
    from .measure.cell import ModelCache

    saved = models.build("tiny-sd15", weights="random", dtype="float32", seed=7)
    folder = ctx.out / "ckpt"
    saved.save_pretrained(folder / "unet", safe_serialization=True)
    _, unet = ModelCache().get(str(folder), "float16", "cuda")
    for (name, p), (_, q) in zip(unet.named_parameters(), saved.named_parameters(), strict=True):
        assert p.device.type == "cuda" and torch.equal(p.cpu(), q.half()), name
    return f"a saved diffusers folder loaded on cuda with its weights ({len(list(unet.parameters()))} tensors equal)"


def check_naive_peak_within_5_percent(ctx: Context) -> str:
    ctx.need_cuda()
    cells, blocks = ctx.run("sd15", [512], ["naive"])
    _ok(cells)
    big = blocks[blocks["score_bytes"] >= blocks["score_bytes"].max() / 16]  # where the score table dominates
    ratio = big["peak_mem_bytes"] / big["predicted_peak_bytes"]
    assert ratio.between(0.95, 1.05).all(), ratio.round(3).tolist()
    return (f"sd15 512x512 fp16: measured/predicted {ratio.min():.3f}..{ratio.max():.3f} over {len(ratio)} calls "
            f"(largest {human_bytes(big['peak_mem_bytes'].max())})")


def check_event_time_matches_wall_clock(ctx: Context) -> str:
    ctx.need_cuda()
    from .measure.probes import CallTimer
    from .recorder import Recorder
    from .measure.cell import ModelCache, measure_cell

    cache = ModelCache()
    spec = Sweep(models=("sd15",), dtypes=("float16",), device="cuda").cells()[0]  # sdpa at 512x512
    cell, _ = measure_cell(spec, cache, repeats=10, warmup=2)
    source, unet = cache.get("sd15", "float16", "cuda")
    inputs = models.example_inputs(unet, 1, 512, 512)
    dev, n = devices.get("cuda"), 10
    with torch.no_grad(), Recorder(unet, processor=lambda: backends.make_processor("sdpa"), around=CallTimer(dev)):
        unet(**inputs)
        dev.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            unet(**inputs)
        dev.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3 / n
    ratio = cell["forward_time_ms"] / wall_ms
    assert 0.9 <= ratio <= 1.1, f"events {cell['forward_time_ms']:.2f} ms, wall {wall_ms:.2f} ms"
    return f"sd15 512x512 sdpa: events {cell['forward_time_ms']:.2f} ms, wall clock {wall_ms:.2f} ms ({ratio:.3f}x)"


def check_call_times_match_their_gpu_kernels(ctx: Context) -> str:
    """Each call's CUDA-event time (the median of the timed forwards) against the summed GPU time of the kernels
    that call launched in the probe pass (the profiler's trace): never below it, and where the GPU is busy for a
    millisecond or more (naive at 1024: large kernels, launches hidden) no more than 1.5x it. Launch-bound small
    calls are reported, not judged."""
    ctx.need_cuda()
    cells, blocks = ctx.run("sd15", [1024], ["naive", "sdpa"])
    _ok(cells)
    ratio = blocks["time_ms"] / blocks["gpu_time_ms"]
    assert blocks["gpu_time_ms"].gt(0).all(), "a call with no GPU kernel credited"
    assert ratio.min() >= 0.9, blocks.loc[ratio.idxmin(), ["backend", "block", "time_ms", "gpu_time_ms"]].to_dict()
    busy = blocks["gpu_time_ms"] >= 1.0
    assert busy.any(), "no call kept the GPU busy for 1 ms"
    assert ratio[busy].max() <= 1.5, blocks[busy].loc[ratio[busy].idxmax(), ["block", "time_ms", "gpu_time_ms"]]
    small = ratio[~busy]
    rest = f"; {len(small)} shorter calls {small.min():.2f}..{small.max():.2f}x (launch-bound)" if len(small) else ""
    return (f"sd15 1024x1024 naive and sdpa: {int(busy.sum())} calls over 1 ms of GPU time, event time / kernel "
            f"time {ratio[busy].min():.3f}..{ratio[busy].max():.3f}{rest}")


def check_kernels_credited_to_their_call(ctx: Context) -> str:
    """Backends alternate from one attention module to the next, so a kernel credited by timestamp to the next call
    (GPU work runs after its launch) would carry the other backend's name. Only GPU kernels (CUDA-device events)
    count, named by probes.sdpa_kernel (cuDNN's names carry "flash": never taken for flash)."""
    ctx.need_cuda()
    from .measure.probes import CallProbe, sdpa_kernel, trace_windows, traced
    from .recorder import Recorder

    fused = [b for b in [*SDPA_BACKENDS, "xformers", "flash-attn"]
             if backends.availability(b, "cuda", "float16", (40, 80, 160))[0]]
    if not fused:
        raise Skip("no fused backend is available on this GPU")
    unet = models.build("sd15", weights="random", device="cuda", dtype="float16")
    inputs = models.example_inputs(unet, 1, 512, 512)
    groups = [[b for b in SDPA_BACKENDS if b in fused]] + [[b] for b in ("xformers", "flash-attn") if b in fused]
    dev, seen = devices.get("cuda"), {}
    for group in filter(None, groups):
        order = itertools.cycle(group)
        chosen = []

        def factory():
            chosen.append(next(order))
            return backends.make_processor(chosen[-1])

        probe = CallProbe(dev)
        with torch.no_grad(), Recorder(unet, processor=factory, around=probe) as rec, traced(dev) as prof:
            unet(**inputs)
        per_call, _ = trace_windows(prof, probe.ranges)
        by_block = dict(zip([k.removesuffix(".processor") for k in unet.attn_processors], chosen))
        for row in rec.rows:
            backend, call = by_block[row["block"]], per_call[row["call_index"]]
            assert call["gpu_kernels"], f"call {row['call_index']} ({backend}) got no GPU attention kernel"
            named = sdpa_kernel(call["gpu_kernels"])
            want = SDPA_BACKENDS.get(backend)
            assert named == want if want else named in ("flash", "efficient"), (backend, named, call["gpu_kernels"])
            seen.setdefault(backend, call["gpu_kernels"][0])
    del unet
    torch.cuda.empty_cache()
    return "; ".join(f"{b}: {k}" for b, k in seen.items()) + " (each on its own call, backends alternating)"


# the newer backends gpu-check runs, and whose GPU kernels (probes.BACKEND_KERNELS) each of their calls must show
NEW_BACKENDS = {"sage": "sage", "flex": "flex", "diffusers:_flash_3": "flash-attn-3"}


def new_kernel_named(backend: str, kernel: str) -> bool:
    """Whether a call's recorded kernels include the backend's own GPU kernel (a CPU-side op of the same name does
    not count; another backend's kernel never does)."""
    from .measure.probes import BACKEND_KERNELS

    return any(BACKEND_KERNELS[NEW_BACKENDS[backend]].search(k) for k in kernel.split(","))


def available_new_backends(device: str, head_dims: tuple[int, ...]) -> tuple[list[str], list[str]]:
    """(the backends of NEW_BACKENDS that run here at these head dims, why each of the others does not)."""
    runs, why = [], []
    for name in NEW_BACKENDS:
        ok, reason = backends.availability(name, device, "float16", head_dims)
        (runs.append(name) if ok else why.append(f"{name}: {reason}"))
    return runs, why


def check_sage_flex_and_fa3_run_and_record_their_kernels(ctx: Context) -> str:
    """sage, flex and diffusers:_flash_3 where available, on SD 2.1's U-Net at 512x512 (head_dim 64, which each of
    them takes; SD 1.5's 160-dim blocks are beyond sage): each cell ok and within the fp16 tolerance of the fp32
    reference, every call's kernel the backend's own, flex's compile time recorded apart from its forwards."""
    ctx.need_cuda()
    runs, why = available_new_backends(ctx.device, (64,))
    if not runs:
        raise Skip("none of sage, flex, diffusers:_flash_3 runs here: " + "; ".join(why))
    cells, blocks = ctx.run("sd21-base", (512,), runs, workers=True)
    _ok(cells)
    assert cells["error_ok"].all(), cells[["backend", "max_rel_err"]].to_dict("records")
    seen = []
    for c in cells.itertuples():
        kernels = blocks[blocks["cell_id"] == c.cell_id]["kernel"]
        assert len(kernels) and all(new_kernel_named(c.backend, k) for k in kernels), (c.backend, set(kernels))
        compile_s = f", compile {c.compile_s:.1f} s" if c.backend == "flex" else ""
        seen.append(f"{c.backend}: {kernels.iloc[0][:60]} (rel err {c.max_rel_err:.1e}{compile_s})")
    if "flex" in runs:
        assert cells.set_index("backend").loc["flex", "compile_s"] > 0
    return "; ".join(seen + [f"not run: {w}" for w in why])


def check_nvml_process_memory_covers_the_allocator(ctx: Context) -> str:
    """NVML's memory of this process holds the allocator's reserved memory plus what the allocator cannot see (the
    CUDA context, kernel images): the figure the planner lists under not_counted."""
    ctx.need_cuda()
    cells, _ = ctx.run("sd15", [768], ["sdpa"])
    _ok(cells)
    c = cells.iloc[0]
    if not str(c["nvml_status"]).startswith("ok"):
        raise Skip(f"NVML: {c['nvml_status']}")
    process, reserved = c["nvml_process_used_max_bytes"], c["allocator_reserved_max_bytes"]
    if process is None or process != process:
        raise Skip(f"NVML lists no process with this pid (a container's pid namespace): {c['nvml_status']}")
    assert process >= reserved, (human_bytes(process), human_bytes(reserved))
    assert process - reserved < 4 * 2**30, f"{human_bytes(process - reserved)} outside the allocator"
    return (f"this process per NVML {human_bytes(process)} = reserved {human_bytes(reserved)} + "
            f"{human_bytes(process - reserved)} outside the allocator (CUDA context, kernels)")


def check_provoked_oom_then_ok(ctx: Context) -> str:
    ctx.need_cuda()
    dev = torch.device("cuda", 0)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, 12 * 2**30 / total), dev)  # a 12 GiB card
    try:
        cells, _ = ctx.run("sd15", [2048, 512], ["naive"], force=True, repeats=1, warmup=0)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
        torch.cuda.empty_cache()
    by_size = cells.set_index("width")
    assert by_size.loc[2048, "status"] == "oom", by_size.loc[2048, ["status", "error"]].tolist()
    assert "GiB" in by_size.loc[2048, "error"]
    assert by_size.loc[512, "status"] == "ok", by_size.loc[512, ["status", "error"]].tolist()
    return f"naive 2048x2048 under a 12 GiB cap: oom ({by_size.loc[2048, 'error'][:120]}); then 512x512 ok"


def check_sweep_parent_holds_no_context(ctx: Context) -> str:
    ctx.need_cuda()
    code = ("import json; from profiler import devices; from profiler.store import Run; "
            "from profiler.execute.grid import Sweep; from profiler.execute.sweep import execute; "
            f"s = Sweep(models=('tiny-sd15',), sizes=((256, 256),), backends=(('sdpa', ()), ('naive', ())), "
            f"repeats=1, warmup=0, device='cuda', out={str(ctx.out / 'parent')!r}); "
            "run = Run.open(execute(s, progress=False).run_path); "
            "print(json.dumps([devices.primary_context_active(0), run.cells()['status'].tolist()]))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 0, p.stderr[-500:]
    active, statuses = json.loads(p.stdout.strip().splitlines()[-1])
    assert statuses == ["ok", "ok"], statuses
    if active is None:
        raise Skip("the cells ran ok, but libcuda.so.1 cannot be asked about the primary context here")
    assert active is False, "the sweep's parent holds a CUDA context"
    return "a sweep through workers (2 cells ok): its parent holds no CUDA context, the workers get the budget"


# ---- the checks on the default sweep's cells (on the CPU too, where its cells allow)

def check_forward_peak_matches_the_planner(ctx: Context) -> str:
    """Every ok cell at 512 and 1024: the forward's measured peak (weights + inputs + the allocator's peak over
    what the forward began with; on the CPU, the allocation trace's) within 5% of the planner's
    predicted_forward_peak_bytes, which README says is what torch.cuda.max_memory_allocated() reports."""
    _, cells, _ = ctx.sweep()
    ok = cells[(cells["status"] == "ok") & cells["width"].isin([512, 1024] if ctx.device != "cpu" else ctx.sizes)]
    if not len(ok):
        raise Skip("no cell of the sweep ended ok at these sizes")
    ratio = ok["forward_peak_total_bytes"] / ok["predicted_forward_peak_bytes"]
    off = ok[(ratio - 1).abs() > PEAK_TOLERANCE]
    worst = ok.loc[(ratio - 1).abs().idxmax()]
    figure = (f"{len(ok)} cells, measured/predicted {ratio.min():.3f}..{ratio.max():.3f} (worst {worst['model']} "
              f"{worst['width']} {worst['backend']}: {human_bytes(worst['forward_peak_total_bytes'])} measured, "
              f"{human_bytes(worst['predicted_forward_peak_bytes'])} predicted)")
    assert not len(off), figure + "; over 5%: " + ", ".join(f"{r.model} {r.width} {r.backend}" for r in
                                                             off.itertuples())
    return figure


def check_sdpa_picks_the_kernel_the_planner_names(ctx: Context) -> str:
    """For every call of the sweep's sdpa cells: the kernel PyTorch ran (from its GPU kernels; on the CPU, its aten
    op) is the one the planner names for this device (devices.sdpa_choice, PyTorch's documented priority on CUDA)
    and, on CUDA, the one torch._fused_sdp_choice answers on real tensors of the call's shape."""
    _, cells, blocks = ctx.sweep()
    sdpa = blocks[blocks["backend"] == "sdpa"] if len(blocks) else blocks
    if not len(sdpa):
        raise Skip("no sdpa cell of the sweep ended ok")
    device = ctx.device.split(":")[0]
    target = devices.gpu_target() if device == "cuda" else None
    shapes = sdpa.groupby(["dtype", "head_dim", "tokens_k"])["sdpa_kernel"].agg(lambda k: ",".join(sorted(set(k))))
    wrong, said = [], []
    for (dtype, head_dim, tokens_k), ran in shapes.items():
        named = devices.sdpa_choice(dtype, head_dim, tokens_k, device, target)
        asked = _fused_choice(dtype, head_dim, tokens_k) if device == "cuda" else named
        said.append(f"{dtype} head_dim {head_dim}: {ran}")
        if not ran == named == asked:
            wrong.append(f"{dtype} head_dim {head_dim} tokens_k {tokens_k}: ran {ran}, planner {named}, "
                         f"torch._fused_sdp_choice {asked}")
    where = target.describe() if target else "the CPU"
    assert not wrong, f"on {where}: " + "; ".join(wrong)
    return f"on {where}, {len(sdpa)} calls: " + "; ".join(dict.fromkeys(said)) + " (the planner named each)"


def _fused_choice(dtype: str, head_dim: int, tokens_k: int) -> str:
    from torch.nn.attention import SDPBackend

    from .spec import torch_dtype

    q = torch.empty(1, 64, 8, head_dim, device="cuda", dtype=torch_dtype(dtype)).transpose(1, 2)  # (B, h, T, d)
    k = torch.empty(1, tokens_k, 8, head_dim, device="cuda", dtype=torch_dtype(dtype)).transpose(1, 2)
    choice = SDPBackend(torch._fused_sdp_choice(q, k, k))
    return {SDPBackend.FLASH_ATTENTION: "flash", SDPBackend.EFFICIENT_ATTENTION: "efficient",
            SDPBackend.CUDNN_ATTENTION: "cudnn"}.get(choice, "math")


def check_allocator_holds_only_the_model_and_its_forward(ctx: Context) -> str:
    """Measure the backend, not the harness: each ok cell's highest allocated memory is its model, its inputs and
    its forward's peak, plus only the workspaces the libraries keep in the allocator (cuBLAS, cuDNN): under 1 GiB.
    An fp32 reference model left beside the model under test would add twice its weights."""
    ctx.need_cuda()
    _, cells, _ = ctx.sweep()
    ok = cells[cells["status"] == "ok"]
    if not len(ok):
        raise Skip("no cell of the sweep ended ok")
    extra = ok["allocator_allocated_max_bytes"] - ok["forward_peak_total_bytes"]
    assert extra.min() >= -2**20 and extra.max() <= WORKSPACES_MAX, \
        ok.loc[extra.idxmax(), ["model", "width", "backend", "allocator_allocated_max_bytes"]].to_dict()
    return (f"{len(ok)} cells: the allocator held {human_bytes(extra.min())}..{human_bytes(extra.max())} beyond the "
            f"model, its inputs and its forward (the libraries' workspaces: not counted by the planner)")


CHECKS = [check_random_build_on_cuda, check_cuda1_is_measured_on_cuda1, check_folder_build_on_cuda,
          check_naive_peak_within_5_percent, check_event_time_matches_wall_clock,
          check_call_times_match_their_gpu_kernels, check_kernels_credited_to_their_call,
          check_nvml_process_memory_covers_the_allocator, check_provoked_oom_then_ok,
          check_sweep_parent_holds_no_context, check_forward_peak_matches_the_planner,
          check_sdpa_picks_the_kernel_the_planner_names, check_allocator_holds_only_the_model_and_its_forward,
          check_sage_flex_and_fa3_run_and_record_their_kernels]


def title(check) -> str:
    return check.__name__.removeprefix("check_").replace("_", " ")


def run_checks(ctx: Context, say=print) -> list[tuple[str, str, str]]:
    results, t0 = [], time.perf_counter()
    for check in CHECKS:
        try:
            verdict, figure = "PASS", check(ctx)
        except Skip as e:
            verdict, figure = "SKIP", str(e)
        except Exception as e:  # a failed check is a row of the report, and the others still run
            verdict, figure = "FAIL", f"{type(e).__name__}: {e}".strip()[:400]
        results.append((title(check), verdict, figure))
        say(f"[{time.perf_counter() - t0:5.0f} s] {verdict}  {title(check)}: {figure}")
    return results


# ---- the report

MAIN_BACKENDS = ("naive", "sliced", "split", "subquad", "sdpa")


def backend_table(cells: pd.DataFrame) -> str:
    rows = []
    order = {b: i for i, b in enumerate(backends.names())}
    cells = cells.assign(o=cells["backend"].map(order)).sort_values(["model", "width", "o"], kind="stable")
    for c in cells.to_dict("records"):
        ok = c["status"] == "ok"
        ratio = c.get("forward_peak_total_bytes", 0) / c["predicted_forward_peak_bytes"] \
            if ok and c.get("predicted_forward_peak_bytes") else None
        rows.append({"model": c["model"], "size": f"{c['width']}x{c['height']}",
                     "backend": backends.label(c["backend"], c.get("backend_options")),
                     "status": c["status"] if ok else f"{c['status']}: {str(c['error'])[:60]}",
                     "forward": f"{c['forward_time_ms']:.1f} ms" if ok else "-",
                     "attention": f"{c['attention_time_ms']:.1f} ms" if ok else "-",
                     "peak per call": human_bytes(c["attention_peak_mem_bytes"]) if ok else "-",
                     "predicted": human_bytes(c.get("predicted_peak_bytes")),
                     "forward peak": human_bytes(c.get("forward_peak_total_bytes")) if ok else "-",
                     "planner": human_bytes(c.get("predicted_forward_peak_bytes")),
                     "ratio": f"{ratio:.3f}" if ratio else "-",
                     "kernel": str(c.get("sdpa_kernel") or c.get("kernel") or "")[:60] if ok else ""})
    cols = ["model", "size", "backend", "status", "forward", "attention", "peak per call", "predicted",
            "forward peak", "planner", "ratio", "kernel"]
    return _markdown(rows, cols)


def _markdown(rows: list[dict], cols: list[str]) -> str:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]).replace("|", "/") for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def report(env: dict, checks: list[tuple[str, str, str]], cells: pd.DataFrame, seconds: float, command: str,
           sweep: Sweep) -> str:
    head = [("GPU", env.get("device_name")), ("driver", env.get("driver")), ("CUDA", env.get("cuda")),
            ("cuDNN", env.get("cudnn")), ("torch", env.get("torch")), ("diffusers", env.get("diffusers")),
            ("python", env.get("python")), ("git", env.get("git_revision")),
            ("date", time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())), ("wall time", f"{seconds / 60:.1f} min")]
    counts = {v: sum(1 for _, verdict, _ in checks if verdict == v) for v in ("PASS", "FAIL", "SKIP")}
    main = cells[cells["backend"].isin(MAIN_BACKENDS)]
    rest = cells[~cells["backend"].isin(MAIN_BACKENDS)]
    return "\n".join([
        "# GPU validation", "",
        f"Written by `{command}` (`python -m profiler.gpu_check`); every figure below is what it measured. It runs "
        "the GPU checks (`pytest -m gpu` runs the same functions, tests/test_gpu.py), then "
        f"`configs/sweeps/default.yaml` at {', '.join(str(w) for w, _ in sweep.sizes)} through workers "
        f"({', '.join(sweep.models)}; {', '.join(sweep.dtypes)}; {sweep.repeats} timed forwards per cell) and the "
        "checks on its cells.", "",
        _markdown([{"": k, "value": v} for k, v in head], ["", "value"]), "",
        f"## Checks: {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP", "",
        _markdown([{"check": n, "result": v, "figure": f} for n, v, f in checks], ["check", "result", "figure"]), "",
        f"## Naive, chunked and SDPA backends ({', '.join(sweep.dtypes)}, batch 1)", "",
        "forward: median time per U-Net forward; attention: the sum of the calls' median times; peak per call: the "
        "largest call's allocator peak over what was held when it began; predicted: its memory model's figure; "
        "forward peak: weights + inputs + the forward's allocator peak; planner: attnprof plan's "
        "predicted_forward_peak_bytes; kernel: the SDPA kernel each call ran (sdpa) or the attention ops.", "",
        backend_table(main) if len(main) else "(no cells)", "",
        "## The fused kernels", "",
        backend_table(rest) if len(rest) else "(no cells)", ""])


def nvml_gpus() -> list[str]:
    """The GPUs NVML sees (their names), whatever torch sees; [] without a driver."""
    try:
        nvml = devices.nvml_module()
        return [devices._text(nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(i)))
                for i in range(nvml.nvmlDeviceGetCount())]
    except Exception:  # ImportError, OSError or NVMLError: no driver here
        return []


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m profiler.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu to try the script")
    p.add_argument("--models", nargs="+", help="models of the sweep (default: those of default.yaml)")
    p.add_argument("--sizes", nargs="+", type=int, default=[512, 768, 1024], help="square sizes of the sweep")
    p.add_argument("--report", type=Path, default=REPORT, help=f"where to write the report (default {REPORT})")
    p.add_argument("--out", default=None, help="results folder of the sweep (default: a temporary folder)")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        gpus = nvml_gpus()
        if gpus:
            print(f"gpu-check: NVML sees {len(gpus)} GPU(s) ({gpus[0]}) but this torch has no CUDA (torch "
                  f"{torch.__version__}, CUDA {torch.version.cuda}): install a CUDA build of torch, then run "
                  "make gpu-check again")
            return 1
        print("gpu-check: no CUDA GPU here (torch sees none): nothing to check and no report written; run "
              "make gpu-check on a GPU box")
        return 0
    t0 = time.perf_counter()
    ctx = Context(device=args.device, models=tuple(args.models) if args.models else None, sizes=tuple(args.sizes))
    if args.out:
        ctx.out = Path(args.out)
    sweep = ctx.default_sweep()
    print(f"gpu-check on {args.device}: {len(CHECKS)} checks, the last on the default sweep at "
          f"{', '.join(map(str, args.sizes))} ({len(sweep.cells())} cells)", flush=True)
    checks = run_checks(ctx, lambda line: print(line, flush=True))
    run, cells, _ = ctx.sweep()
    text = report(environment(sweep.resolved_device()), checks, cells, time.perf_counter() - t0,
                  "make gpu-check" if args.device == "cuda" else f"gpu_check --device {args.device}", sweep)
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(text)
    print(table([{"check": n, "result": v} for n, v, _ in checks], [("check", "check"), ("result", "result")]))
    print(f"report: {args.report}  (run: {run.path}; {time.perf_counter() - t0:.0f} s)")
    return 1 if any(v == "FAIL" for _, v, _ in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
