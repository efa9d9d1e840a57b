"""The service's rules that need no Ray head (the service itself end to end: tests/test_service_e2e.py)."""
import pytest

from profiler.service import jobs
from profiler.spec import InputError

CONFIG = "models: [tiny-sd15]\nsizes: [64x64]\ndevice: cpu\n"


def test_a_run_lands_in_results_else_the_configs_out_else_the_pages_folder_else_serves(tmp_path, monkeypatch):
    """Where a queued sweep's run lands (jobs.results_folder, decided at submit and given to the job as --out):
    --results; else the config's out:, relative to where submit runs; else the Queue page's folder; else the folder
    of the attnprof serve on this machine for that job server; else one line asking for one. (The end-to-end test
    queues jobs that land by --results, by out: and by serve's folder.)"""
    monkeypatch.setattr(jobs, "SERVED", tmp_path / "serve.json")
    monkeypatch.chdir(tmp_path)
    url, out = "http://127.0.0.1:1", CONFIG + "out: elsewhere\n"
    jobs.remember_served(url, tmp_path / "served", True)
    assert jobs.results_folder(out, url, tmp_path / "given", tmp_path / "page") == tmp_path / "given"
    assert jobs.results_folder(out, url, None, tmp_path / "page") == tmp_path / "elsewhere"
    assert jobs.results_folder(CONFIG, url, None, tmp_path / "page") == tmp_path / "page"
    assert jobs.results_folder(CONFIG, url) == tmp_path / "served"
    with pytest.raises(InputError, match="no attnprof serve on this machine serves http://127.0.0.1:2: give --results"):
        jobs.results_folder(CONFIG, "http://127.0.0.1:2")
