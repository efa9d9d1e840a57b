import json
import subprocess
import sys
from pathlib import Path

import pytest

from profiler.cli import main

REPO = Path(__file__).resolve().parent.parent


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_prints_table_and_totals(capsys):
    code, out, _ = run(capsys, "plan", "--model", "sd15", "--size", "512x512")
    assert code == 0
    assert "down_blocks.0.attentions.0.transformer_blocks.0.attn1" in out
    assert "calls per forward:         32 (16 self, 16 cross)" in out
    assert "params_total:              859.52M" in out


def test_plan_without_a_backend_gives_sdpas_peak_and_time_and_its_footer_fits_the_terminal(capsys, monkeypatch):
    """plan --model without --backend: SDPA's per-call peak, the forward's peak and (with --gpu) its time, as help
    promises, and says it took the default; every footer line within the terminal's width ($COLUMNS 100), its
    sources named (no [1]-style numbers), a long value continued under itself (fddf537: no peak, no time, a
    1,457-character line)."""
    monkeypatch.setenv("COLUMNS", "100")
    code, out, _ = run(capsys, "plan", "--model", "sd15", "--size", "512x512", "--gpu", "A100")
    assert code == 0 and "peak (sdpa)" in out and "forward peak on cuda:" in out and "predicted time:" in out
    assert out.rstrip().endswith("backend: sdpa, the default (as run and plan --pipeline take it); --backend NAME "
                                 "for another")
    footer = out.split("\n\n")[1].splitlines()
    assert len(footer) > 15 and all(len(line) <= 100 for line in footer), max(footer, key=len)
    assert "[1]" not in out and "the A100-40GB's published figures" in " ".join(out.split())
    i = next(i for i, line in enumerate(footer) if line.startswith("time from:"))
    assert footer[i + 1].startswith(" " * len("params_transformer_blocks: ") + footer[i + 1].strip())
    t = json.loads(run(capsys, "plan", "--model", "sd15", "--gpu", "A100", "--json")[1])[0]["totals"]
    assert t["predicted_forward_peak_bytes"] > t["weights_bytes"] and t["predicted_forward_time_ms"] > 0


def test_plan_json_one_object_per_size(capsys):
    code, out, _ = run(capsys, "plan", "--model", "sdxl-base", "--size", "1024x1024", "--size", "832x1216",
                       "--batch", "2", "--dtype", "bfloat16", "--json")
    assert code == 0
    plans = json.loads(out)
    assert [(p["width"], p["height"]) for p in plans] == [(1024, 1024), (832, 1216)]
    p = plans[1]
    assert (p["model"], p["batch"], p["dtype"]) == ("sdxl-base", 2, "bfloat16")
    assert len(p["blocks"]) == p["totals"]["calls"] == 140
    row = p["blocks"][0]
    for key in ("block", "stage", "level", "kind", "batch", "heads", "head_dim", "tokens_q", "tokens_k",
                "score_elements", "score_bytes", "flops"):
        assert key in row
    assert row["score_elements"] == 2 * row["heads"] * row["tokens_q"] * row["tokens_k"]
    assert round(p["totals"]["share_transformer_blocks"], 3) == 0.860


@pytest.mark.parametrize("argv, message", [
    (["plan", "--model", "sd14"], "unknown model 'sd14': did you mean sd15? known models are animatediff-sd15, animatediff-sdxl, kandinsky22-decoder, sd15, sd15-controlnet"),
    (["plan", "--model", "sd15", "--size", "500x512"], "width 500 is not a positive multiple of 8"),
    (["plan", "--model", "sd15", "--size", "0x512"], "width 0 is not a positive multiple of 8"),
    (["plan", "--model", "sd15", "--size", "512by512"], "malformed size '512by512'"),
    (["plan", "--model", "sd15", "--batch", "0"], "batch '0' is below 1"),
    (["plan", "--model", "sd15", "--batch", "two"], "batch 'two' is not a whole number"),
    (["plan", "--model", "sd15", "--dtype", "float64"], "unknown dtype 'float64'"),
    (["plan", "--model", "/no/such/folder"], "no such folder '/no/such/folder'"),
    (["plan", "--model", "./missing.yaml"], "does not exist"),
    (["plan"], "give --model NAME (one model's forward) or --pipeline NAME"),
    (["plan", "--model", "sd15", "--gpu", "A100", "--results", "/no/such/results"],
     "--results /no/such/results: no such folder"),  # a mistyped --results under --gpu: not ignored
    (["plan", "--model", "sd15", "--device", "cpu", "--host-us-per-op", "20"],
     "--host-us-per-op prices a GPU's host: give it with --gpu NAME"),  # ignored before, without --gpu
    (["plan", "--pipeline", "sd15", "--gpu", "A100", "--host-us-per-op", "0"], "--host-us-per-op 0.0: give "
                                                                              "microseconds above 0, or `here`"),
    (["plan", "--model", "sd15", "--gpu", "A100", "--host-us-per-op", "fast"], "'fast' is not a number of "
                                                                              "microseconds or `here`"),
])
def test_bad_input_one_line_exit_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("argv", [["runs"], ["show", "latest"], ["diff", "a", "b"], ["report", "latest"],
                                  ["replay", "latest", "--device", "cpu"], ["dashboard"], ["serve"],
                                  ["plan", "--model", "sd15", "--gpu", "A100"]],
                         ids=["runs", "show", "diff", "report", "replay", "dashboard", "serve", "plan"])
def test_a_results_path_that_is_a_file_is_said_so_in_one_line_exit_2(capsys, tmp_path, monkeypatch, argv):
    """`attnprof runs --results FILE` said 'no runs under FILE' (exit 0), show, diff, report and replay 'no runs
    under FILE: make one', the dashboard and serve started over it, plan 'no such folder': each command that reads
    a results folder says in one line that the path is a file, not a results folder, and exits 2."""
    from profiler.service import serve

    for name in ("dashboard", "serve"):  # never started: not a server, not this process replaced
        monkeypatch.setattr(serve, name, lambda *a, **k: pytest.fail("started over a file"))
    results = tmp_path / "results.txt"
    results.write_text("")
    code, out, err = run(capsys, *argv, "--results", str(results))
    assert (code, out) == (2, "")
    assert err == (f"attnprof: error: --results {results} is a file, not a results folder: give the folder the runs "
                   "were written to (their --out; default results)\n")


def test_config_that_is_not_a_unet(capsys, tmp_path):
    (tmp_path / "config.json").write_text('{"_class_name": "FluxTransformer2DModel", "num_layers": 19}')
    code, _, err = run(capsys, "plan", "--model", str(tmp_path))
    assert code == 2 and "does not describe a model attnprof builds (its class is FluxTransformer2DModel)" in err


def test_console_entry_point_exits_2_without_traceback():
    p = subprocess.run([sys.executable, "-m", "profiler", "plan", "--model", "sd15", "--size", "12x12"],
                       capture_output=True, text=True)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == ["attnprof: error: size '12x12': width 12 is not a positive multiple "
                                             "of 8 (the latent is 1/8 of the image)"]


def test_a_size_no_gpu_can_hold_is_said_in_words(capsys):
    """plan --size 100000x100000: the FLOPs written as a number with its exponent, and a line saying the score table
    alone needs more than the largest GPU of the table has."""
    assert main(["plan", "--model", "sd15", "--size", "100000x100000"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "beyond every GPU" in out and "no GPU of the table holds it (the largest, the H200, has 141 GiB)" in out
    assert "e+" in out.split("attention FLOPs")[1].splitlines()[0]


def test_plan_says_whether_the_forward_fits_a_budget(capsys):
    code, out, _ = run(capsys, "plan", "--model", "sdxl-base", "--size", "4096x4096", "--backend", "naive",
                       "--memory-budget", "24GiB", "--json")
    t = json.loads(out)[0]["totals"]
    assert code == 0 and not t["fits"] and t["predicted_forward_peak_bytes"] > t["weights_bytes"] + 2 * t[
        "largest_score_bytes"]
    assert t["predicted_forward_peak_bytes"] == t["weights_bytes"] + t["inputs_bytes"] + t[
        "forward_transient_peak_bytes"]
    assert t["weights_bytes"] == 2 * t["params_total"] and "CUDA context" in t["not_counted"]
    code, out, _ = run(capsys, "plan", "--model", "sdxl-base", "--size", "1536x1536", "--backend", "sdpa-flash",
                       "--memory-budget", "24GiB")
    assert code == 0 and "fits the budget:           yes: the forward peak" in out and "of 24.0 GiB" in out
    assert "forward peak on cuda:" in out and "aten's flash attention kernel" in out
    code, out, _ = run(capsys, "plan", "--model", "sd15", "--memory-budget", "1GiB")  # sdpa, the default
    assert code == 0 and "fits the budget:           NO: the forward peak" in out
    code, _, err = run(capsys, "plan", "--model", "sd15", "--backend", "sdpa-efficient", "--device", "cpu")
    assert code == 2 and "backend 'sdpa-efficient' does not run on cpu" in err


def test_an_unwritable_results_folder_is_one_line_and_exit_2(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    code, out, err = run(capsys, "run", "--model", "tiny-sd15", "--size", "64x64", "--device", "cpu", "--dtype",
                         "float32", "--out", str(blocker / "results"), "--quiet")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert f"cannot write the results folder {blocker / 'results'}" in err and "--out" in err
    assert blocker.read_text() == "not a folder"


@pytest.mark.parametrize("argv", [
    ["-m", "profiler", "run", "--model", "tiny-sd15", "--size", "64x64", "--device", "cpu", "--dtype", "float32",
     "--repeats", "1", "--warmup", "0", "--in-process", "--quiet"],
    ["-m", "profiler", "run", "--model", "tiny-sd15", "--size", "64x64", "--device", "cpu", "--dtype", "float32",
     "--repeats", "1", "--warmup", "0", "--quiet"],
    ["-m", "profiler.bench", "--rounds", "1", "--size", "64", "--only", "recorder"],
], ids=["run-in-process", "run-workers", "bench"])
def test_no_profiler_chatter_reaches_the_terminal(tmp_path, argv):
    """Kineto prints USDT: lines from C++ on fd 2 when the profiler starts and stops."""
    p = subprocess.run([sys.executable, *argv, *(["--out", str(tmp_path / "results")])], capture_output=True,
                       text=True, cwd=REPO)
    assert p.returncode == 0, p.stderr
    assert "USDT" not in p.stdout + p.stderr
    assert "sdpa     ok" in p.stdout or "ratio" in p.stdout  # it ran and printed its result


@pytest.mark.parametrize("argv", [["show", "latest"], ["runs"], ["diff", "latest", "latest"], ["models"],
                                  ["plan", "--model", "tiny-sd15", "--size", "64x64"]],
                         ids=["show", "runs", "diff", "models", "plan"])
def test_every_command_survives_a_closed_pipe(dashboard_results, argv):
    """The reader closes the pipe before the command writes (as `| head` does once it has its lines): no traceback,
    no 'Exception ignored' at exit, the closed pipe's exit code."""
    results = ["--results", str(dashboard_results)] if argv[0] in ("show", "runs", "diff") else []
    p = subprocess.Popen([sys.executable, "-m", "profiler", *argv, *results], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    p.stdout.close()  # long before the command has imported torch and written anything
    err = p.stderr.read()
    assert p.wait(timeout=120) == 141 and err == "", err


@pytest.mark.parametrize("argv", [["show", "latest"], ["runs"], ["diff", "latest", "latest"],
                                  ["report", "latest", "--html", "{tmp}/r.html"],
                                  ["jobs", "--address", "http://127.0.0.1:9"]],
                         ids=["show", "runs", "diff", "report", "jobs"])
def test_the_commands_that_read_runs_start_without_torch(dashboard_results, tmp_path, argv):
    """The commands that read stored runs (or ask a job server) import neither torch nor diffusers: a second and more
    of each command's start on this machine's CPU. The registry they read makes no processor (attention/backends.py)."""
    results = [] if argv[0] == "jobs" else ["--results", str(dashboard_results)]
    argv = [a.format(tmp=tmp_path) for a in argv]
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "profiler", *argv, *results], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode in ((2,) if argv[0] == "jobs" else (0, 3) if argv[0] == "diff" else (0,)), p.stderr[-2000:]
    imported = {ln.rsplit("|", 1)[1].strip() for ln in p.stderr.splitlines() if ln.startswith("import time:")}
    assert "pandas" in imported or argv[0] == "jobs"  # the import log is read whole
    assert not {"torch", "diffusers"} & imported


def test_show_latest_piped_to_head(dashboard_results):
    p = subprocess.run(f"{sys.executable} -m profiler show latest --results {dashboard_results} | head -1; "
                       "echo ${PIPESTATUS[0]} >&2", shell=True, executable="/bin/bash", capture_output=True,
                       text=True, cwd=REPO, timeout=120)
    assert p.stdout.startswith("findings (") and p.stdout.count("\n") == 1  # findings first
    assert "Traceback" not in p.stderr and p.stderr.strip() in ("0", "141"), p.stderr  # 0 when it all fit the pipe


def test_plan_names_the_backend_with_its_options(capsys):
    argv = ["plan", "--model", "tiny-sd15", "--size", "64x64", "--backend", "sliced", "--option", "slice_size=4",
            "--device", "cpu"]
    code, out, _ = run(capsys, *argv)
    assert code == 0 and "peak (sliced(slice_size=4))" in out.splitlines()[1]
    assert "\nlargest call, sliced(slice_size=4): " in out and "\nparams_total:                       3.22M" in out
    assert " traced over what is held" in out  # sliced runs on fake tensors; flex only in its memory model:
    assert " modelled over what is held" in run(capsys, "plan", "--model", "tiny-sd15", "--size", "64x64", "--backend",
                                               "flex", "--device", "cpu")[1]
    code, out, _ = run(capsys, *argv, "--json")
    p = json.loads(out)[0]
    assert (p["backend_options"], p["backend_label"]) == ({"slice_size": 4}, "sliced(slice_size=4)")


NOTE = "float16 on the CPU is emulated"


@pytest.mark.parametrize("argv, dtype, noted", [
    (("--device", "cpu"), "float32", False),  # the CPU's default: it has no fast float16 path
    (("--device", "cpu", "--dtype", "float16"), "float16", True),  # asked for: said once
    ((), "float16", False),  # a GPU plan (the default --device cuda) stays float16
])
def test_plan_defaults_to_float32_on_the_cpu_and_says_float16_is_emulated_there(capsys, argv, dtype, noted):
    code, out, err = run(capsys, "plan", "--model", "tiny-sd15", "--size", "64x64", "--json", *argv)
    assert code == 0 and json.loads(out)[0]["dtype"] == dtype
    assert err.count(NOTE) == (1 if noted else 0), err


@pytest.mark.parametrize("argv, dtype, noted", [((), "float32", False), (("--dtype", "float16"), "float16", True)])
def test_run_on_the_cpu_defaults_to_float32_and_says_once_that_float16_is_emulated(capsys, tmp_path, argv, dtype,
                                                                                 noted):
    from profiler.store import Run, list_runs

    code, _, err = run(capsys, "run", "--model", "tiny-sd15", "--size", "64x64", "--backend", "sdpa", "--device",
                       "cpu", "--repeats", "1", "--warmup", "0", "--in-process", "--quiet", "--out", str(tmp_path),
                       *argv)
    assert code == 0, err
    assert err.count(NOTE) == (1 if noted else 0), err
    assert Run.open(list_runs(tmp_path)[-1]).cells()["dtype"].tolist() == [dtype]


def test_a_sweep_without_dtypes_runs_the_devices_default():
    from profiler.execute.grid import loads

    sweep = loads("models: [tiny-sd15]\nsizes: [64x64]\n", "s.yaml")
    assert {c.dtype for c in sweep.cells("cpu")} == {"float32"}
    assert {c.dtype for c in sweep.cells("cuda:0")} == {"float16"}


@pytest.mark.parametrize("command, says", [
    ("profile", "configs/sweeps/cpu-default.yaml"),  # a description, not only the usage line
    ("sweep", "docs/sweeps-and-service.md"),  # where the keys are
])
def test_help_describes_the_command_and_points_to_its_docs(capsys, command, says):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and says in " ".join(out.split())
    assert (REPO / "docs" / "sweeps-and-service.md").is_file()


def test_show_names_the_error_reference_and_marks_the_cell_that_is_it(capsys, dashboard_results):
    """sdpa in float32 is the reference: its error is 0 by construction, said as such, not as 0.0e+00; the legend
    (--legend) names the reference."""
    code, out, _ = run(capsys, "show", "latest", "--results", str(dashboard_results), "--legend")
    assert code == 0
    sdpa = [ln for ln in out.splitlines() if " sdpa " in ln and " ok " in ln]
    assert sdpa and all("0 (= ref)" in ln for ln in sdpa)
    naive = [ln for ln in out.splitlines() if " naive " in ln and " ok " in ln]
    assert naive and all("e-" in ln and "(= ref)" not in ln for ln in naive)  # naive: a real, small error
    assert "against the reference output (sdpa/float32: the same weights and inputs)" in " ".join(out.split())
    assert "materialised" in out and "reference," not in out


def test_backends_says_before_a_probe_that_compiles(capsys, monkeypatch):
    """flex's probe compiles a kernel (a minute on a fresh machine): a line says so before the wait, and only there.
    The probes themselves are stubbed: what is tested is what the user sees while they run."""
    from profiler.attention import backends

    monkeypatch.setattr(backends, "availability", lambda name, *a, **k: (True, ""))
    code, out, err = run(capsys, "backends", "--device", "cpu")
    assert code == 0 and "on cpu in float32" in out
    compiling = [ln.split(":")[0].strip(" (") for ln in err.splitlines() if "its probe compiles a kernel" in ln]
    assert compiling == [n for n in backends.names() if backends.compiles(n)] == ["flex"]


def test_fit_shows_one_row_per_distinct_kernel_unless_all(capsys):
    """fit over backends of ours and diffusers' dispatcher backends (a few of the 41: each is traced at every size
    screened): those that run one of ours and fit the same are named under that one's row, not a row each; --all
    gives a row each."""
    names = ["naive", "sdpa", "sdpa-math", "diffusers:native", "diffusers:_native_math"]
    args = ["fit", "--model", "tiny-sd15", "--budget", "1GiB", "--quiet", *(x for n in names for x in ("--backend", n))]
    assert main(args) == 0
    out = capsys.readouterr().out
    table = out.split("\n\n")[0].splitlines()[3:]  # the rows, after the heading and the table's head
    assert len(table) == 3 and any(line.startswith("sdpa (+1)") for line in table), out
    assert "diffusers dispatcher backends that run one of these kernels" in out and "also diffusers:native" in out
    assert main([*args, "--all"]) == 0
    every = capsys.readouterr().out.split("\n\n")[0].splitlines()[3:]
    assert len(every) == len(names) and not any("(+" in line for line in every)
