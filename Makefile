# Everything runs from a project-local virtual environment; `make up` and `make test` create it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
BUF_VERSION := 1.75.0
BUF := .cache/buf/node_modules/.bin/buf
REPOSITORY ?= models/demo

.PHONY: web web-deps web-check browser-deps bench-edge bench-peers peers-venvs up test installs lint gen bench bench-generate bench-batching bench-swaps bench-soak bench-sidecar bench-floor bench-workers demo-models proto-baseline install install-dev system-deps clean

# service (50052), sidecar (50051), gateway (8000) and Envoy (8080) until Ctrl-C.
up: $(VENV)/.installed-stack
	$(PY) -m modelyard.deploy --repository $(REPOSITORY) $(if $(SIDECAR_CONFIG),--sidecar-config $(SIDECAR_CONFIG))

test: lint browser-deps installs
	$(PY) -m pytest -q

# The install step of `make test`: fresh virtual environments with the built wheel and the
# `service-cpu` and `service-cuda` extras from the package registry (.cache/installs/EXTRA; made
# anew when an extra's dependencies change; ~25 s and ~80 s on a clean machine, 0.3 and 2.6 GB), where
# tests/deploy/integration/test_installs.py starts the service as users install it.
installs: $(VENV)/.installed-dev
	$(PY) -m tests.installs

# This tree's package laid out as it installs, in a folder of links outside the repository
# (bench/lib/trees.py): mypy and import-linter read it there, since neither follows an editable
# install's import hook (mypy names a file by its place there: .../modelyard/service/x.py), and
# lint's commands run this tree's code with it, whichever tree the virtual environment installed.
PACKAGE_LINKS = $(shell $(PY) -m bench.lib.trees --pythonpath .)

lint: $(VENV)/.installed-dev $(BUF) system-deps
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy $(PACKAGE_LINKS)/modelyard tests bench models/__init__.py models/demo_models.py models/value_models.py proto/generate.py docs/reference.py
	PYTHONPATH=$(PACKAGE_LINKS) $(VENV)/bin/lint-imports
	$(PY) proto/generate.py --check
	PYTHONPATH=$(PACKAGE_LINKS) $(PY) -m modelyard.envoy.render --check
	$(PY) docs/reference.py --check
	cd deploy/observability && promtool check rules alerts.yaml && promtool test rules alerts_test.yaml
	$(VENV)/bin/envoy --mode validate -c envoy/envoy.yaml --log-level warn
	$(VENV)/bin/envoy --mode validate -c deploy/kubernetes/envoy.yaml --log-level warn
	# Every pod of every Kubernetes build meets Pod Security "restricted" (and the check catches each rule).
	PYTHONPATH=$(PACKAGE_LINKS) $(PY) -m pytest -q --no-header tests/deploy/unit/test_kubernetes_manifests.py -k restricted
	$(MAKE) --no-print-directory web-check
	$(BUF) lint
	$(BUF) breaking --against proto/baseline.binpb

# The browser page's gRPC-Web client: TypeScript from our protos (buf generate + protoc-gen-es),
# type-checked, bundled by esbuild into gateway/static/app.js (committed: the gateway serves it
# without node; web-check fails when the committed files are stale).
WEB := gateway/web
WEB_GEN := cd $(WEB) && ./node_modules/.bin/buf generate --template buf.gen.yaml --path ../../proto/modelyard/inference ../../proto
WEB_BUNDLE := cd $(WEB) && ./node_modules/.bin/tsc -p . && ./node_modules/.bin/esbuild src/app.ts --bundle --format=esm \
	--target=es2020 --minify --legal-comments=none --log-level=warning

web-deps: $(WEB)/node_modules/.installed

$(WEB)/node_modules/.installed: $(WEB)/package.json $(WEB)/package-lock.json
	npm ci --prefix $(WEB) --silent --no-audit --no-fund
	touch $@

web: web-deps
	$(WEB_GEN)
	$(WEB_BUNDLE) --outfile=../static/app.js

web-check: web-deps
	rm -rf .cache/web-check
	$(WEB_GEN) -o ../../.cache/web-check
	diff -r $(WEB)/src/gen .cache/web-check/src/gen
	$(WEB_BUNDLE) --outfile=../../.cache/web-check/app.js
	cmp gateway/static/app.js .cache/web-check/app.js

# Debian's chromium for the browser test (tests/edge/browser/test_browser.py), and playwright-core.
browser-deps: web-deps
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }

bench-edge: $(VENV)/.installed-dev
	$(PY) -m bench.edge

gen: $(VENV)/.installed-dev system-deps
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
	$(PY) -m bench.soak_hostile

bench-batching: $(VENV)/.installed-dev
	$(PY) -m bench.batching

bench-sidecar: $(VENV)/.installed-dev
	$(PY) -m bench.sidecar

bench-floor: $(VENV)/.installed-dev
	$(PY) -m bench.floor

bench-workers: $(VENV)/.installed-dev
	$(PY) -m bench.workers

# The established Python servers that `python -m bench.floor --peers kserve,mlserver` measures the
# service against, each in its own virtual environment (kserve 0.21 and mlserver 1.7 pin clashing
# fastapi/starlette versions, and neither enters our .venv). ONNX Runtime at our .venv's version;
# uvloop below 0.22 for MLServer 1.7.1, whose inference workers fail on uvloop 0.22+'s
# asyncio.get_event_loop(). bench-peers builds them and runs the comparison (a few minutes).
PEERS_VENV := .cache/peers-venv
PEER_ORT := onnxruntime==1.31.1 numpy==2.4.6

$(PEERS_VENV)/kserve/.installed: Makefile
	rm -rf $(PEERS_VENV)/kserve
	$(PYTHON) -m venv $(PEERS_VENV)/kserve
	$(PEERS_VENV)/kserve/bin/pip install --quiet kserve==0.21.0 $(PEER_ORT)
	touch $@

$(PEERS_VENV)/mlserver/.installed: Makefile
	rm -rf $(PEERS_VENV)/mlserver
	$(PYTHON) -m venv $(PEERS_VENV)/mlserver
	$(PEERS_VENV)/mlserver/bin/pip install --quiet mlserver==1.7.1 uvloop==0.21.0 $(PEER_ORT)
	touch $@

peers-venvs: $(PEERS_VENV)/kserve/.installed $(PEERS_VENV)/mlserver/.installed

bench-peers: $(VENV)/.installed-dev peers-venvs
	$(PY) -m bench.floor --apis kserve --peers kserve,mlserver --concurrency 1,16,64 --duration 3

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

# What `make up` runs: every process, none of the dev tools.
$(VENV)/.installed-stack: pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e '.[service,sidecar,gateway]'
	touch $@ $(VENV)/.installed

$(VENV)/.installed-dev: pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@ $(VENV)/.installed $(VENV)/.installed-stack

# Debian packages the tests need: libb64 for Triton's perf_analyzer; flatc (flatbuffers-compiler,
# 2.0.8 on bookworm) for the FlatBuffers code that proto/generate.py writes and checks.
system-deps:
	@dpkg -s libb64-0d >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq libb64-0d >/dev/null; }
	@dpkg -s flatbuffers-compiler >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq flatbuffers-compiler >/dev/null; }
	@dpkg -s prometheus >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }

$(BUF):
	npm install --silent --no-save --no-audit --no-fund --prefix .cache/buf @bufbuild/buf@$(BUF_VERSION)

clean:
	rm -rf $(VENV) .cache .mypy_cache .ruff_cache build *.egg-info
