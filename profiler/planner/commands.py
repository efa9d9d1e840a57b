"""The planner's commands (attnprof plan, fit, gpus, models, backends): each takes the command line's parsed values
(given: the model settings that were given) and prints; bad input raises InputError before any work."""
from __future__ import annotations

import sys
from json import dump

from .. import devices, gpus
from ..attention import kernel_choice
from ..attention import backends as registry
from ..attention.backends import check_options
from ..fmt import progress, table
from ..spec import InputError, parse_batch, parse_bytes, parse_options, parse_size, size_text
from ..unet.workload import check_settings
from . import predict


def _print_json(found, **how) -> int:
    dump(found, sys.stdout, indent=1, **how)
    print()
    return 0


def _gpu_arch(gpu_arch, device: str, backend) -> None:
    """--gpu-arch checked before any work (and refused where it cannot matter)."""
    if gpu_arch is not None:
        if device != "cuda" or not backend:
            raise InputError("--gpu-arch names the GPU whose kernels to follow: it goes with --backend and "
                             "--device cuda")
        kernel_choice.gpu_target(gpu_arch)


def _pipeline_controlnet(given: dict) -> bool:
    """--controlnet with --pipeline: the pipeline's registry ControlNet (a folder of one's own goes with --model)."""
    if isinstance(given.get("controlnet"), str):
        raise InputError(f"--controlnet {given['controlnet']} goes with --model (a U-Net beside its ControlNet): with "
                         "--pipeline, --controlnet alone runs the pipeline's own ControlNet")
    return bool(given.get("controlnet"))


def plan(model, pipeline, size, batch, dtype, steps, guidance, backend, option, memory_budget, device, gpu_arch,
         json, gpu, results, host_us_per_op, given) -> int:
    """attnprof plan: per-block figures of one model's forward (--model), or a whole generation's time (--pipeline)."""
    from . import plan as plan_one, format_plan

    if (model is None) == (pipeline is None):
        raise InputError("give --model NAME (one model's forward) or --pipeline NAME (a whole generation: "
                         "sd15, sdxl, tiny-sd15, animatediff-sd15)")
    where = (device, gpu, results, host_us_per_op)
    if pipeline:
        return _plan_generation(pipeline, size, batch, dtype, steps, guidance, backend, option, memory_budget, json,
                                where, given)
    said = [f for f, v in (("--steps", steps), ("--guidance", guidance)) if v is not None]
    if said:
        raise InputError(f"{said[0]} is for --pipeline NAME: a whole generation's time")
    sizes, batch, dtype = devices.given_shape(size, batch, dtype, device, say=True)
    options = parse_options(option)
    default = not backend
    backend = backend or "sdpa"  # the backend run and plan --pipeline take: a peak and a time, as help promises
    options = check_options(backend, options)
    budget = parse_bytes(memory_budget, "--memory-budget") if memory_budget else None
    _gpu_arch(gpu_arch, device, backend)
    settings = check_settings(model, given)
    if gpu:
        gpus.limits(gpus.get(gpu), dtype)  # a GPU we know, with this dtype: before any work
    plans = [plan_one(model, w, h, batch, dtype, backend=backend, backend_options=options, memory_budget=budget,
                      device=device, gpu_arch=gpu_arch, settings=settings) for w, h in sizes]
    predict.plans(plans, backend, dtype, *where)
    if json:
        return _print_json(plans)
    print("\n\n".join(format_plan(p) for p in plans))
    if default:
        print("\nbackend: sdpa, the default (as run and plan --pipeline take it); --backend NAME for another")
    return 0


def _plan_generation(pipeline, size, batch, dtype, steps, guidance, backend, option, memory_budget, json, where,
                     given) -> int:
    """plan --pipeline: a whole generation's predicted time (planner/generation.py), per size."""
    from .generation import GenerationSpec, format_generation

    if memory_budget:
        raise InputError("--memory-budget is for --model: a whole generation's memory is attnprof fit --pipeline's")
    device, gpu = where[:2]
    sizes, batch, dtype = devices.given_shape(size, batch, dtype, device, say=True)
    backend = backend or "sdpa"
    options = check_options(backend, parse_options(option))
    steps, guidance = 30 if steps is None else steps, 7.5 if guidance is None else guidance
    specs = [GenerationSpec(pipeline, w, h, steps, guidance, given.get("frames"), backend, options, dtype, batch,
                            _pipeline_controlnet(given), given.get("vae_upcast")) for w, h in sizes]
    if gpu:
        gpus.limits(gpus.get(gpu), dtype)  # a GPU we know, with this dtype: before any work
    found = predict.generations(specs, dtype, *where)
    if json:
        return _print_json(found, default=str)
    print("\n\n".join(format_generation(g) for g in found))
    return 0


def gpus_table() -> int:
    """attnprof gpus: the GPU table, and where each GPU's time comes from."""
    from .published import ROWS, SOURCES, host_range, model, sources_of

    rows = [dict(g := gpus.find(n), aliases=", ".join(g["aliases"]), memory=f"{g['memory_gib']} GiB",
                 bandwidth=f"{g['bytes_per_s'] / 1e9:g} GB/s",
                 **{d: "-" if v is None else f"{v:g}" for d, v in g["tflops"].items()},
                 tf32="-" if g["tf32_tflops"] is None else f"{g['tf32_tflops']:g}", power=f"{g['watts']} W")
            for n in gpus.names()]
    cols = [("name", "name"), ("aliases", "aliases"), ("arch", "arch"), ("memory", "memory"),
            ("bandwidth", "bandwidth"), ("fp16 TFLOP/s", "float16"), ("bf16", "bfloat16"), ("fp32", "float32"),
            ("tf32", "tf32"), ("power", "power"), ("source", "source")]
    print(table(rows, cols))
    print("\n(dense throughput, no sparsity; profiler/gpus.py. --budget NAME and --gpu NAME read this table)")
    found = [{"name": n, **sources_of(gpus.get(n))} for n in gpus.names()]
    print("\nwhere each GPU's time comes from (plan --gpu: planner/published.py and physics.py):")
    print(table(found, [("name", "name"), ("attention kernels", "kernels"), ("rest of a forward", "rest")]))
    own = ", ".join(dict.fromkeys(r.gpu for r in ROWS if r.use == "fit"))
    print(f"the host: a GPU with a published machine takes that machine's ({own}); any other, "
          f"{host_range(None, model())[3]}")
    for name, ref in [*gpus.REFERENCES.items(), *SOURCES.items()]:
        print(f"  {name}: {ref}")
    return 0


def fit(model, pipeline, budget, gpu, batch, dtype, device, aspect, gpu_arch, quiet, size, backend, buckets, cfg,
        offload, all, json, results, host_us_per_op, given) -> int:
    """attnprof fit: the largest image whose forward (--model) or whole generation (--pipeline) fits a budget."""
    from ..unet import models
    from .fit import fit as fit_model, format_fit, format_most_frames, most_frames, parse_aspect

    if (model is None) == (pipeline is None):
        raise InputError("give --model NAME (one model's forward) or --pipeline NAME (a whole generation: sd15, "
                         "sdxl, tiny-sd15)")
    if not (budget or gpu):
        raise InputError("give --budget SIZE (24GiB, 24GB or a GPU's name such as 4090) or --gpu NAME")
    if gpu:
        gpus.get(gpu)  # a GPU we know: before any work
    budget = budget or gpu  # a GPU's memory
    need, batch = parse_bytes(budget, "--budget"), parse_batch(batch)
    dtype = devices.given_dtype(dtype, device, say=True)
    aspect = parse_aspect(aspect)
    _gpu_arch(gpu_arch, device, backend)
    named = gpus.find(str(budget))
    if gpu_arch is None and named and device == "cuda":  # a GPU of the table: its kernels, not an H100's
        gpu_arch = named["arch"]
    say = progress("fit", quiet)
    where = (device, gpu, results, host_us_per_op)
    if pipeline:
        result, text = _fit_pipelines(pipeline, need, backend, dtype, batch, cfg, offload, aspect, buckets, gpu_arch,
                                      where, given, say)
    elif size:  # a video model at one size: the most frames
        result = most_frames(model, need, parse_size(size), backend, dtype, batch, device, say, gpu_arch,
                             check_settings(model, given))
        text = format_most_frames(result)
    else:
        models.resolve(model)
        result = fit_model(model, need, backend, dtype, batch, aspect, buckets, device, say=say, gpu_arch=gpu_arch,
                           settings=check_settings(model, given))
        text = format_fit(result, all) + predict.fit_lines(result, model, check_settings(model, given), all, dtype,
                                                           batch, *where)
    result["budget_given"] = size_text(budget)
    text += f"\nbudget: {result['budget_given']}"
    if json:
        return _print_json(result)
    print(text)
    return 0


def _fit_pipelines(pipeline, budget, backend, dtype, batch, cfg, offload, aspect, buckets, gpu_arch, where, given,
                   say) -> tuple:
    """fit --pipeline, once per --backend (every phase runs it; default sdpa): (the result, or with several backends
    {"backends": [one result each]}; the text: each one's, after a line per backend with its answer)."""
    from .pipeline import PipelineSpec, fit_pipeline, format_pipeline

    vae = [f"--vae-{n}" for n in ("part", "slicing", "upcast") if given.get(f"vae_{n}") is not None]
    if vae:
        raise InputError(f"{vae[0]} is for --model NAME-vae: a pipeline decodes as its VAE config says "
                         "(give --vae-tiling for a tiled decode)")
    settings = {"controlnet": _pipeline_controlnet(given), "ip_adapter_tokens": given.get("ip_adapter_tokens") or 0,
                "tome": given.get("tome") or 0.0}
    results = [fit_pipeline(PipelineSpec(pipeline, budget, name, dtype, batch, cfg, offload,
                                         vae_tiling=bool(given.get("vae_tiling")), **settings, aspect=aspect,
                                         buckets=buckets, device=where[0], gpu_arch=gpu_arch), say)
               for name in dict.fromkeys(backend or ["sdpa"])]
    texts = [format_pipeline(r) + predict.step_line(r, pipeline, settings, cfg, dtype, batch, *where) for r in results]
    if len(results) == 1:
        return results[0], texts[0]
    size = lambda s: f"{s[0]}x{s[1]}" if s else "none"  # noqa: E731
    rows = [{"backend": r["backend"], "largest": size(r.get("largest")), "limited by": r.get("limited_by") or "-"}
            for r in results]
    head = "" if buckets else f"{table(rows, [(c, c) for c in rows[0]])}\n\n"
    return {"backends": results}, head + "\n\n".join(texts)


def models_table() -> int:
    """attnprof models: the registry's models, each with its kind, channels and description."""
    import yaml

    from ..unet import models

    rows = [{"name": name, "kind": models.resolve(name).kind,
             "channels": str(models.resolve(name).config.get("block_out_channels")),
             "description": (yaml.safe_load(path.read_text()) or {}).get("description", "")}
            for name, path in models.known_models().items()]
    print(table(rows, [(c, c) for c in ("name", "kind", "channels", "description")]))
    print("\n(configs/models/*.yaml; --model also takes a diffusers U-Net folder, a hub id or a single-file "
          "checkpoint, .safetensors)")
    return 0


def backends_table(device, dtype, model) -> int:
    """attnprof backends: each backend and whether it runs here, at the model's head dims (default SD's)."""
    from . import plan as plan_one

    device = devices.resolve(devices.parse(device, "--device"))
    dtype = devices.given_dtype(dtype, device)
    if model:
        head_dims = tuple(sorted({r["head_dim"] for r in plan_one(model, 512, 512, dtype=dtype)["blocks"]}))
    else:
        head_dims = (40, 64, 80, 160)  # every head dim of SD 1.x, 2.x and SDXL
    print(f"on {device} in {dtype} at head_dim {', '.join(map(str, head_dims))} (by family):")
    width = max(map(len, registry.names()))
    for family, names in registry.by_family(registry.names()):
        print(f"\n{family}:")
        for name in names:
            if registry.compiles(name):  # its probe compiles a kernel: say so before the wait
                print(f"  ({name}: its probe compiles a kernel, up to a minute the first time on this machine)",
                      file=sys.stderr, flush=True)
            ok, reason = registry.availability(name, device, dtype, head_dims)
            print(f"  {name:{width}s} {'available' if ok else f'unavailable: {reason}'}", flush=True)
    return 0
