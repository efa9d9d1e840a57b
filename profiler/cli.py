"""Command line: the parser, as a table of subcommands and their flags; each subcommand runs the function of the module
that owns it with the parsed values its parameters name. Bad input exits with code 2 and one line, no traceback."""
from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import os
import sys
import textwrap

from .execute import NO_CELL_OK, ExecutorError, stop_on_sigterm
from .spec import COMPILE_MODES, SETTINGS, VAE_PARTS, InputError

EXIT_CODES = (f"exit codes: 0 when at least one cell ended ok, {NO_CELL_OK} when none did, 2 on bad input (nothing "
              "run or written), 130 when interrupted (the cells recorded so far are kept)")
RETRY_HELP = "run again the cells of the latest run of this config that did not end ok (implies --resume)"
CLOSED_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a command whose output pipe was closed


class _Help(argparse.HelpFormatter):
    """argparse's help, wrapped without breaking at hyphens: a path such as docs/sweeps-and-service.md stays whole."""

    def _fill_text(self, text, width, indent):
        return textwrap.fill(" ".join(text.split()), width, initial_indent=indent, subsequent_indent=indent,
                             break_on_hyphens=False)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{"formatter_class": _Help, **kwargs})

    def error(self, message):  # one line instead of usage + message
        raise InputError(f"{message} (see {self.prog} --help)")


def _host_us(text: str):
    """--host-us-per-op: a number of microseconds, or `here` (planner/host.HERE)."""
    if text == "here":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of microseconds or `here`") from None


def A(*names, **kw) -> tuple:
    """One add_argument call of the table: its names and keywords."""
    return names, kw


def G(title: str, *items) -> tuple:
    """An argument group of the table: its title and items."""
    return G, title, items


MODEL_HELP = "registry name (attnprof models), diffusers folder, hub id or single-file checkpoint (.safetensors)"
DTYPE_HELP = "float16 | bfloat16 | float32 (default float32 on the CPU, float16 on CUDA)"
RECORD_TEXT = ("Run SCRIPT as `python SCRIPT ARGS` would, once per --backend (none: once, with the processors it "
               "loads), each in a process of its own, and profile every diffusers pipeline call in it: each attention "
               "call of each component, its step, time and (CUDA) peak; each component's forwards. Stored as one run, "
               "a cell per backend (show, diff, report, the dashboard). The exit status is the script's; 130 when "
               "interrupted (Ctrl-C), the cells recorded so far kept: --resume RUN finishes the run.")
NVTX_HELP = ("NVTX ranges for Nsight Systems (nsys profile attnprof ...; on by itself under nsys): one per attention "
             "call named by its block, one per step (a U-Net forward) around them")
FLAGS = {  # the flags several commands share, each defined once; a name in the table adds it as it is here
    "--results": dict(default="results", help="results folder (default results)"),
    "--device": dict(default="auto", help="auto | cpu | cuda | cuda:N (default auto)"),
    "--quiet": dict(action="store_true", help="no progress on stderr"),
    "--option": dict(action="append", metavar="KEY=VALUE", help="backend option, e.g. slice_size=4"),
    "--json": dict(action="store_true", help="print JSON"),
    "--address": dict(help="the job server (default: $ATTNPROF_JOBS_ADDRESS or http://127.0.0.1:8265)"),
    "--host": dict(default="127.0.0.1", help="address to listen on (default 127.0.0.1)"),
    "--gpu-arch": dict(metavar="SM", help="on cuda, the GPU whose SDPA kernel choice to follow, as a compute "
                       "capability (sm80, sm89, sm90, sm100, ...; default: this machine's GPU, else sm90, an H100 / "
                       "H200)"),
    "--allow-pickle": dict(action="store_true", help="let --model be a .ckpt / .pt checkpoint: a pickle, which runs "
                                                     "any code it holds when loaded"),
    "--batch": dict(default="1", help="batch size (default 1)"),
    "--dtype": dict(help=DTYPE_HELP),
    "--retry-failed": dict(action="store_true", help=RETRY_HELP),
}
SHAPE = ["--allow-pickle", A("--size", action="append", metavar="WxH",
                             help="image size in pixels, repeatable (default 512x512)"), "--batch", "--dtype"]
SETTINGS_FLAGS = G(
    "model settings (a U-Net's; a video U-Net's; a VAE's)",
    A("--controlnet", nargs="?", const=True, default=None, metavar="DIR",
      help="U-Net: run a ControlNet beside it, as a pipeline step does: the registry's of the U-Net, or with DIR your "
           "own (the folder ControlNetModel.save_pretrained wrote, or its config.json)"),
    A("--ip-adapter-tokens", type=int, metavar="N",
      help="U-Net: IP-Adapter's image tokens in every cross-attention (4: IP-Adapter, 16: plus)"),
    A("--tome", type=float, metavar="RATIO", help="U-Net: Token Merging at this ratio, e.g. 0.5"),
    A("--compile", choices=COMPILE_MODES,
      help="U-Net: run it compiled: regional (diffusers' compile_repeated_blocks) or full (torch.compile of the whole "
           "U-Net); default none (eager). run / sweep measure it; plan and fit predict eager"),
    A("--frames", type=int, metavar="N",
      help="video U-Net (AnimateDiff, SVD): frames per video (default: the model's: 16 for AnimateDiff, 25 for "
           "SVD-XT)"),
    A("--vae-part", choices=VAE_PARTS, help="VAE: decoder (default) or encoder"),
    A("--vae-tiling", action="store_true", default=None, help="VAE: tiled decode / encode"),
    A("--vae-slicing", action="store_true", default=None, help="VAE: one image of the batch at a time"),
    A("--vae-upcast", action=argparse.BooleanOptionalAction, default=None,
      help="VAE: compute in float32 (default: as diffusers, the config's force_upcast where the dtype is float16; with "
           "plan --pipeline, the decode's)"))
TIME_FLAGS = G(
    "time (planner/timing.py: the roofline, calibrated on stored runs of this device)",
    A("--gpu", metavar="NAME", help="predict for this GPU from its published figures (attnprof gpus): the roofline "
                                    "bound, no GPU needed; with --results, calibrated on the runs there made on a GPU "
                                    "of its architecture"),
    A("--results", metavar="DIR", help="calibrate on the runs under DIR made on this machine's device (with --gpu: on "
                                       "a GPU of that GPU's architecture)"),
    A("--host-us-per-op", type=_host_us, metavar="US",
      help="with --gpu (or --device cuda on a GPU box): the host's microseconds per op of an eager forward, or `here` "
           "for this machine's own, measured (default: with --gpu its published machine's, else the published "
           "machines' range; on a GPU box its stored host-bound forwards'; planner/host.py)"))


def _exec_flags(out_default="results") -> list:
    """How and where a sweep's cells run: run, sweep and profile."""
    return [A("--out", default=out_default, help="results folder" + (f" (default {out_default})" if out_default
                                                                       else " (overrides out:)")),
            A("--force", action="store_true", help="run cells predicted over the memory budget"),
            A("--in-process", action="store_true", help="run cells in this process instead of workers"),
            A("--ray", nargs="?", const="", metavar="ADDRESS",
              help="run the cells as Ray tasks, one GPU each: on the cluster at ADDRESS ('auto': the one this machine "
                   "runs), or without ADDRESS on this machine's cluster or a new local one"),
            A("--trace", action="store_true",
              help="per cell, a Chrome / Perfetto trace of one forward (each attention call a range named by its "
                   "block) and on CUDA a memory snapshot, in the run folder's traces/ (large; overrides trace:)"),
            A("--quiet", action="store_true", help="no progress bar"),
            A("--nvtx", action="store_true", help=NVTX_HELP + ", one per cell around them")]


def _replay(args) -> int:
    """attnprof replay: measure/replay.py's run, shown as report/show.py shows a replay."""
    from .measure.replay import replay_command
    from .report.show import format_replay

    print(format_replay(_call(replay_command, args)))
    return 0


COMMANDS = [  # (name, what runs it: module:function under profiler/ or a function here, add_parser's keywords, its
    # flags), in the order --help lists them
    ("plan", "planner.commands:plan",
     dict(help="per-block tokens, score tables, FLOPs and predicted peak; no GPU, no weights",
          description="Per-block figures from a meta-device forward: no weights, no GPU. With --pipeline instead of "
                      "--model: a whole generation's predicted time, part by part."),
     [A("--model", help=MODEL_HELP), *SHAPE,
      A("--pipeline", metavar="NAME", help="a whole generation's time instead of one model's forward: sd15, sdxl (or "
                                           "sdxl-base), tiny-sd15, animatediff-sd15"),
      A("--steps", type=int, help="with --pipeline: denoising steps (default 30)"),
      A("--guidance", type=float, help="with --pipeline: guidance scale; above 1 the U-Net and text encoders run "
                                       "twice the batch (default 7.5)"),
      A("--backend", help="the backend whose per-call peak memory, forward peak and time to give (attnprof backends; "
                          "default sdpa)"),
      "--option", A("--memory-budget", metavar="SIZE", help="say whether the forward fits, e.g. 24GiB or 4090"),
      A("--device", default="cuda", choices=["cuda", "cpu"],
        help="the device whose attention kernels the forward is traced with (default cuda)"),
      "--gpu-arch", A("--json", action="store_true", help="print a JSON array, one object per size"), TIME_FLAGS,
      SETTINGS_FLAGS]),
    ("gpus", "planner.commands:gpus_table",
     dict(help="the GPU table: memory, dense throughput and bandwidth, with their sources"), []),
    ("fit", "planner.commands:fit",
     dict(help="the largest image whose forward (--model) or whole generation (--pipeline) fits a memory budget; no "
               "GPU",
          description="With --model: for each backend, the largest image whose whole forward (weights, inputs and "
                      "activations, traced on fake tensors) fits the budget: square sizes (or --aspect) at 64-pixel "
                      "steps, every step screened and the answer traced exactly; or, with --buckets, the verdict for "
                      "each of SDXL's trained aspect buckets (for a U-Net under classifier-free guidance give --batch "
                      "2). With --pipeline: the largest image whose every phase of a generation fits (text encoding, "
                      "denoising under CFG, VAE decode), each with what the offload leaves resident, and which phase "
                      "sets the limit."),
     [A("--model", help=MODEL_HELP), "--allow-pickle",
      A("--pipeline", metavar="NAME", help="a whole generation instead of one model: sd15, sdxl (or sdxl-base), "
                                           "tiny-sd15; once per --backend"),
      A("--cfg", action=argparse.BooleanOptionalAction, default=True,
        help="with --pipeline: classifier-free guidance, the U-Net and text at twice the batch (default on)"),
      A("--offload", choices=["none", "model", "sequential"], default="none",
        help="with --pipeline: what stays on the device (diffusers: none, enable_model_cpu_offload, "
             "enable_sequential_cpu_offload; default none)"),
      A("--budget", help="memory budget with its unit (12GiB, 12GB) or a GPU's name (4090, L4, A100-40GB, H100: "
                         "attnprof gpus)"),
      A("--backend", action="append", help="backend, repeatable (default: every one)"),
      A("--all", action="store_true", help="a row for every backend (default: one per distinct kernel and answer, "
                                           "diffusers' dispatcher aliases named under it)"),
      A("--dtype", help="float16 | bfloat16 | float32 (default float32 with --device cpu, else float16)"),
      A("--batch", default="1", help="batch size (default 1; 2 under classifier-free guidance)"),
      A("--aspect", default="1:1", help="W:H of the sizes searched (default 1:1)"),
      A("--size", metavar="WxH", help="with a video model (AnimateDiff, SVD): the most frames that fit at this size, "
                                      "instead of the largest size at --frames"),
      A("--buckets", action="store_true", help="judge SDXL's aspect buckets (832x1216, 1024x1024, ...) instead of "
                                               "searching"),
      A("--device", default="cuda", choices=["cuda", "cpu"], help="device whose kernels (default cuda)"),
      "--gpu-arch", "--json", "--quiet", TIME_FLAGS, SETTINGS_FLAGS]),
    ("models", "planner.commands:models_table", dict(help="list the models in configs/models"), []),
    ("backends", "planner.commands:backends_table",
     dict(help="list the attention backends and whether each is available here"),
     ["--device", A("--dtype", help="dtype to check support for (default float32 on the CPU, float16 on CUDA)"),
      A("--model", help="probe at this model's head dims (default: 40, 64, 80 and 160)")]),
    ("run", "execute.commands:run",
     dict(help="measure per-block time and memory for each backend; writes a run",
          description="Measure attention per block: the cartesian product of sizes and backends.", epilog=EXIT_CODES),
     [A("--model", required=True, help=MODEL_HELP), *SHAPE,
      A("--backend", action="append", help="backend, repeatable (default sdpa; see attnprof backends)"),
      "--option", "--device", A("--repeats", type=int, default=3, help="timed forwards per cell (default 3)"),
      A("--warmup", type=int, default=1, help="warm-up forwards per cell (default 1)"),
      A("--memory-budget",
        help="skip cells predicted above this (e.g. 20GiB, 20GB or a GPU name; default: free device memory)"),
      A("--timeout-s", type=float, help="stop a cell after this many seconds"),
      A("--resume", action="store_true", help="continue the latest run of the same grid under --out"),
      *_exec_flags(), SETTINGS_FLAGS]),
    ("sweep", "execute.commands:sweep",
     dict(help="run a YAML sweep from configs/sweeps (resumable)",
          description="Run a sweep config: its keys, their defaults and the rules are in docs/sweeps-and-service.md.",
          epilog=EXIT_CODES),
     [A("config", help="a YAML file, e.g. configs/sweeps/default.yaml"),
      A("--resume", action="store_true", help="continue the latest run of this config"), "--retry-failed",
      "--allow-pickle", *_exec_flags(None)]),
    ("profile", "execute.commands:profile",
     dict(help="run the built-in default sweep (GPU: default.yaml, CPU: cpu-default.yaml)",
          description="Run the built-in default sweep for this machine: configs/sweeps/default.yaml where a GPU is "
                      "visible (SD 1.5 and SDXL across sizes and backends, float16), else "
                      "configs/sweeps/cpu-default.yaml (tiny-sd15, SD 1.5's block topology with few channels, with "
                      "its VAE, IP-Adapter + ToMe and ControlNet, in float32: a few minutes on 2 cores). Resumable; "
                      "then attnprof show, diff, report or the dashboard.", epilog=EXIT_CODES),
     [A("--resume", action="store_true", help="continue the latest default run"), "--retry-failed",
      *_exec_flags(None)]),
    ("replay", _replay,
     dict(help="each distinct attention shape of a run or a plan, its kernel alone; a run",
          description="Time each distinct attention shape of a run's ok cells (RUN) or of a plan (--model, --size) "
                      "with the backend's kernel alone on random Q, K, V: no U-Net built, no weights. Per shape: "
                      "time, TFLOP/s, peak memory and, for a run, the gap to the same calls inside the model. Stored "
                      "as a run (show, diff, the dashboard)."),
     [A("run", nargs="?", metavar="RUN", help="a run id, unique prefix, 'latest' or folder (or --model)"),
      A("--model", help="plan this model instead of replaying a run (attnprof models, or a file)"), "--allow-pickle",
      A("--size", action="append", metavar="WxH", help="with --model: image size, repeatable (512x512)"),
      A("--batch", help="with --model: batch size (default 1)"), A("--dtype", help="with --model: " + DTYPE_HELP),
      A("--backend", action="append", help="backend, repeatable (default: the run's, or sdpa)"), "--option",
      "--device", A("--repeats", type=int, default=5, help="timed calls per shape, at least (default 5; more, up to "
                                                           "5x, until the IQR is within 10%% of the median)"),
      A("--warmup", type=int, default=1, help="warm-up calls per shape (default 1)"),
      A("--results", default="results", help="where RUN is (default results)"),
      A("--out", default="results", help="results folder for the replay's run (default results)"), "--quiet"]),
    ("tune", "tuning.tuner:tune_command",
     dict(help="the fastest backend per block, as a processor map; proved by the whole forward",
          description="Time every available backend on each distinct attention shape of the model's forward, alone "
                      "(as replay does: kernel time on CUDA; warm-up and repeats until the IQR is small), in ABBA "
                      "rounds across the backends, each within its dtype's tolerance of the fp32 reference; pick the "
                      "fastest per block (with --budget: the fastest whose transient keeps the whole forward, as the "
                      "planner traces it, within the budget). Then measure the whole U-Net forward with the map "
                      "against the best single backend (and sdpa), interleaved, judged by the noise rule; where the "
                      "map is no faster it keeps the single backend. Writes a run and its map, tuned.json, which "
                      "attnprof run --backend, record --backend and profiler.apply take."),
     [A("--model", required=True, help=MODEL_HELP),
      A("--size", action="append", metavar="WxH", help="image size in pixels (default 512x512)"), "--batch",
      "--dtype", A("--budget", metavar="SIZE", help="keep the whole forward within this (24GiB, 24GB or a GPU's "
                                                    "name): per block the fastest backend that does"),
      A("--backend", action="append", help="a backend to time, repeatable (default: every registered one that runs "
                                           "here, but flex, which compiles per shape, and diffusers' aliases of ours)"),
      "--option", "--device", A("--repeats", type=int, default=3, help="timed calls per shape and round, at least "
                                                                       "(default 3; more until the IQR is within 10%% "
                                                                       "of the median)"),
      A("--warmup", type=int, default=1, help="warm-up calls per shape and round (default 1)"),
      A("--rounds", type=int, default=2, help="ABBA rounds of each shape's backends (default 2)"),
      A("--proof-rounds", type=int, default=6, help="whole forwards of each contender in the proof, interleaved "
                                                    "(default 6; at least 3, what the noise rule judges)"),
      A("--out", default="results", help="results folder for the run and its map (default results)"), "--quiet"]),
    ("record", "record.script:record_command",
     dict(help="profile an unmodified script's diffusers pipeline calls as they run; a run",
          description=RECORD_TEXT,
          epilog="example: attnprof record --backend sdpa --backend sliced -- docs/examples/generate.py --steps 3"),
     [A("--backend", action="append", help="run the script with this backend's processors, repeatable (default: the "
                                           "processors the script loads)"),
      A("--out", default="results", help="results folder for the run (default results)"),
      A("--trace", action="store_true", help="also a Chrome / Perfetto trace of each generation, each attention call "
                                             "a range named by its block and shape"),
      "--quiet", A("--nvtx", action="store_true", help=NVTX_HELP + ", in the script's process"),
      A("--resume", metavar="RUN", help="finish an interrupted record run (under --out): its script, with its "
                                        "arguments, for each backend it has no cell of"),
      A("script", metavar="SCRIPT.py", nargs="?", help="the script to run (after --; `-- python SCRIPT.py` runs it "
                                                       "too)"),
      A("args", nargs=argparse.REMAINDER, metavar="ARGS", help="its arguments")]),
    ("runs", "report.show:runs_command", dict(help="list the runs under the results folder"), ["--results"]),
    ("show", "report.show:show_command", dict(help="print a run's summary"),
     [A("run", nargs="?", default="latest", help="run id, a unique prefix, 'latest' or a folder"), "--results",
      A("--wide", action="store_true", help="every column, whatever the terminal's width (default: fit $COLUMNS, or "
                                            "120)"),
      A("--legend", action="store_true", help="also what each column of the cells' table is")]),
    ("serve", "service.serve:serve_command",
     dict(help="the service: a Ray head (or --address's cluster) and the dashboard with its Queue page",
          description="Start a Ray head on this machine (token authentication on; it keeps running after the "
                      "dashboard stops, so jobs survive a restart), or use the cluster at --address, and serve the "
                      "dashboard. Binds to 127.0.0.1 unless --host says otherwise: anyone who reaches these ports and "
                      "holds the token can run code here."),
     ["--results", A("--address", help="use the Ray cluster whose job server is at ADDRESS (http://HOST:8265, or "
                                       "HOST:PORT) instead of starting a head here"),
      A("--port", type=int, default=8501, help="the dashboard's port (default 8501)"), "--host",
      A("--ray-port", type=int, default=6379, help="the Ray head's port (default 6379)"),
      A("--jobs-port", type=int, default=8265, help="Ray's job server / dashboard port (default 8265)")]),
    ("submit", "service.serve:submit_command",
     dict(help="queue a sweep config as a Ray Job; prints the job id",
          description="Validate a sweep config as attnprof sweep would, then queue it as a Ray Job that runs it with "
                      "--ray on the cluster."),
     [A("config", help="a YAML file, e.g. configs/sweeps/default.yaml"), "--address",
      A("--results", help="where the run lands, a folder on the machine the job runs on (default: the config's out:, "
                          "else the folder attnprof serve shows)"),
      A("--resume", action="store_true", help="continue the latest run of this config there")]),
    ("jobs", "service.serve:jobs_command",
     dict(help="list the queued profiles with status, cells done / total and run; stop one",
          description="The attnprof jobs of the cluster (Ray Jobs), newest first."),
     ["--address", A("--stop", metavar="ID", help="stop this job (its finished cells stay stored, the run resumable)"),
      A("--logs", metavar="ID", help="print this job's log")]),
    ("diff", "report.compare:diff_command", None, None),  # its texts are report/compare.py's: _diff()
    ("report", "report.show:report_command",
     dict(help="one self-contained HTML file of one or more runs (no server, no network)"),
     [A("runs", nargs="+", metavar="RUN", help="run ids, unique prefixes, 'latest' or folders"),
      A("--out", "--html", dest="html", metavar="FILE", help="where to write the report (--html: the same; default: "
                                                             "beside the runs, RESULTS/report-<run id>.html)"),
      "--results"]),
    ("dashboard", "service.serve:dashboard_command",
     dict(help="serve the Streamlit dashboard over the runs under the results folder"),
     ["--results", A("--port", type=int, default=8501, help="port (default 8501)"), "--host"]),
]


def _diff() -> tuple:
    """diff's add_parser keywords and flags: its exit codes and noise rule are report/compare.py's."""
    from .report.compare import NOT_JUDGED_EXIT, THRESHOLD, rule_text

    return (dict(help=f"run B against run A, cell by cell; exit 1 on a regression, {NOT_JUDGED_EXIT} where a time is "
                      "not judged (for CI)",
                 description="Cells matched on model, size, batch, dtype and backend with options; per cell the time "
                             "and peak-memory ratio of B to A and a verdict, regression or improvement by the noise "
                             f"rule: {rule_text()}; anything else is within noise. Exit code 1 when any regression "
                             f"is found, else {NOT_JUDGED_EXIT} when any cell's time is not judged (too few samples, "
                             "too noisy, timed by different clocks, or the machine moved: a CI gate must not pass it "
                             "silently), else 0; 2 on bad input."),
            [A("run_a", metavar="RUN_A", help="the baseline: run id, unique prefix, 'latest' or a folder"),
             A("run_b", metavar="RUN_B", help="the run judged against it"), "--results",
             A("--threshold", type=float, default=THRESHOLD,
               help=f"smallest relative change that counts ({THRESHOLD})"),
             A("--json", action="store_true", help="print JSON: summary, matched, only_a, only_b")])


def _add(p, items) -> None:
    """The table's flags added to p in order: a FLAGS name, an A(...) call or a G(...) group."""
    for item in items:
        if isinstance(item, str):
            p.add_argument(item, **FLAGS[item])
        elif item[0] is G:
            _add(p.add_argument_group(item[1]), item[2])
        else:
            p.add_argument(*item[0], **item[1])


def build_parser() -> argparse.ArgumentParser:
    """attnprof's parser: a subparser per row of COMMANDS, in the order --help lists them."""
    parser = _Parser(prog="attnprof", description="Profile the attention blocks of Stable Diffusion U-Nets.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, func, kw, items in COMMANDS:
        kw, items = (kw, items) if kw is not None else _diff()
        p = sub.add_parser(name, **kw)
        _add(p, items)
        p.set_defaults(func=func)
    return parser


def _call(fn, args):
    """fn with the parsed values its parameters name; given: the model settings given (profiler.spec.SETTINGS)."""
    values = {**vars(args), "given": {n: getattr(args, n) for n in SETTINGS if getattr(args, n, None) is not None}}
    return fn(**{k: values[k] for k in inspect.signature(fn).parameters if k in values})


def _run(args):
    """The subcommand's function (COMMANDS: module:function under profiler/, or one here), on the parsed values."""
    if callable(args.func):
        return args.func(args)
    module, name = args.func.split(":")
    return _call(getattr(importlib.import_module(f"profiler.{module}"), name), args)


def _sweep_from_args(args):
    """attnprof run's sweep from its parsed values (execute/commands.run_sweep), unrun."""
    from .execute.commands import run_sweep

    return _call(run_sweep, args)


def _nvtx(args):
    """--nvtx: NVTX ranges on for the command and the processes it starts (devices.nvtx_ranges); else nothing."""
    if not getattr(args, "nvtx", False):
        return contextlib.nullcontext()
    from . import devices

    return devices.nvtx_ranges()


def main(argv=None) -> int:
    stop_on_sigterm()
    try:
        args = build_parser().parse_args(argv)
        if getattr(args, "allow_pickle", False):
            from .unet.checkpoint import allow_pickle

            allow_pickle()
        with _nvtx(args):
            code = _run(args)
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
