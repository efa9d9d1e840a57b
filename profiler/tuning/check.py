"""make gpu-check's tune step (a model check: a function of gpu_check.verdicts.Context that returns a Verdict): attnprof
tune on each model of the check at its native size (SD 1.5 at 512, SDXL at 1024), the maps and their measured
speed-up over sdpa, diffusers' default processor."""
from __future__ import annotations

from collections import Counter

from ..gpu_check.verdicts import Context, Verdict, said
from ..report.compare import REGRESSION
from .tuner import tune_model

CUDA_BACKENDS = ("naive", "sdpa", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "xformers", "flash-attn")
CPU_BACKENDS = ("naive", "sdpa", "sdpa-flash", "sdpa-math")  # those a CPU runs (the dry run)
PROOF_ROUNDS = 6


def tuned_maps_against_sdpa(ctx: Context) -> Verdict:
    """Per (model, size) of the context (make gpu-check: sd15 at 512, sdxl-base at 1024), attnprof tune on its
    device in float16 (the CPU's dry run: float32) over naive and the fused kernels that run there (CUDA_BACKENDS;
    those not installed are left out, said in the map), each run and its map stored under ctx.runs; judged by
    judge_maps."""
    cells = []
    for model, size in ctx.pairs:
        tuned = tune_model(model, size, size, 1, "float16" if ctx.cuda else "float32", ctx.device,
                           names=list(CUDA_BACKENDS if ctx.cuda else CPU_BACKENDS), proof_rounds=PROOF_ROUNDS,
                           out=ctx.runs, command=f"gpu-check tune {model} {size}x{size}")
        counts = Counter(e["backend"] for e in tuned.map["blocks"].values())
        cells.append({**tuned.cell, "map_counts": dict(counts), "map_path": str(tuned.path)})
    return judge_maps(cells)


def against_sdpa(c: dict) -> tuple[float | None, str | None]:
    """(the map's speed-up over sdpa, the noise rule's verdict) of a tune's cell: its proof against sdpa, which is
    its best single backend or was timed beside it."""
    if c.get("versus") == "sdpa":
        return c.get("speedup"), c.get("verdict")
    return c.get("sdpa_speedup"), c.get("sdpa_verdict")


def judge_maps(cells: list[dict]) -> Verdict:
    """Each tune's map (blocks per backend) and its whole forward's speed-up over sdpa, interleaved; FAIL where the
    map's forward is off the fp32 reference beyond the dtype's tolerance, where it is slower than sdpa by the noise
    rule, or where sdpa was not timed against it (unless sdpa is the map everywhere: nothing to prove)."""
    figures, evidence, failed = [], [], []
    for c in cells:
        what = f"{c['model']} {c['width']}x{c['height']}"
        counts = ", ".join(f"{name} x{n}" for name, n in sorted((c.get("map_counts") or {}).items()))
        speedup, verdict = against_sdpa(c)
        everywhere = set(c.get("map_counts") or {}) == {"sdpa"}
        vs = f"{speedup:.2f}x over sdpa ({verdict})" if speedup is not None and speedup == speedup else \
            "sdpa everywhere" if everywhere else "sdpa not timed"
        problems = ([f"{what}: the map's forward is {c['max_rel_err']:.1e} off the fp32 reference"]
                    if c.get("error_ok") is False else []) + \
            ([f"{what}: the map is slower than sdpa ({speedup:.2f}x)"] if verdict == REGRESSION else []) + \
            ([f"{what}: sdpa was not timed against the map"] if vs == "sdpa not timed" else [])
        figures.append(f"{what}: {counts}; {vs}")
        evidence.append(said(f"{what}: map {c.get('map_path')} ({counts}); whole forward {c.get('proof_ms')} ms "
                             f"against {c.get('versus')}'s {c.get('versus_ms')} ms; over sdpa {speedup} ({verdict}); "
                             f"max_rel_err {c.get('max_rel_err')}",
                             "the map within tolerance and not slower than sdpa by the noise rule", not problems))
        failed += problems
    return Verdict("; ".join(figures), evidence, failed)
