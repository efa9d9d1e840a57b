"""The checks of make gpu-check, each a function of a Context that returns its figure, raises Skip with the reason,
or fails (an assert or any error: its FAIL row keeps the whole message). tests/test_gpu.py runs each as a test
(`pytest -m gpu`); runner.py runs them in CHECKS order within a budget and writes the report as they end.

Two shared runs are made once, by the first check that needs them, and read by the others: `core` (SD 1.5 at 512
and 1024, naive and the SDPA kernels, in this process) and `sweep` (the reduced default sweep through workers). A
shared run that fails is not run again: every check that needs it FAILs with its reason."""
from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import pandas as pd
import torch

from .. import backends, devices, models
from ..fmt import human_bytes
from ..env import REPO, configs
from ..execute.grid import Sweep, load
from ..execute.sweep import execute
from ..store import Run

SDPA_BACKENDS = {"sdpa-flash": "flash", "sdpa-efficient": "efficient", "sdpa-cudnn": "cudnn"}  # forced kernels
PEAK_TOLERANCE = 0.05  # measured forward peak against the planner's prediction
WORKSPACES_MAX = 2**30  # what the allocator may hold beyond the model and its forward: the libraries' workspaces
# the backends of the last checks, each its own (they compile, or need an extension): not in the reduced sweep
NEW_BACKENDS = {"flex": "flex", "sage": "sage", "diffusers:_flash_3": "flash-attn-3"}
CORE_BACKENDS = ("naive", "sdpa", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "sdpa-math")


class Skip(Exception):
    """A check that cannot run here, with the reason; never reported as PASS."""


class SharedRunFailed(Exception):
    """A shared run (the core cells, the sweep) failed once: each check that needs it fails with this reason."""


@dataclass
class Context:
    device: str = "cuda"
    out: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="attnprof-gpu-")))
    models: tuple[str, ...] | None = None  # of the reduced default sweep (None: default.yaml's)
    sizes: tuple[int, ...] = (512, 1024)
    shared: dict = field(default_factory=dict)  # name -> (run, cells, blocks) or SharedRunFailed

    def need_cuda(self) -> None:
        if not self.device.startswith("cuda") or not torch.cuda.is_available():
            raise Skip(f"needs a CUDA device (here: {self.device})")

    def run(self, model: str, sizes, backends_, force=False, workers=False, repeats=3, warmup=1,
            **kw) -> tuple[pd.DataFrame, pd.DataFrame]:
        sweep = Sweep(models=(model,), sizes=tuple((s, s) for s in sizes), dtypes=("float16",),
                      backends=tuple((b, ()) for b in backends_), device=self.device, repeats=repeats, warmup=warmup,
                      out=str(self.out / "runs"), **kw)
        return Run.open(execute(sweep, workers=workers, force=force, progress=False, command="gpu-check").run_path)\
            .read()

    def default_sweep(self) -> Sweep:
        """configs/sweeps/default.yaml reduced: its models at self.sizes, its backends less the last checks' ones
        (NEW_BACKENDS and diffusers' dispatcher), no `also`; on the CPU (a dry run) naive and sdpa in float32."""
        default = load(configs() / "sweeps" / "default.yaml")
        cuda = self.device.startswith("cuda")
        kept = tuple(b for b in default.backends if b[0] not in NEW_BACKENDS and not b[0].startswith("diffusers:"))
        return replace(default, models=tuple(self.models or default.models), sizes=tuple((s, s) for s in self.sizes),
                       backends=kept if cuda else (("naive", ()), ("sdpa", ())), repeats=3, warmup=1,
                       device=self.device, out=str(self.out / "runs"), also=(),
                       dtypes=default.dtypes if cuda else ("float32",))

    def once(self, name: str, make) -> tuple[Run, pd.DataFrame, pd.DataFrame]:
        """The shared run `name`, made by make() the first time it is asked for; a failure is kept and raised
        again (SharedRunFailed) for every later ask, never run twice."""
        if name not in self.shared:
            try:
                self.shared[name] = make()
            except Exception as e:
                self.shared[name] = SharedRunFailed(f"the {name} run failed (run once): {type(e).__name__}: {e}")
        got = self.shared[name]
        if isinstance(got, SharedRunFailed):
            raise got
        return got

    def sweep(self) -> tuple[Run, pd.DataFrame, pd.DataFrame]:
        """The reduced default sweep through workers: (run, cells, blocks)."""
        def make():
            run = Run.open(execute(self.default_sweep(), progress=True, command="gpu-check").run_path)
            return (run, *run.read())

        return self.once("sweep", make)

    def core(self) -> tuple[pd.DataFrame, pd.DataFrame]:
        """SD 1.5 at 512 and 1024 with naive and every SDPA kernel, in this process: (cells, blocks)."""
        self.need_cuda()
        return self.once("core", lambda: (None, *self.run("sd15", [512, 1024], CORE_BACKENDS)))[1:]


def _ok(cells: pd.DataFrame) -> None:
    bad = cells[cells["status"] != "ok"]
    assert not len(bad), "; ".join(f"{r.backend} {r.width}: {r.status} {r.error}" for r in bad.itertuples())


def _cell(cells: pd.DataFrame, backend: str, width: int) -> pd.Series:
    return cells[(cells["backend"] == backend) & (cells["width"] == width)].iloc[0]


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
    from ..measure.cell import ModelCache

    saved = models.build("tiny-sd15", weights="random", dtype="float32", seed=7)
    folder = ctx.out / "ckpt"
    saved.save_pretrained(folder / "unet", safe_serialization=True)
    _, unet = ModelCache().get(str(folder), "float16", "cuda")
    for (name, p), (_, q) in zip(unet.named_parameters(), saved.named_parameters(), strict=True):
        assert p.device.type == "cuda" and torch.equal(p.cpu(), q.half()), name
    return f"a saved diffusers folder loaded on cuda with its weights ({len(list(unet.parameters()))} tensors equal)"


def check_one_cell_per_sdpa_kernel(ctx: Context) -> str:
    """The core run's cells (SD 1.5 at 512 and 1024): each ok and within the fp16 tolerance of the fp32 reference;
    every call of a forced kernel (sdpa-flash, sdpa-efficient, sdpa-cudnn) ran that kernel, by its GPU kernels."""
    cells, blocks = ctx.core()
    _ok(cells)
    assert cells["error_ok"].all(), cells[["backend", "width", "max_rel_err"]].to_dict("records")
    said = []
    for backend, want in SDPA_BACKENDS.items():
        ran = set(blocks[blocks["backend"] == backend]["sdpa_kernel"])
        assert ran == {want}, (backend, ran)
        said.append(f"{backend}: {_cell(cells, backend, 512)['forward_time_ms']:.1f} ms at 512")
    return "; ".join(said) + f"; worst rel err {cells['max_rel_err'].max():.1e}"


def check_naive_peak_within_5_percent(ctx: Context) -> str:
    cells, blocks = ctx.core()
    blocks = blocks[(blocks["backend"] == "naive") & (blocks["width"] == 512)]
    big = blocks[blocks["score_bytes"] >= blocks["score_bytes"].max() / 16]  # where the score table dominates
    ratio = big["peak_mem_bytes"] / big["predicted_peak_bytes"]
    assert len(ratio) and ratio.between(0.95, 1.05).all(), ratio.round(3).tolist()
    return (f"sd15 512x512 fp16: measured/predicted {ratio.min():.3f}..{ratio.max():.3f} over {len(ratio)} calls "
            f"(largest {human_bytes(big['peak_mem_bytes'].max())})")


def check_one_cells_forward_peak_matches_the_planner(ctx: Context) -> str:
    """sdpa at 512 and 1024 (the core run): the measured forward peak (weights + inputs + the allocator's peak
    over what the forward began with) within 5% of the planner's predicted_forward_peak_bytes."""
    cells, _ = ctx.core()
    said = []
    for width in (512, 1024):
        c = _cell(cells, "sdpa", width)
        ratio = c["forward_peak_total_bytes"] / c["predicted_forward_peak_bytes"]
        said.append(f"{width}: {human_bytes(c['forward_peak_total_bytes'])} measured, "
                    f"{human_bytes(c['predicted_forward_peak_bytes'])} predicted ({ratio:.3f}x)")
        assert abs(ratio - 1) <= PEAK_TOLERANCE, "; ".join(said)
    return "sd15 sdpa " + "; ".join(said)


def check_event_time_matches_wall_clock(ctx: Context) -> str:
    ctx.need_cuda()
    from ..measure.probes import CallTimer
    from ..recorder import Recorder
    from ..measure.cell import ModelCache, measure_cell

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
    _, blocks = ctx.core()
    blocks = blocks[blocks["backend"].isin(["naive", "sdpa"]) & (blocks["width"] == 1024)]
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
    from ..measure.probes import CallProbe, sdpa_kernel, trace_windows, traced
    from ..recorder import Recorder

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


def check_nvml_process_memory_covers_the_allocator(ctx: Context) -> str:
    """NVML's memory of this process holds the allocator's reserved memory plus what the allocator cannot see (the
    CUDA context, kernel images): the figure the planner lists under not_counted."""
    ctx.need_cuda()
    cells, _ = ctx.core()
    c = cells[(cells["backend"] == "sdpa") & (cells["width"] == 1024)].iloc[0]
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


def check_sdxl_forward_peak_and_kernels(ctx: Context) -> str:
    """SDXL base at 1024x1024 (140 calls, head_dim 64), sdpa and naive: ok within the fp16 tolerance, the forward
    peak within 5% of the planner's, every call credited a GPU kernel."""
    ctx.need_cuda()
    cells, blocks = ctx.run("sdxl-base", [1024], ["sdpa", "naive"])
    _ok(cells)
    assert cells["error_ok"].all(), cells[["backend", "max_rel_err"]].to_dict("records")
    ratio = cells["forward_peak_total_bytes"] / cells["predicted_forward_peak_bytes"]
    assert ((ratio - 1).abs() <= PEAK_TOLERANCE).all(), dict(zip(cells["backend"], ratio.round(3)))
    assert blocks["gpu_kernels"].fillna("").ne("").all(), "an SDXL call with no GPU kernel credited"
    c = cells.set_index("backend")
    return (f"sdxl-base 1024x1024: sdpa {c.loc['sdpa', 'forward_time_ms']:.1f} ms ({c.loc['sdpa', 'sdpa_kernel']}), "
            f"naive {c.loc['naive', 'forward_time_ms']:.1f} ms; forward peak / planner {ratio.min():.3f}.."
            f"{ratio.max():.3f}; {len(blocks) // 2} calls each")


# ---- the checks on the reduced default sweep's cells (on the CPU too, where its cells allow)

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
    op) is the one the planner names where it can ask (devices.sdpa_choice: torch._fused_sdp_choice on the device,
    recorded per call in the worker as sdpa_kernel_asked). Where the rule the planner follows with no GPU
    (devices.sdpa_rule) names another kernel, the figure says so: that is what a plan made without this GPU gets
    wrong."""
    _, cells, blocks = ctx.sweep()
    sdpa = blocks[blocks["backend"] == "sdpa"] if len(blocks) else blocks
    if not len(sdpa):
        raise Skip("no sdpa cell of the sweep ended ok")
    device = ctx.device.split(":")[0]
    where = devices.gpu_target(index=torch.device(ctx.device).index or 0).describe() if device == "cuda" \
        else "the CPU"
    wrong, said, rule = [], [], []
    for r in sdpa.drop_duplicates(["dtype", "head_dim", "tokens_k"]).itertuples():
        ran = ",".join(sorted(set(sdpa[(sdpa["head_dim"] == r.head_dim) & (sdpa["tokens_k"] == r.tokens_k)]
                                  ["sdpa_kernel"].dropna())))
        asked = getattr(r, "sdpa_kernel_asked", None) or devices.sdpa_choice(r.dtype, r.head_dim, r.tokens_k, device)
        said.append(f"{r.dtype} head_dim {r.head_dim}: {ran}")
        if ran != asked:
            wrong.append(f"{r.dtype} head_dim {r.head_dim} tokens_k {r.tokens_k}: ran {ran or 'none named'}, "
                         f"torch._fused_sdp_choice {asked}")
        planned = getattr(r, "sdpa_kernel_rule", None)
        if planned and planned == planned and planned != asked:
            rule.append(f"head_dim {r.head_dim}: rule {planned}, torch {asked}")
    assert not wrong, f"on {where}: " + "; ".join(wrong)
    differs = f"; the no-GPU rule differs at {', '.join(dict.fromkeys(rule))}" if rule else \
        ("; the no-GPU rule names the same" if device == "cuda" else "")
    return f"on {where}, {len(sdpa)} calls: " + "; ".join(dict.fromkeys(said)) + f" (as PyTorch answers){differs}"


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


# ---- the backends that compile or need an extension, last

def own_gpu_kernels(backend: str, gpu_kernels) -> bool:
    """Whether a call's GPU kernels (its block row's gpu_kernels: CUDA-device events only, never the CPU-side
    ranges that carry a kernel's name, such as Inductor's around each Triton launch) include the backend's own
    (probes.BACKEND_KERNELS); another backend's kernel never counts."""
    from ..measure.probes import BACKEND_KERNELS

    names = gpu_kernels if isinstance(gpu_kernels, list) else str(gpu_kernels or "").split(",")
    return any(BACKEND_KERNELS[NEW_BACKENDS[backend]].search(k) for k in names if k)


def new_backend_reason(name: str, device: str) -> str:
    """Why a backend of the last checks cannot run here, from what it needs alone (nothing run): '' if it may."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return f"needs a CUDA device (here: {device})"
    return backends._static_reason(name, torch.device(device), "float16", (64,))


def check_new_backend(name: str):
    """The check of one backend of NEW_BACKENDS on SD 2.1's U-Net at 512x512 (head_dim 64, which each takes; SD
    1.5's 160-dim blocks are beyond sage): the cell ok and within the fp16 tolerance of the fp32 reference, every
    call's GPU kernels its own, flex's compile time recorded apart from its forwards."""
    def check(ctx: Context) -> str:
        ctx.need_cuda()
        ok, why = backends.availability(name, ctx.device, "float16", (64,))
        if not ok:
            raise Skip(why)
        cells, blocks = ctx.run("sd21-base", (512,), [name], workers=True)
        _ok(cells)
        c = cells.iloc[0]
        assert c["error_ok"], f"rel err {c['max_rel_err']:.2e} over the fp16 tolerance"
        bad = [b.block for b in blocks.itertuples() if not own_gpu_kernels(name, b.gpu_kernels)]
        assert len(blocks) and not bad, f"{len(bad)} calls without a GPU kernel of {name}'s own, e.g. {bad[:2]}"
        compile_s = f", compile {c['compile_s']:.1f} s" if backends.compiles(name) else ""
        if backends.compiles(name):
            assert c["compile_s"] > 0, f"{name} recorded no compile time"
        return f"{name}: {blocks['gpu_kernels'].iloc[0][:80]} (rel err {c['max_rel_err']:.1e}{compile_s})"

    check.__name__ = f"check_{re.sub(r'[^a-z0-9]+', '_', name).strip('_')}_runs_with_its_own_kernels"
    check.backend = name
    return check


def title(check) -> str:
    return check.__name__.removeprefix("check_").replace("_", " ")


@dataclass(frozen=True)
class Planned:
    """A check with what it costs: expected seconds on one H200-class GPU (estimates from the work each does,
    until a GPU run replaces them) and in the CPU dry run (None: it needs CUDA and SKIPs at once there), and the
    shared run it needs first (whose cost the first check to need it carries)."""

    fn: object
    gpu_s: float
    cpu_s: float | None = None
    uses: str | None = None
    group: str = "core"

    @property
    def name(self) -> str:
        return title(self.fn)


SHARED_S = {"core": (60.0, None), "sweep": (150.0, 40.0)}  # (H200, CPU dry run) seconds of each shared run
CHECKS = [
    Planned(check_random_build_on_cuda, 15), Planned(check_folder_build_on_cuda, 10),
    Planned(check_one_cell_per_sdpa_kernel, 2, uses="core"), Planned(check_naive_peak_within_5_percent, 1, uses="core"),
    Planned(check_one_cells_forward_peak_matches_the_planner, 1, uses="core"),
    Planned(check_call_times_match_their_gpu_kernels, 1, uses="core"),
    Planned(check_nvml_process_memory_covers_the_allocator, 1, uses="core"),
    Planned(check_event_time_matches_wall_clock, 20), Planned(check_kernels_credited_to_their_call, 20),
    Planned(check_provoked_oom_then_ok, 25), Planned(check_sweep_parent_holds_no_context, 25),
    Planned(check_cuda1_is_measured_on_cuda1, 20),
    Planned(check_sdxl_forward_peak_and_kernels, 40, group="sdxl"),
    Planned(check_forward_peak_matches_the_planner, 2, 2, uses="sweep", group="sweep"),
    Planned(check_sdpa_picks_the_kernel_the_planner_names, 2, 2, uses="sweep", group="sweep"),
    Planned(check_allocator_holds_only_the_model_and_its_forward, 1, uses="sweep", group="sweep"),
    Planned(check_new_backend("flex"), 90, group="last"), Planned(check_new_backend("sage"), 30, group="last"),
    Planned(check_new_backend("diffusers:_flash_3"), 30, group="last"),
]
