PY := .venv/bin/python
STAMP := .venv/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: setup profile plan test test-slow lint
setup: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	rm -f .venv/.installed-*; touch $@

## make profile: until measured sweeps land, the planner over the default models and sizes
profile: setup
	@echo "Planner (no weights, no GPU) over sd15, sd21-base and sdxl-base; measured runs: attnprof run"
	$(PY) -m profiler plan --model sd15 --size 512x512 --size 768x768
	$(PY) -m profiler plan --model sd21-base --size 512x512
	$(PY) -m profiler plan --model sdxl-base --size 1024x1024 --size 832x1216

plan: setup
	$(PY) -m profiler plan --model $(or $(MODEL),sd15) --size $(or $(SIZE),512x512)

test: setup
	$(PY) -m pytest -q

test-slow: setup
	$(PY) -m pytest -q -m slow

lint: setup
	$(PY) -m compileall -q profiler dashboards tests
