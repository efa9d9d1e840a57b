PY := .venv/bin/python
STAMP := .venv/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: setup bytecode profile plan test test-fast test-slow lint bench gpu-check dashboard
setup: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	rm -f .venv/.installed-*; touch $@

## make profile: the built-in default sweep (configs/sweeps/default.yaml on a GPU, cpu-default.yaml without one)
profile: setup
	$(PY) -m profiler profile

## make dashboard: serve the dashboard over ./results on http://127.0.0.1:8501
dashboard: setup
	$(PY) -m profiler dashboard

plan: setup
	$(PY) -m profiler plan --model $(or $(MODEL),sd15) --size $(or $(SIZE),512x512)

## bytecode for the suites: where PYTHONDONTWRITEBYTECODE is set, as here, each of the suite's ~250 subprocesses would
## compile profiler/ again, 0.15-0.3 s of CPU each
bytecode: setup
	$(PY) -m compileall -q profiler dashboards

## make test: the whole suite on two xdist workers, each test module whole on one (tests/conftest.py)
test: bytecode
	$(PY) -m pytest -q -n 2

## make test-fast: the inner loop, the suite without its end-to-end and longest modules (tests/conftest.py E2E_MODULES,
## WHOLE_ONLY)
test-fast: bytecode
	$(PY) -m pytest -q -n 2 -m 'not slow and not gpu and not e2e and not whole'

test-slow: setup
	$(PY) -m pytest -q -m slow

lint: setup
	$(PY) -m compileall -q profiler dashboards tests

bench: setup
	$(PY) -m profiler.bench

## make gpu-check [ARGS="--budget-s 320 --out DIR"]: the GPU path proven within a budget, five flat files (docs/gpu.md)
gpu-check: setup
	$(PY) -m profiler.gpu_check $(ARGS)
