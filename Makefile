# Everything runs from a project-local virtual environment; `make up` and `make test` create it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
BUF_VERSION := 1.75.0
BUF := .cache/buf/node_modules/.bin/buf
REPOSITORY ?= models/demo

.PHONY: up test lint gen bench bench-generate bench-batching bench-swaps bench-soak demo-models proto-baseline install install-dev system-deps clean

up: $(VENV)/.installed
	$(PY) -m service --repository $(REPOSITORY)

test: lint
	$(PY) -m pytest -q

lint: $(VENV)/.installed-dev $(BUF) system-deps
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy service tests bench models/__init__.py models/demo_models.py proto/generate.py proto/python/modelyard
	$(VENV)/bin/lint-imports
	$(PY) proto/generate.py --check
	$(BUF) lint
	$(BUF) breaking --against proto/baseline.binpb

gen: $(VENV)/.installed-dev
	$(PY) proto/generate.py

# Deliberately accept the current contracts as the baseline that `buf breaking` guards.
proto-baseline: $(BUF)
	$(BUF) build --exclude-source-info -o proto/baseline.binpb

bench: $(VENV)/.installed-dev
	$(PY) -m bench.unary_latency

bench-generate: $(VENV)/.installed-dev
	$(PY) -m bench.generate

bench-swaps: $(VENV)/.installed-dev
	$(PY) -m bench.swaps

bench-soak: $(VENV)/.installed-dev
	$(PY) -m bench.soak

bench-batching: $(VENV)/.installed-dev
	$(PY) -m bench.batching

demo-models: $(VENV)/.installed
	$(PY) -m models.demo_models $(REPOSITORY)

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e '.[service]'
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@ $(VENV)/.installed

# Debian packages the tests need: libb64 for Triton's perf_analyzer.
system-deps:
	@dpkg -s libb64-0d >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq libb64-0d >/dev/null; }

$(BUF):
	npm install --silent --no-save --no-audit --no-fund --prefix .cache/buf @bufbuild/buf@$(BUF_VERSION)

clean:
	rm -rf $(VENV) .cache .mypy_cache .ruff_cache build *.egg-info
