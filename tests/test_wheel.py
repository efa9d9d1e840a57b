"""A wheel built from the repository holds every module of profiler/ and dashboards/ and the model and sweep configs
(profiler._configs, mapped onto configs/); installed with --no-deps into a fresh venv that sees .venv's dependencies
but not .venv's editable profiler, `attnprof plan --model sdxl-base` runs from a folder outside the repository on the
installed copy and its configs. About 30 s: most of it pip's isolated build."""
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.index  # pip's isolated build fetches setuptools
ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "profiler", "dashboards", "configs")  # what the build reads


def _run(argv, **kw) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, **kw)
    assert done.returncode == 0, f"{argv}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return done


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """The wheel of a copy of the repository's sources (no build/ left in the repository, nothing stale from an
    earlier build), installed into a fresh venv; then a .pth file gives that venv .venv's site-packages for the
    dependencies. The wheel goes in first, while the venv sees nothing else: pip would otherwise find .venv's
    editable attnprof of the same version and leave the wheel out. Paths a .pth file adds are not site dirs, so
    .venv's own .pth files (the editable install's finder among them) never run in the new venv."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", ".", "-w", str(tmp / "W")], cwd=src)
    wheel = next((tmp / "W").glob("attnprof-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    tree = {str(p.relative_to(ROOT)) for d in ("profiler", "dashboards") for p in (ROOT / d).rglob("*.py")}
    configs = {f"profiler/_configs/{p.relative_to(ROOT / 'configs')}" for p in (ROOT / "configs").rglob("*")
               if p.suffix in (".yaml", ".csv")}
    assert tree <= names, f"not in the wheel (a package missing from pyproject's list?): {sorted(tree - names)}"
    assert configs <= names and configs, sorted(configs - names)
    env = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(env)])
    _run([sys.executable, "-m", "pip", "--python", str(env / "bin" / "python"), "install", "--no-deps", "--no-index",
          "-q", str(wheel)])
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    purelib = Path(_run([str(env / "bin" / "python"), "-c", where], env=_clean_env()).stdout.strip())
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}  # .venv's: this interpreter's
    (purelib / "dot-venv-deps.pth").write_text("".join(f"{p}\n" for p in sorted(deps)))
    return env


def _clean_env() -> dict:
    """This environment less what would let the new venv import the repository's profiler: PYTHONPATH, the user's
    site-packages."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    return {**env, "PYTHONNOUSERSITE": "1"}


def test_the_installed_wheel_is_what_runs_and_finds_its_configs(venv, tmp_path):
    code = "import profiler, torch; from profiler import env; print(profiler.__file__); print(env.configs())"
    found = _run([str(venv / "bin" / "python"), "-c", code], cwd=tmp_path, env=_clean_env()).stdout.split()
    assert all(Path(p).is_relative_to(venv) for p in found), found  # not the repository's (editable) copy
    assert (Path(found[1]) / "models" / "sdxl-base.yaml").is_file()
    assert (Path(found[1]) / "kernels" / "h200-2026-12-04.csv").is_file()  # the GPU kernel times plan --gpu fits on


def test_attnprof_plan_runs_from_a_folder_outside_the_repository(venv, tmp_path):
    done = _run([str(venv / "bin" / "attnprof"), "plan", "--model", "sdxl-base", "--size", "1024x1024"], cwd=tmp_path,
                env=_clean_env())
    out = done.stdout
    assert out.startswith("sdxl-base at 1024x1024 (latent 128x128)"), out[:200]
    assert "calls per forward:         140 (70 self, 70 cross)" in out  # SDXL base's 140 attention calls
    assert "params_total:              2567.46M" in out
    assert "up_blocks.1.attentions.2.transformer_blocks.1.attn1    up       1  self      10    64      4096" in out
