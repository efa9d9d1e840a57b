"""Command line: argument parsing and dispatch only. Bad input exits with code 2 and one line, no traceback."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

from .spec import COMPILE_MODES, VAE_PARTS, InputError, parse_batch, parse_bytes, parse_dtype, parse_size, size_text


NO_CELL_OK = 1  # run, sweep, profile: the run holds no cell that ended ok
EXIT_CODES = (f"exit codes: 0 when at least one cell ended ok, {NO_CELL_OK} when none did, 2 on bad input (nothing "
              "run or written), 130 when interrupted (the cells recorded so far are kept)")
RETRY_HELP = "run again the cells of the latest run of this config that did not end ok (implies --resume)"
CLOSED_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a command whose output pipe was closed


class _Help(argparse.HelpFormatter):
    """argparse's help, wrapped without breaking at hyphens: a path such as docs/sweeps-and-service.md stays whole."""

    def _fill_text(self, text, width, indent):
        import textwrap

        return textwrap.fill(" ".join(text.split()), width, initial_indent=indent, subsequent_indent=indent,
                             break_on_hyphens=False)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{"formatter_class": _Help, **kwargs})

    def error(self, message):  # one line instead of usage + message
        raise InputError(f"{message} (see {self.prog} --help)")


MODEL_HELP = "registry name (attnprof models), diffusers folder, hub id or single-file checkpoint (.safetensors)"
GPU_ARCH_HELP = ("on cuda, the GPU whose SDPA kernel choice to follow, as a compute capability (sm80, sm89, sm90, "
                 "sm100, ...; default: this machine's GPU, else sm90, an H100 / H200)")
FLAGS = {  # the flags several commands share, each defined once; _flag(p, NAME, ...) adds them as they are here
    "--results": dict(default="results", help="results folder (default results)"),
    "--device": dict(default="auto", help="auto | cpu | cuda | cuda:N (default auto)"),
    "--quiet": dict(action="store_true", help="no progress on stderr"),
    "--option": dict(action="append", metavar="KEY=VALUE", help="backend option, e.g. slice_size=4"),
    "--json": dict(action="store_true", help="print JSON"),
    "--address": dict(help="the job server (default: $ATTNPROF_JOBS_ADDRESS or http://127.0.0.1:8265)"),
    "--host": dict(default="127.0.0.1", help="address to listen on (default 127.0.0.1)"),
    "--gpu-arch": dict(metavar="SM", help=GPU_ARCH_HELP),
}


def _flag(p, *names: str) -> None:
    for name in names:
        p.add_argument(name, **FLAGS[name])


def _add_pickle_arg(p):
    p.add_argument("--allow-pickle", action="store_true",
                   help="let --model be a .ckpt / .pt checkpoint: a pickle, which runs any code it holds when loaded")


def _add_shape_args(p, sizes_default=("512x512",), model_required: bool = True):
    p.add_argument("--model", required=model_required, help=MODEL_HELP)
    _add_pickle_arg(p)
    p.add_argument("--size", action="append", metavar="WxH",
                   help=f"image size in pixels, repeatable (default {' '.join(sizes_default)})")
    p.add_argument("--batch", default="1", help="batch size (default 1)")
    p.add_argument("--dtype", help="float16 | bfloat16 | float32 (default float32 on the CPU, float16 on CUDA)")


def _add_settings_args(p):
    """The model's settings (profiler.spec.SETTINGS) as flags: each applies to one kind of model."""
    g = p.add_argument_group("model settings (a U-Net's; a video U-Net's; a VAE's)")
    g.add_argument("--controlnet", nargs="?", const=True, default=None, metavar="DIR",
                   help="U-Net: run a ControlNet beside it, as a pipeline step does: the registry's of the U-Net, or "
                        "with DIR your own (the folder ControlNetModel.save_pretrained wrote, or its config.json)")
    g.add_argument("--ip-adapter-tokens", type=int, metavar="N",
                   help="U-Net: IP-Adapter's image tokens in every cross-attention (4: IP-Adapter, 16: plus)")
    g.add_argument("--tome", type=float, metavar="RATIO", help="U-Net: Token Merging at this ratio, e.g. 0.5")
    g.add_argument("--compile", choices=COMPILE_MODES,
                   help="U-Net: run it compiled: regional (diffusers' compile_repeated_blocks) or full (torch.compile "
                        "of the whole U-Net); default none (eager). run / sweep measure it; plan and fit predict eager")
    g.add_argument("--frames", type=int, metavar="N", help="video U-Net (AnimateDiff, SVD): frames per video "
                                                          "(default: the model's: 16 for AnimateDiff, 25 for SVD-XT)")
    g.add_argument("--vae-part", choices=VAE_PARTS, help="VAE: decoder (default) or encoder")
    g.add_argument("--vae-tiling", action="store_true", default=None, help="VAE: tiled decode / encode")
    g.add_argument("--vae-slicing", action="store_true", default=None, help="VAE: one image of the batch at a time")
    g.add_argument("--vae-upcast", action=argparse.BooleanOptionalAction, default=None,
                   help="VAE: compute in float32 (default: as diffusers, the config's force_upcast where the dtype is "
                        "float16; with plan --pipeline, the decode's)")


def _settings(args, model: str) -> tuple:
    from .spec import SETTINGS
    from .unet.workload import check_settings

    given = {n: getattr(args, n) for n in SETTINGS if getattr(args, n, None) is not None}
    return check_settings(model, given)


def _pipeline_controlnet(args) -> bool:
    """--controlnet with --pipeline: the pipeline's registry ControlNet (a folder of one's own goes with --model)."""
    if isinstance(args.controlnet, str):
        raise InputError(f"--controlnet {args.controlnet} goes with --model (a U-Net beside its ControlNet): with "
                         "--pipeline, --controlnet alone runs the pipeline's own ControlNet")
    return bool(args.controlnet)


def _dtype(args, device: str, say: bool = False) -> str:
    """--dtype, or without it the device's default (float32 on the CPU, float16 on CUDA); with say, float16 on the
    CPU is said (once: here) to be emulated."""
    from . import devices

    dtype = parse_dtype(args.dtype) if args.dtype else devices.default_dtype(device)
    note = devices.dtype_note(device, [dtype]) if say else None
    if note:
        print(f"attnprof: {note}", file=sys.stderr, flush=True)
    return dtype


def _shape(args, device: str, sizes_default=("512x512",), say: bool = False):
    sizes = [parse_size(s) for s in (args.size or sizes_default)]
    return sizes, parse_batch(args.batch), _dtype(args, device, say)


def cmd_plan(args) -> int:
    from .planner import format_plan, plan

    if (args.model is None) == (args.pipeline is None):
        raise InputError("give --model NAME (one model's forward) or --pipeline NAME (a whole generation: "
                         "sd15, sdxl, tiny-sd15, animatediff-sd15)")
    if args.pipeline:
        return _plan_generation(args)
    given = [f for f, v in (("--steps", args.steps), ("--guidance", args.guidance)) if v is not None]
    if given:
        raise InputError(f"{given[0]} is for --pipeline NAME: a whole generation's time")
    sizes, batch, dtype = _shape(args, args.device, say=True)
    options = _backend_options(args.option)
    default = not args.backend
    if default:  # the backend run and plan --pipeline take: a peak and a time, as help promises
        args.backend = "sdpa"
    from .attention.backends import check_options

    options = check_options(args.backend, options)
    budget = parse_bytes(args.memory_budget, "--memory-budget") if args.memory_budget else None
    _gpu_arch(args)
    settings = _settings(args, args.model)
    if args.gpu:
        from . import gpus

        gpus.limits(gpus.get(args.gpu), dtype)  # a GPU we know, with this dtype: before any work
    plans = [plan(args.model, w, h, batch, dtype, backend=args.backend, backend_options=options,
                  memory_budget=budget, device=args.device, gpu_arch=args.gpu_arch, settings=settings)
             for w, h in sizes]
    from .planner import predict

    predict.plans(plans, args.backend, dtype, args.device, args.gpu, args.results, args.host_us_per_op)
    if args.json:
        json.dump(plans, sys.stdout, indent=1)
        print()
    else:
        print("\n\n".join(format_plan(p) for p in plans))
        if default:
            print("\nbackend: sdpa, the default (as run and plan --pipeline take it); --backend NAME for another")
    return 0


def _plan_generation(args) -> int:
    """plan --pipeline: a whole generation's predicted time (planner/generation.py), per size."""
    from .planner import predict
    from .planner.generation import GenerationSpec, format_generation

    if args.memory_budget:
        raise InputError("--memory-budget is for --model: a whole generation's memory is attnprof fit --pipeline's")
    sizes, batch, dtype = _shape(args, args.device, say=True)
    backend = args.backend or "sdpa"
    from .attention.backends import check_options

    options = check_options(backend, _backend_options(args.option))
    steps, guidance = 30 if args.steps is None else args.steps, 7.5 if args.guidance is None else args.guidance
    specs = [GenerationSpec(args.pipeline, w, h, steps, guidance, args.frames, backend, options, dtype, batch,
                            _pipeline_controlnet(args), args.vae_upcast) for w, h in sizes]
    if args.gpu:
        from . import gpus

        gpus.limits(gpus.get(args.gpu), dtype)  # a GPU we know, with this dtype: before any work
    found = predict.generations(specs, dtype, args.device, args.gpu, args.results, args.host_us_per_op)
    if args.json:
        json.dump(found, sys.stdout, indent=1, default=str)
        print()
    else:
        print("\n\n".join(format_generation(g) for g in found))
    return 0


def cmd_gpus(args) -> int:
    from . import gpus
    from .fmt import table

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
    from .planner.published import ROWS, SOURCES, host_range, model, sources_of

    found = [{"name": n, **sources_of(gpus.get(n))} for n in gpus.names()]
    print("\nwhere each GPU's time comes from (plan --gpu: planner/published.py and physics.py):")
    print(table(found, [("name", "name"), ("attention kernels", "kernels"), ("rest of a forward", "rest")]))
    own = ", ".join(dict.fromkeys(r.gpu for r in ROWS if r.use == "fit"))
    print(f"the host: a GPU with a published machine takes that machine's ({own}); any other, "
          f"{host_range(None, model())[3]}")
    for name, ref in [*gpus.REFERENCES.items(), *SOURCES.items()]:
        print(f"  {name}: {ref}")
    return 0


def cmd_fit(args) -> int:
    from .unet import models
    from .planner.fit import fit, format_fit, parse_aspect

    if (args.model is None) == (args.pipeline is None):
        raise InputError("give --model NAME (one model's forward) or --pipeline NAME (a whole generation: sd15, "
                         "sdxl, tiny-sd15)")
    if not (args.budget or args.gpu):
        raise InputError("give --budget SIZE (24GiB, 24GB or a GPU's name such as 4090) or --gpu NAME")
    if args.gpu:
        from .gpus import get

        get(args.gpu)  # a GPU we know: before any work
    args.budget = args.budget or args.gpu  # a GPU's memory
    budget, batch = parse_bytes(args.budget, "--budget"), parse_batch(args.batch)
    dtype = _dtype(args, args.device, say=True)
    aspect = parse_aspect(args.aspect)
    _gpu_arch(args)
    from . import gpus

    named = gpus.find(str(args.budget))
    if args.gpu_arch is None and named and args.device == "cuda":  # a GPU of the table: its kernels, not an H100's
        args.gpu_arch = named["arch"]
    say = (lambda line: None) if args.quiet else (lambda line: print(f"attnprof fit: {line}", file=sys.stderr,
                                                                     flush=True))
    if args.pipeline:
        result, text = _fit_pipelines(args, budget, dtype, batch, aspect, say)
    elif args.size:  # a video model at one size: the most frames
        from .planner.fit import format_most_frames, most_frames

        result = most_frames(args.model, budget, parse_size(args.size), args.backend, dtype, batch, args.device, say,
                             args.gpu_arch, _settings(args, args.model))
        text = format_most_frames(result)
    else:
        models.resolve(args.model)
        result = fit(args.model, budget, args.backend, dtype, batch, aspect, args.buckets, args.device, say=say,
                     gpu_arch=args.gpu_arch, settings=_settings(args, args.model))
        from .planner import predict

        text = format_fit(result, args.all) + predict.fit_lines(
            result, args.model, _settings(args, args.model), args.all, dtype, batch, args.device, args.gpu,
            args.results, args.host_us_per_op)
    result["budget_given"] = size_text(args.budget)
    text += f"\nbudget: {result['budget_given']}"
    if args.json:
        json.dump(result, sys.stdout, indent=1)
        print()
    else:
        print(text)
    return 0


def _fit_pipelines(args, budget: int, dtype: str, batch: int, aspect, say) -> tuple:
    """fit --pipeline, once per --backend (every phase runs it; default sdpa): (the result, or with several backends
    {"backends": [one result each]}; the text: each one's, after a line per backend with its answer)."""
    from .fmt import table
    from .planner.pipeline import PipelineSpec, fit_pipeline, format_pipeline

    vae = [f"--vae-{n}" for n in ("part", "slicing", "upcast") if getattr(args, f"vae_{n}") is not None]
    if vae:
        raise InputError(f"{vae[0]} is for --model NAME-vae: a pipeline decodes as its VAE config says "
                         "(give --vae-tiling for a tiled decode)")
    results = []
    for backend in dict.fromkeys(args.backend or ["sdpa"]):
        spec = PipelineSpec(args.pipeline, budget, backend, dtype, batch, args.cfg, args.offload,
                            vae_tiling=bool(args.vae_tiling), controlnet=_pipeline_controlnet(args),
                            ip_adapter_tokens=args.ip_adapter_tokens or 0, tome=args.tome or 0.0, aspect=aspect,
                            buckets=args.buckets, device=args.device, gpu_arch=args.gpu_arch)
        results.append(fit_pipeline(spec, say))
    from .planner import predict

    settings = {"controlnet": _pipeline_controlnet(args), "ip_adapter_tokens": args.ip_adapter_tokens or 0,
                "tome": args.tome or 0.0}
    texts = [format_pipeline(r) + predict.step_line(r, args.pipeline, settings, args.cfg, dtype, batch, args.device,
                                                    args.gpu, args.results, args.host_us_per_op) for r in results]
    if len(results) == 1:
        return results[0], texts[0]
    size = lambda s: f"{s[0]}x{s[1]}" if s else "none"  # noqa: E731
    rows = [{"backend": r["backend"], "largest": size(r.get("largest")), "limited by": r.get("limited_by") or "-"}
            for r in results]
    head = "" if args.buckets else f"{table(rows, [(c, c) for c in rows[0]])}\n\n"
    return {"backends": results}, head + "\n\n".join(texts)


def _gpu_arch(args) -> None:
    """--gpu-arch checked before any work (and refused where it cannot matter)."""
    from . import devices

    if args.gpu_arch is not None:
        if args.device != "cuda" or not getattr(args, "backend", True):
            raise InputError("--gpu-arch names the GPU whose kernels to follow: it goes with --backend and "
                             "--device cuda")
        devices.gpu_target(args.gpu_arch)


def cmd_models(args) -> int:
    from .unet import models

    import yaml

    from .fmt import table

    rows = [{"name": name, "kind": models.resolve(name).kind,
             "channels": str(models.resolve(name).config.get("block_out_channels")),
             "description": (yaml.safe_load(path.read_text()) or {}).get("description", "")}
            for name, path in models.known_models().items()]
    print(table(rows, [(c, c) for c in ("name", "kind", "channels", "description")]))
    print("\n(configs/models/*.yaml; --model also takes a diffusers U-Net folder, a hub id or a single-file "
          "checkpoint, .safetensors)")
    return 0


def _backend_options(pairs) -> dict:
    out = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise InputError(f"backend option {pair!r} is not KEY=VALUE: e.g. --option slice_size=4")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def cmd_backends(args) -> int:
    from .attention import backends
    from . import devices

    device = devices.resolve(devices.parse(args.device, "--device"))
    dtype = _dtype(args, device)
    if args.model:
        from .planner import plan

        head_dims = tuple(sorted({r["head_dim"] for r in plan(args.model, 512, 512, dtype=dtype)["blocks"]}))
    else:
        head_dims = (40, 64, 80, 160)  # every head dim of SD 1.x, 2.x and SDXL
    print(f"on {device} in {dtype} at head_dim {', '.join(map(str, head_dims))} (by family):")
    width = max(map(len, backends.names()))
    for family, names in backends.by_family(backends.names()):
        print(f"\n{family}:")
        for name in names:
            if backends.compiles(name):  # its probe compiles a kernel: say so before the wait
                print(f"  ({name}: its probe compiles a kernel, up to a minute the first time on this machine)",
                      file=sys.stderr, flush=True)
            ok, reason = backends.availability(name, device, dtype, head_dims)
            print(f"  {name:{width}s} {'available' if ok else f'unavailable: {reason}'}", flush=True)
    return 0


def _sweep_from_args(args):
    from .attention import backends
    from . import devices
    from .unet import models
    from .execute.grid import Sweep

    entries = []
    for name in args.backend or ["sdpa"]:
        name, options = backends.cell_backend(name, _backend_options(args.option))  # a map file: tuned, its map
        entries.append((name, tuple(sorted(options.items()))))
    sizes, batch, dtype = _shape(args, devices.parse(args.device, "--device"))
    models.resolve(args.model)
    _map_elsewhere(args.backend or [], args.model, sizes)
    for key in ("repeats", "warmup"):
        value = getattr(args, key)
        if value < (1 if key == "repeats" else 0):
            raise InputError(f"--{key} {value} is too small: use {'1' if key == 'repeats' else '0'} or more")
    settings = _settings(args, args.model)
    return Sweep(models=(args.model,), sizes=tuple(sizes), batch=(batch,), dtypes=(dtype,) if args.dtype else (),
                 backends=tuple(entries), repeats=args.repeats, warmup=args.warmup,
                 device=devices.parse(args.device, "--device"), out=args.out, timeout_s=args.timeout_s,
                 model_settings=tuple((n, (v,)) for n, v in settings),
                 memory_budget=parse_bytes(args.memory_budget, "--memory-budget") if args.memory_budget else None)


def _map_elsewhere(names: list[str], model: str, sizes) -> None:
    """A processor map file among the backends that was tuned for another model or size: one warning line each."""
    from .attention import mix

    for name in names:
        if mix.is_map(name) and name != mix.NAME:
            line = mix.elsewhere(mix.read(name), name, model, sizes)
            if line:
                print(f"attnprof run: {line}", file=sys.stderr, flush=True)


def cmd_run(args) -> int:
    return _execute(_with_exec_args(_sweep_from_args(args), args), args)


def cmd_sweep(args) -> int:
    from .execute.grid import load

    return _execute(_with_exec_args(load(args.config), args), args)


def cmd_profile(args) -> int:
    import torch

    from .env import configs
    from .execute.grid import load

    name = "default.yaml" if torch.cuda.is_available() else "cpu-default.yaml"
    config = configs() / "sweeps" / name
    print(f"attnprof profile: the built-in default sweep for this machine, {config.relative_to(Path.cwd())}"
          if config.is_relative_to(Path.cwd()) else f"attnprof profile: {config}", flush=True)
    return _execute(_with_exec_args(load(config), args), args)


def _with_exec_args(sweep, args):
    """The sweep with the command line's --out, --trace and --ray over its own settings."""
    from .execute.grid import with_overrides

    ray = {} if args.ray is None else {"executor": "ray", "ray_address": args.ray or None}
    if ray and args.in_process:
        raise InputError("--ray and --in-process exclude each other: choose where the cells run")
    return with_overrides(with_overrides(sweep, out=args.out, trace=args.trace or None), **ray)


def _execute(sweep, args) -> int:
    from .execute.sweep import execute
    from .report.findings import findings, format_findings
    from .report.show import status_table
    from .store import Run

    outcome = execute(sweep, resume=getattr(args, "resume", False), retry_failed=getattr(args, "retry_failed", False),
                      force=args.force, workers=not args.in_process, progress=not args.quiet,
                      command=" ".join(["attnprof"] + sys.argv[1:]))  # as the user would type it again

    run = Run.open(outcome.run_path)
    print(status_table(run))
    _print_versus(run)
    found = findings(*run.read(), run.manifest())
    if found:
        print(f"\nfindings:\n{format_findings(found)}")
    print(f"\nresults: {outcome.run_path}")
    print(f"  summary:   attnprof show {outcome.run_path.name} --results {outcome.run_path.parent}")
    print(f"  dashboard: make dashboard  (or attnprof dashboard --results {outcome.run_path.parent})")
    if outcome.interrupted:
        print(f"interrupted: the cells recorded so far are kept; run again with --resume to finish: "
              f"{resume_command(sys.argv[1:])}",
              file=sys.stderr)
        return 130
    cells = run.cells()
    if not len(cells) or not (cells["status"] == "ok").any():
        print(f"attnprof: no cell ended ok: see the errors with attnprof show {run.id} --results {run.path.parent}",
              file=sys.stderr, flush=True)
        return NO_CELL_OK
    return 0


def resume_command(argv: list[str]) -> str:
    """The command line that finishes an interrupted run, sweep or profile: the one given, with --resume."""
    import shlex

    return shlex.join(["attnprof", *argv, *([] if "--resume" in argv else ["--resume"])])


def _print_versus(run) -> None:
    from .planner.timing import format_versus

    from .planner.timing import format_wall

    text = "\n".join(t for t in (format_versus(run.cells()), format_wall(run.manifest())) if t)
    if text:
        print(f"\n{text}")


def cmd_replay(args) -> int:
    from .attention import backends
    from . import devices
    from .unet import models
    from .measure.replay import replay, targets_of_plan, targets_of_run
    from .report.show import format_replay
    from .store import find_run

    if (args.run is None) == (args.model is None):
        raise InputError("replay takes a run (RUN) or a plan (--model M --size WxH), one of the two")
    if args.repeats < 1 or args.warmup < 0:
        raise InputError("--repeats must be 1 or more and --warmup 0 or more")
    device = devices.resolve(devices.parse(args.device, "--device"))
    options = _backend_options(args.option)
    if args.run is not None:
        if args.size or args.batch or args.dtype:
            raise InputError("--size, --batch and --dtype go with --model: a run's cells give them")
        run = find_run(args.results, args.run)
        if not run.kind.named:
            raise InputError(f"run {run.id} is a {run.kind.name} run ({run.kind.what}): its models are not named "
                             "configs to rebuild; replay a run of attnprof run or sweep, or --model and --size")
        targets = targets_of_run(*run.read())
        if not targets:
            raise InputError(f"run {run.id} has no ok cell to replay: give another run, or --model and --size")
        ok = run.cells().query("status == 'ok'")
        chosen = list(dict.fromkeys((b, o) for b, o in zip(ok["backend"], ok["backend_options"])))
        chosen = [(b, json.loads(o)) for b, o in chosen]
        source = f"run {run.id}"
    else:
        models.resolve(args.model)
        sizes = [parse_size(s) for s in (args.size or ["512x512"])]
        targets = targets_of_plan(args.model, sizes, parse_batch(args.batch or "1"), _dtype(args, device, say=True))
        chosen, source = [("sdpa", {})], f"a plan of {args.model}"
    if args.backend:
        chosen = [(name, backends.check_options(name, options)) for name in args.backend]
    say = (lambda line: None) if args.quiet else (lambda line: print(f"attnprof replay: {line}", file=sys.stderr,
                                                                     flush=True))
    result = replay(targets, [(n, backends.check_options(n, o)) for n, o in chosen], device, args.repeats,
                    args.warmup, Path(args.out), " ".join(["attnprof"] + sys.argv[1:]), source, say)
    print(format_replay(result))
    return 0


def cmd_tune(args) -> int:
    from . import devices
    from .unet import models
    from .tuning.tuner import check_proof_rounds, tune_model

    device = devices.resolve(devices.parse(args.device, "--device"))
    models.resolve(args.model)
    if args.size and len(args.size) > 1:
        raise InputError("tune takes one --size: a map is for the shapes of one forward")
    sizes, batch, dtype = _shape(args, device, say=True)
    budget = parse_bytes(args.budget, "--budget") if args.budget else None
    for key, least in (("repeats", 1), ("warmup", 0), ("rounds", 2)):
        if getattr(args, key) < least:
            raise InputError(f"--{key.replace('_', '-')} {getattr(args, key)} is too small: use {least} or more")
    check_proof_rounds(args.proof_rounds)
    for name in args.backend or []:
        if name.endswith(".json"):
            raise InputError(f"--backend {name}: tune times backends by name; run a map with attnprof run --backend")
    say = (lambda line: None) if args.quiet else (lambda line: print(f"attnprof tune: {line}", file=sys.stderr,
                                                                     flush=True))
    tuned = tune_model(args.model, *sizes[0], batch, dtype, device, budget, args.backend,
                       _backend_options(args.option), args.repeats, args.warmup, args.rounds, args.proof_rounds,
                       args.out, " ".join(["attnprof"] + sys.argv[1:]), say)
    print(tuned)
    return 0


def cmd_runs(args) -> int:
    from .report.show import format_runs

    print(format_runs(Path(args.results)))
    return 0


def cmd_record(args) -> int:
    from .record.script import interpreted, record
    from .report.show import format_run, left_backends, resume_record
    from .store import Run

    from .fmt import terminal_width

    if args.resume and args.script:
        raise InputError("--resume finishes a run with its own script and arguments: give no script after it")
    if not args.resume and not args.script:
        raise InputError("record needs the script to run: attnprof record -- generate.py --steps 30")
    script, rest = interpreted(args.script, args.args)
    say = None if args.quiet else (lambda line: print(f"attnprof record: {line}", file=sys.stderr, flush=True))
    if say:
        _record_options_after(rest, say)
    code, path = record(script, rest, args.backend or [], Path(args.out), args.trace, say, args.resume)
    if path is None:
        return code
    run = Run.open(path)
    print(format_run(run, terminal_width()))
    if code == 130 and left_backends(run.manifest(), run.cells()):
        print(f"attnprof record: interrupted: the cells recorded so far are kept; finish it with: "
              f"{resume_record(run)}", file=sys.stderr)
    elif code == 130:
        print("attnprof record: interrupted after every backend's cells were stored: the run is whole",
              file=sys.stderr)
    return code


def _record_options_after(args: list[str], say) -> None:
    """A word after the script that is one of record's own options goes to the script, as the convention says;
    said once, since the user may have meant it for record."""
    own = [a for a in args if a.split("=")[0] in ("--out", "--backend", "--trace", "--quiet", "--resume")]
    if own:
        say(f"{', '.join(own)} after the script go{'es' if len(own) == 1 else ''} to the script, not to record: "
            "put record's options before the script (attnprof record --out DIR -- SCRIPT.py ARGS)")


def cmd_show(args) -> int:
    from .report.show import format_run
    from .store import find_run

    from .fmt import terminal_width

    print(format_run(find_run(args.results, args.run), None if args.wide else terminal_width(), args.legend))
    return 0


def cmd_diff(args) -> int:
    from .report.compare import compare, exit_status, format_diff, summary
    from .store import find_run

    if not 0 <= args.threshold < 1:
        raise InputError(f"--threshold {args.threshold} is not a fraction: use e.g. 0.05 for 5%")
    a, b = find_run(args.results, args.run_a), find_run(args.results, args.run_b)
    manifests, same = (a.manifest(), b.manifest()), a.path.resolve() == b.path.resolve()
    result = compare(a.cells(), b.cells(), args.threshold, manifests, same)
    s = summary(result)
    if args.json:
        json.dump({"a": a.id, "b": b.id, "threshold": args.threshold, "summary": s,
                   **{k: v.to_dict("records") if hasattr(v, "to_dict") else v for k, v in result.items()}},
                  sys.stdout, indent=1, default=str)
        print()
    else:
        print(format_diff(a.id, b.id, result, args.threshold, manifests, same))
    return exit_status(s)


def cmd_report(args) -> int:
    """The HTML file is the view's (dashboards/report.py: the dashboard's charts and tables): it is written by
    `python -m dashboards.report` in a process of its own, so that the core never imports its view."""
    import subprocess

    from .store import find_run

    found = [find_run(args.results, name) for name in args.runs]
    runs = [str(r.path) for r in found]
    html = args.html or str(report_path([r.path for r in found]))
    done = subprocess.run([sys.executable, "-m", "dashboards.report", "--html", html, *runs],
                          capture_output=True, text=True)
    if done.returncode == 2:  # an unreadable run, a file that cannot be written: its one line
        raise InputError((done.stderr.strip().splitlines() or ["the report failed"])[-1])
    if done.returncode:
        sys.stderr.write(done.stderr)
        return done.returncode
    out = Path(done.stdout.strip().splitlines()[-1]).resolve()
    print(f"attnprof report: wrote {out} ({out.stat().st_size / 2**20:.1f} MiB, {len(runs)} run(s)); it opens in a "
          "browser with no server and no network")
    return 0


def report_path(runs: list[Path]) -> Path:
    """Where `attnprof report` writes without --out: beside the runs, in the first one's results folder, named by
    them (report-<id>.html; report-<first id>-and-<n>-more.html for several)."""
    more = f"-and-{len(runs) - 1}-more" if len(runs) > 1 else ""
    return runs[0].parent / f"report-{runs[0].name}{more}.html"


def cmd_dashboard(args) -> int:
    from .service.serve import dashboard
    from .store import results_folder

    results_folder(args.results)
    print(f"attnprof dashboard: http://{args.host}:{args.port}  (results: {Path(args.results).resolve()}; Ctrl-C "
          "stops it)", flush=True)
    dashboard(args.results, args.port, args.host)


def cmd_serve(args) -> int:
    from .service.serve import serve
    from .store import results_folder

    results_folder(args.results)
    serve(args.results, args.address, args.port, args.host, args.ray_port, args.jobs_port)


def cmd_submit(args) -> int:
    from .service import jobs

    path = Path(args.config)
    if not path.is_file():
        raise InputError(f"sweep config {path} does not exist: see configs/sweeps/ for examples")
    sid, results = jobs.submit(path.read_text(), str(path), args.results, args.address, resume=args.resume)
    print(sid)
    print(f"queued at {jobs.address(args.address)}; its run lands in {results} (on the machine the job runs on): "
          f"attnprof jobs (progress), attnprof jobs --logs {sid}, attnprof jobs --stop {sid}", file=sys.stderr)
    return 0


def cmd_jobs(args) -> int:
    from .fmt import table
    from .service import jobs

    if args.stop:
        jobs.stop(args.stop, args.address)
        print(f"stopping {args.stop}: its finished cells stay stored; attnprof submit CONFIG --resume (or attnprof "
              "sweep CONFIG --resume --out RESULTS) finishes the run")
        return 0
    if args.logs:
        print(jobs.logs(args.logs, args.address), end="")
        return 0
    rows = jobs.jobs(args.address)
    if not rows:
        print(f"no attnprof jobs at {jobs.address(args.address)}: queue one with attnprof submit CONFIG")
        return 0
    for r in rows:
        r["cells"] = f"{r['cells_done']}/{r['cells_total']}" if r["cells_total"] is not None else "-"
    print(table(rows, [(c, c) for c in ("job", "status", "submitted", "source", "cells", "folder")]))
    return 0


def _add_exec_args(p, out_default="results"):
    p.add_argument("--out", default=out_default, help="results folder" + (f" (default {out_default})"
                                                                           if out_default else " (overrides out:)"))
    p.add_argument("--force", action="store_true", help="run cells predicted over the memory budget")
    p.add_argument("--in-process", action="store_true", help="run cells in this process instead of workers")
    p.add_argument("--ray", nargs="?", const="", metavar="ADDRESS",
                   help="run the cells as Ray tasks, one GPU each: on the cluster at ADDRESS ('auto': the one this "
                        "machine runs), or without ADDRESS on this machine's cluster or a new local one")
    p.add_argument("--trace", action="store_true",
                   help="per cell, a Chrome / Perfetto trace of one forward (each attention call a range named by its "
                        "block) and on CUDA a memory snapshot, in the run folder's traces/ (large; overrides trace:)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--nvtx", action="store_true", help=NVTX_HELP + ", one per cell around them")


NVTX_HELP = ("NVTX ranges for Nsight Systems (nsys profile attnprof ...; on by itself under nsys): one per attention "
             "call named by its block, one per step (a U-Net forward) around them")


def _add_time_args(p):
    g = p.add_argument_group("time (planner/timing.py: the roofline, calibrated on stored runs of this device)")
    g.add_argument("--gpu", metavar="NAME", help="predict for this GPU from its published figures (attnprof gpus): "
                                                 "the roofline bound, no GPU needed; with --results, calibrated on "
                                                 "the runs there made on a GPU of its architecture")
    g.add_argument("--results", metavar="DIR", help="calibrate on the runs under DIR made on this machine's device "
                                                    "(with --gpu: on a GPU of that GPU's architecture)")
    g.add_argument("--host-us-per-op", type=_host_us, metavar="US",
                   help="with --gpu (or --device cuda on a GPU box): the host's microseconds per op of an eager "
                        "forward, or `here` for this machine's own, measured (default: with --gpu its published "
                        "machine's, else the published machines' range; on a GPU box its stored host-bound "
                        "forwards'; planner/host.py)")


def _host_us(text: str):
    """--host-us-per-op: a number of microseconds, or `here` (planner/host.HERE)."""
    if text == "here":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of microseconds or `here`") from None



def build_parser() -> argparse.ArgumentParser:
    """attnprof's parser: one _add_<command> per subcommand, in the order --help lists them."""
    parser = _Parser(prog="attnprof", description="Profile the attention blocks of Stable Diffusion U-Nets.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in (_add_plan, _add_gpus, _add_fit, _add_models, _add_backends, _add_run, _add_sweep, _add_profile,
                _add_replay, _add_tune, _add_record, _add_runs, _add_show, _add_serve, _add_submit, _add_jobs,
                _add_diff, _add_report, _add_dashboard):
        add(sub)
    return parser


def _add_plan(sub) -> None:
    p = sub.add_parser("plan", help="per-block tokens, score tables, FLOPs and predicted peak; no GPU, no weights",
                       description="Per-block figures from a meta-device forward: no weights, no GPU. With "
                                   "--pipeline instead of --model: a whole generation's predicted time, part by part.")
    _add_shape_args(p, model_required=False)
    p.add_argument("--pipeline", metavar="NAME", help="a whole generation's time instead of one model's forward: "
                                                      "sd15, sdxl (or sdxl-base), tiny-sd15, animatediff-sd15")
    p.add_argument("--steps", type=int, help="with --pipeline: denoising steps (default 30)")
    p.add_argument("--guidance", type=float, help="with --pipeline: guidance scale; above 1 the U-Net and text "
                                                  "encoders run twice the batch (default 7.5)")
    p.add_argument("--backend", help="the backend whose per-call peak memory, forward peak and time to give "
                                     "(attnprof backends; default sdpa)")
    _flag(p, "--option")
    p.add_argument("--memory-budget", metavar="SIZE", help="say whether the forward fits, e.g. 24GiB or 4090")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="the device whose attention kernels the forward is traced with (default cuda)")
    _flag(p, "--gpu-arch")
    p.add_argument("--json", action="store_true", help="print a JSON array, one object per size")
    _add_time_args(p)
    _add_settings_args(p)
    p.set_defaults(func=cmd_plan)


def _add_gpus(sub) -> None:
    p = sub.add_parser("gpus", help="the GPU table: memory, dense throughput and bandwidth, with their sources")
    p.set_defaults(func=cmd_gpus)


def _add_fit(sub) -> None:
    p = sub.add_parser("fit", help="the largest image whose forward (--model) or whole generation (--pipeline) "
                                   "fits a memory budget; no GPU",
                       description="With --model: for each backend, the largest image whose whole forward (weights, "
                                   "inputs and activations, traced on fake tensors) fits the budget: square sizes (or "
                                   "--aspect) at 64-pixel steps, every step screened and the answer traced exactly; "
                                   "or, with --buckets, the verdict for each of SDXL's trained aspect buckets (for a "
                                   "U-Net under classifier-free guidance give --batch 2). With --pipeline: the "
                                   "largest image whose every phase of a generation fits (text encoding, denoising "
                                   "under CFG, VAE decode), each with what the offload leaves resident, and which "
                                   "phase sets the limit.")
    p.add_argument("--model", help=MODEL_HELP)
    _add_pickle_arg(p)
    p.add_argument("--pipeline", metavar="NAME", help="a whole generation instead of one model: sd15, sdxl (or "
                                                      "sdxl-base), tiny-sd15; once per --backend")
    p.add_argument("--cfg", action=argparse.BooleanOptionalAction, default=True,
                   help="with --pipeline: classifier-free guidance, the U-Net and text at twice the batch (default on)")
    p.add_argument("--offload", choices=["none", "model", "sequential"], default="none",
                   help="with --pipeline: what stays on the device (diffusers: none, enable_model_cpu_offload, "
                        "enable_sequential_cpu_offload; default none)")
    p.add_argument("--budget", help="memory budget with its unit (12GiB, 12GB) or a GPU's name (4090, "
                                                     "L4, A100-40GB, H100: attnprof gpus)")
    p.add_argument("--backend", action="append", help="backend, repeatable (default: every one)")
    p.add_argument("--all", action="store_true", help="a row for every backend (default: one per distinct kernel and "
                                                      "answer, diffusers' dispatcher aliases named under it)")
    p.add_argument("--dtype", help="float16 | bfloat16 | float32 (default float32 with --device cpu, else float16)")
    p.add_argument("--batch", default="1", help="batch size (default 1; 2 under classifier-free guidance)")
    p.add_argument("--aspect", default="1:1", help="W:H of the sizes searched (default 1:1)")
    p.add_argument("--size", metavar="WxH", help="with a video model (AnimateDiff, SVD): the most frames that fit at "
                                                 "this size, instead of the largest size at --frames")
    p.add_argument("--buckets", action="store_true", help="judge SDXL's aspect buckets (832x1216, 1024x1024, ...) "
                                                           "instead of searching")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="device whose kernels (default cuda)")
    _flag(p, "--gpu-arch", "--json", "--quiet")
    _add_time_args(p)
    _add_settings_args(p)
    p.set_defaults(func=cmd_fit)


def _add_models(sub) -> None:
    p = sub.add_parser("models", help="list the models in configs/models")
    p.set_defaults(func=cmd_models)


def _add_backends(sub) -> None:
    p = sub.add_parser("backends", help="list the attention backends and whether each is available here")
    _flag(p, "--device")
    p.add_argument("--dtype", help="dtype to check support for (default float32 on the CPU, float16 on CUDA)")
    p.add_argument("--model", help="probe at this model's head dims (default: 40, 64, 80 and 160)")
    p.set_defaults(func=cmd_backends)


def _add_run(sub) -> None:
    p = sub.add_parser("run", help="measure per-block time and memory for each backend; writes a run",
                       description="Measure attention per block: the cartesian product of sizes and backends.",
                       epilog=EXIT_CODES)
    _add_shape_args(p)
    p.add_argument("--backend", action="append", help="backend, repeatable (default sdpa; see attnprof backends)")
    _flag(p, "--option", "--device")
    p.add_argument("--repeats", type=int, default=3, help="timed forwards per cell (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up forwards per cell (default 1)")
    p.add_argument("--memory-budget",
                   help="skip cells predicted above this (e.g. 20GiB, 20GB or a GPU name; default: free device memory)")
    p.add_argument("--timeout-s", type=float, help="stop a cell after this many seconds")
    p.add_argument("--resume", action="store_true", help="continue the latest run of the same grid under --out")
    _add_exec_args(p)
    _add_settings_args(p)
    p.set_defaults(func=cmd_run)


def _add_sweep(sub) -> None:
    p = sub.add_parser("sweep", help="run a YAML sweep from configs/sweeps (resumable)",
                       description="Run a sweep config: its keys, their defaults and the rules are in "
                                   "docs/sweeps-and-service.md.", epilog=EXIT_CODES)
    p.add_argument("config", help="a YAML file, e.g. configs/sweeps/default.yaml")
    p.add_argument("--resume", action="store_true", help="continue the latest run of this config")
    p.add_argument("--retry-failed", action="store_true", help=RETRY_HELP)
    _add_pickle_arg(p)
    _add_exec_args(p, out_default=None)
    p.set_defaults(func=cmd_sweep)


def _add_profile(sub) -> None:
    p = sub.add_parser("profile", help="run the built-in default sweep (GPU: default.yaml, CPU: cpu-default.yaml)",
                       description="Run the built-in default sweep for this machine: configs/sweeps/default.yaml "
                                   "where a GPU is visible (SD 1.5 and SDXL across sizes and backends, float16), "
                                   "else configs/sweeps/cpu-default.yaml (tiny-sd15, SD 1.5's block topology with "
                                   "few channels, with its VAE, IP-Adapter + ToMe and ControlNet, in float32: a few "
                                   "minutes on 2 cores). Resumable; then attnprof show, diff, report or the "
                                   "dashboard.", epilog=EXIT_CODES)
    p.add_argument("--resume", action="store_true", help="continue the latest default run")
    p.add_argument("--retry-failed", action="store_true", help=RETRY_HELP)
    _add_exec_args(p, out_default=None)
    p.set_defaults(func=cmd_profile)


def _add_replay(sub) -> None:
    p = sub.add_parser("replay", help="each distinct attention shape of a run or a plan, its kernel alone; a run",
                       description="Time each distinct attention shape of a run's ok cells (RUN) or of a plan "
                                   "(--model, --size) with the backend's kernel alone on random Q, K, V: no U-Net "
                                   "built, no weights. Per shape: time, TFLOP/s, peak memory and, for a run, the gap "
                                   "to the same calls inside the model. Stored as a run (show, diff, the dashboard).")
    p.add_argument("run", nargs="?", metavar="RUN", help="a run id, unique prefix, 'latest' or folder (or --model)")
    p.add_argument("--model", help="plan this model instead of replaying a run (attnprof models, or a file)")
    _add_pickle_arg(p)
    p.add_argument("--size", action="append", metavar="WxH", help="with --model: image size, repeatable (512x512)")
    p.add_argument("--batch", help="with --model: batch size (default 1)")
    p.add_argument("--dtype", help="with --model: float16 | bfloat16 | float32 (default float32 on the CPU, "
                                   "float16 on CUDA)")
    p.add_argument("--backend", action="append", help="backend, repeatable (default: the run's, or sdpa)")
    _flag(p, "--option", "--device")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per shape, at least (default 5; more, up to "
                                                          "5x, until the IQR is within 10%% of the median)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up calls per shape (default 1)")
    p.add_argument("--results", default="results", help="where RUN is (default results)")
    p.add_argument("--out", default="results", help="results folder for the replay's run (default results)")
    _flag(p, "--quiet")
    p.set_defaults(func=cmd_replay)


def _add_tune(sub) -> None:
    p = sub.add_parser("tune", help="the fastest backend per block, as a processor map; proved by the whole forward",
                       description="Time every available backend on each distinct attention shape of the model's "
                                   "forward, alone (as replay does: kernel time on CUDA; warm-up and repeats until the "
                                   "IQR is small), in ABBA rounds across the backends, each within its dtype's "
                                   "tolerance of the fp32 reference; pick the fastest per block (with --budget: the "
                                   "fastest whose transient keeps the whole forward, as the planner traces it, within "
                                   "the budget). Then measure the whole U-Net forward with the map against the best "
                                   "single backend (and sdpa), interleaved, judged by the noise rule; where the map is "
                                   "no faster it keeps the single backend. Writes a run and its map, tuned.json, "
                                   "which attnprof run --backend, record --backend and profiler.apply take.")
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument("--size", action="append", metavar="WxH", help="image size in pixels (default 512x512)")
    p.add_argument("--batch", default="1", help="batch size (default 1)")
    p.add_argument("--dtype", help="float16 | bfloat16 | float32 (default float32 on the CPU, float16 on CUDA)")
    p.add_argument("--budget", metavar="SIZE", help="keep the whole forward within this (24GiB, 24GB or a GPU's "
                                                   "name): per block the fastest backend that does")
    p.add_argument("--backend", action="append", help="a backend to time, repeatable (default: every registered one "
                                                      "that runs here, but flex, which compiles per shape, and "
                                                      "diffusers' aliases of ours)")
    _flag(p, "--option", "--device")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per shape and round, at least (default 3; "
                                                          "more until the IQR is within 10%% of the median)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up calls per shape and round (default 1)")
    p.add_argument("--rounds", type=int, default=2, help="ABBA rounds of each shape's backends (default 2)")
    p.add_argument("--proof-rounds", type=int, default=6, help="whole forwards of each contender in the proof, "
                                                               "interleaved (default 6; at least 3, what the noise "
                                                               "rule judges)")
    p.add_argument("--out", default="results", help="results folder for the run and its map (default results)")
    _flag(p, "--quiet")
    p.set_defaults(func=cmd_tune)


def _add_record(sub) -> None:
    p = sub.add_parser("record", help="profile an unmodified script's diffusers pipeline calls as they run; a run",
                       description="Run SCRIPT as `python SCRIPT ARGS` would, once per --backend (none: once, with "
                                   "the processors it loads), each in a process of its own, and profile every "
                                   "diffusers pipeline call in it: each attention call of each component, its step, "
                                   "time and (CUDA) peak; each component's forwards. Stored as one run, a cell per "
                                   "backend (show, diff, report, the dashboard). The exit status is the script's; "
                                   "130 when interrupted (Ctrl-C), the cells recorded so far kept: --resume RUN "
                                   "finishes the run.",
                       epilog="example: attnprof record --backend sdpa --backend sliced -- docs/examples/generate.py "
                              "--steps 3")
    p.add_argument("--backend", action="append", help="run the script with this backend's processors, repeatable "
                                                      "(default: the processors the script loads)")
    p.add_argument("--out", default="results", help="results folder for the run (default results)")
    p.add_argument("--trace", action="store_true", help="also a Chrome / Perfetto trace of each generation, each "
                                                        "attention call a range named by its block and shape")
    _flag(p, "--quiet")
    p.add_argument("--nvtx", action="store_true", help=NVTX_HELP + ", in the script's process")
    p.add_argument("--resume", metavar="RUN", help="finish an interrupted record run (under --out): its script, with "
                                                   "its arguments, for each backend it has no cell of")
    p.add_argument("script", metavar="SCRIPT.py", nargs="?", help="the script to run (after --; `-- python "
                                                                  "SCRIPT.py` runs it too)")
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="its arguments")
    p.set_defaults(func=cmd_record)


def _add_runs(sub) -> None:
    p = sub.add_parser("runs", help="list the runs under the results folder")
    _flag(p, "--results")
    p.set_defaults(func=cmd_runs)


def _add_show(sub) -> None:
    p = sub.add_parser("show", help="print a run's summary")
    p.add_argument("run", nargs="?", default="latest", help="run id, a unique prefix, 'latest' or a folder")
    _flag(p, "--results")
    p.add_argument("--wide", action="store_true", help="every column, whatever the terminal's width (default: fit "
                                                       "$COLUMNS, or 120)")
    p.add_argument("--legend", action="store_true", help="also what each column of the cells' table is")
    p.set_defaults(func=cmd_show)


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="the service: a Ray head (or --address's cluster) and the dashboard with its "
                                     "Queue page", description="Start a Ray head on this machine (token "
                       "authentication on; it keeps running after the dashboard stops, so jobs survive a restart), "
                       "or use the cluster at --address, and serve the dashboard. Binds to 127.0.0.1 unless --host "
                       "says otherwise: anyone who reaches these ports and holds the token can run code here.")
    _flag(p, "--results")
    p.add_argument("--address", help="use the Ray cluster whose job server is at ADDRESS (http://HOST:8265, or "
                                     "HOST:PORT) instead of starting a head here")
    p.add_argument("--port", type=int, default=8501, help="the dashboard's port (default 8501)")
    _flag(p, "--host")
    p.add_argument("--ray-port", type=int, default=6379, help="the Ray head's port (default 6379)")
    p.add_argument("--jobs-port", type=int, default=8265, help="Ray's job server / dashboard port (default 8265)")
    p.set_defaults(func=cmd_serve)


def _add_submit(sub) -> None:
    p = sub.add_parser("submit", help="queue a sweep config as a Ray Job; prints the job id",
                       description="Validate a sweep config as attnprof sweep would, then queue it as a Ray Job "
                                   "that runs it with --ray on the cluster.")
    p.add_argument("config", help="a YAML file, e.g. configs/sweeps/default.yaml")
    _flag(p, "--address")
    p.add_argument("--results", help="where the run lands, a folder on the machine the job runs on (default: the "
                                     "config's out:, else the folder attnprof serve shows)")
    p.add_argument("--resume", action="store_true", help="continue the latest run of this config there")
    p.set_defaults(func=cmd_submit)


def _add_jobs(sub) -> None:
    p = sub.add_parser("jobs", help="list the queued profiles with status, cells done / total and run; stop one",
                       description="The attnprof jobs of the cluster (Ray Jobs), newest first.")
    _flag(p, "--address")
    p.add_argument("--stop", metavar="ID", help="stop this job (its finished cells stay stored, the run resumable)")
    p.add_argument("--logs", metavar="ID", help="print this job's log")
    p.set_defaults(func=cmd_jobs)


def _add_diff(sub) -> None:
    from .report.compare import NOT_JUDGED_EXIT, THRESHOLD, rule_text

    p = sub.add_parser("diff", help="run B against run A, cell by cell; exit 1 on a regression, "
                                    f"{NOT_JUDGED_EXIT} where a time is not judged (for CI)",
                       description="Cells matched on model, size, batch, dtype and backend with options; per cell the "
                                   "time and peak-memory ratio of B to A and a verdict, regression or improvement by "
                                   f"the noise rule: {rule_text()}; anything else "
                                   "is within noise. "
                                   "Exit code 1 when any regression is found, else "
                                   f"{NOT_JUDGED_EXIT} when any cell's time is not judged (too few samples, too "
                                   "noisy, timed by different clocks, or the machine moved: a CI gate must not pass "
                                   "it silently), else 0; 2 on bad input.")
    p.add_argument("run_a", metavar="RUN_A", help="the baseline: run id, unique prefix, 'latest' or a folder")
    p.add_argument("run_b", metavar="RUN_B", help="the run judged against it")
    _flag(p, "--results")
    p.add_argument("--threshold", type=float, default=THRESHOLD,
                   help=f"smallest relative change that counts ({THRESHOLD})")
    p.add_argument("--json", action="store_true", help="print JSON: summary, matched, only_a, only_b")
    p.set_defaults(func=cmd_diff)


def _add_report(sub) -> None:
    p = sub.add_parser("report", help="one self-contained HTML file of one or more runs (no server, no network)")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run ids, unique prefixes, 'latest' or folders")
    p.add_argument("--out", "--html", dest="html", metavar="FILE",
                   help="where to write the report (--html: the same; default: beside the runs, "
                        "RESULTS/report-<run id>.html)")
    _flag(p, "--results")
    p.set_defaults(func=cmd_report)


def _add_dashboard(sub) -> None:
    p = sub.add_parser("dashboard", help="serve the Streamlit dashboard over the runs under the results folder")
    _flag(p, "--results")
    p.add_argument("--port", type=int, default=8501, help="port (default 8501)")
    _flag(p, "--host")
    p.set_defaults(func=cmd_dashboard)


def _nvtx(args):
    """--nvtx: NVTX ranges on for the command and the processes it starts (devices.nvtx_ranges); else nothing."""
    if not getattr(args, "nvtx", False):
        return contextlib.nullcontext()
    from . import devices

    return devices.nvtx_ranges()


def main(argv=None) -> int:
    from .execute import ExecutorError, stop_on_sigterm

    stop_on_sigterm()
    try:
        args = build_parser().parse_args(argv)
        if getattr(args, "allow_pickle", False):
            from .unet.checkpoint import allow_pickle

            allow_pickle()
        with _nvtx(args):
            code = args.func(args)
        sys.stdout.flush()  # a reader that went away shows here, not at the interpreter's exit
        return code
    except BrokenPipeError:  # attnprof show | head: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so that the exit's flush stays quiet
        return CLOSED_PIPE
    except InputError as e:
        print(f"attnprof: error: {e}", file=sys.stderr)
        return 2
    except ExecutorError as e:  # a subprocess of the sweep died where no cell row can say so
        print(f"attnprof: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("attnprof: interrupted", file=sys.stderr)
        return 130
