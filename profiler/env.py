"""Where the profiler lives and what it runs on: the repository root (REPO), the model and sweep configs (configs():
a wheel's installed copy, else the repository's configs/), the dashboard's app.py (found without importing the
dashboards package: the core never imports its view), and the environment every run's manifest carries."""
from __future__ import annotations

import importlib.util
import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent  # the source tree (a wheel's site-packages when installed)


def _package_dir(name: str) -> Path | None:
    """The folder of an importable package, found without importing it (None where there is none)."""
    try:
        spec = importlib.util.find_spec(name)
    except ModuleNotFoundError:  # its parent package is not importable
        return None
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) if locations else None


def configs() -> Path:
    """The folder of models/*.yaml and sweeps/*.yaml: the package data a wheel installs (profiler._configs, which an
    editable install maps onto the repository's configs/), else the repository's configs/ (a source tree, or the
    copy Ray's working_dir ships to a worker)."""
    return _package_dir("profiler._configs") or REPO / "configs"


def cache_dir() -> Path:
    """attnprof's cache folder (the device limits, the time model's calibration, the report's Vega bundle):
    $ATTNPROF_CACHE, else $XDG_CACHE_HOME/attnprof, else ~/.cache/attnprof."""
    return Path(os.environ.get("ATTNPROF_CACHE") or
                Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "attnprof")


def dashboard_app() -> Path:
    """dashboards/app.py, the file `streamlit run` serves: the installed dashboards package's, else the
    repository's."""
    return (_package_dir("dashboards") or REPO / "dashboards") / "app.py"


def environment(device: str) -> dict:
    """Library versions, hardware and the profiler's git revision: a number without these is not comparable.
    The device is described from torch's properties and NVML, which make no CUDA context here."""
    import diffusers
    import torch

    from . import devices

    env = {"python": platform.python_version(), "torch": torch.__version__, "diffusers": diffusers.__version__,
           "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(), "platform": platform.platform(), "cpu": devices.cpu_name(),
           "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "device": device,
           "device_name": None, "driver": None}
    if device.startswith("cuda") and torch.cuda.is_available():
        described = devices.describe_cuda(torch.device(device).index or 0)
        env.update({k: described[k] for k in ("device_name", "device_arch", "device_uuid", "pci_bus_id", "driver")})
    else:
        env["device_name"] = env["cpu"]
    env["git_revision"] = _git_revision()
    return env


def _git_revision() -> str | None:
    """The profiler's commit (with +dirty where tracked files changed): git's, else $ATTNPROF_COMMIT (a tree copied
    without its .git, as to a borrowed GPU machine: the command that copies it names the commit), else None."""
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        rev = None
    if rev is None or rev.returncode:
        return os.environ.get("ATTNPROF_COMMIT") or None
    return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
