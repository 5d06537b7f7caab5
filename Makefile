# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
export DAGSTER_HOME ?= $(CURDIR)/dagster_home
export RAY_AUTH_MODE ?= disabled
export RAY_USAGE_STATS_ENABLED ?= 0
export MLFLOW_ENABLE_TELEMETRY ?= false

# Tool versions: pip in .venv, and pip-tools in the throwaway venv that `make lock` resolves with.
PIP_VERSION ?= 26.3
PIP_TOOLS_VERSION ?= 7.6.2
LOCK_VENV ?= $(or $(TMPDIR),/tmp)/video-assets-lock-venv
LOCK_FLAGS := --extra cpu --extra dev --all-build-deps --strip-extras --allow-unsafe --no-emit-index-url --no-emit-find-links

.PHONY: demo test lint ui mlflow-ui install install-gpu lock clean-data gpu-check

# A fresh install is the same install: every package comes pinned from requirements.lock (base deps +
# the cpu and dev extras, CPython 3.11, Linux x86_64); then the project itself, editable, with no index,
# so a lock that no longer satisfies pyproject.toml fails here (run `make lock`). The stamp is refreshed
# when pyproject.toml or the lock changes.
$(BIN)/.installed: pyproject.toml requirements.lock
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet 'pip==$(PIP_VERSION)'
	$(BIN)/pip install --quiet -r requirements.lock
	$(BIN)/pip install --quiet --no-index --no-build-isolation -e '.[cpu,dev]' \
	  || { echo 'requirements.lock does not satisfy pyproject.toml: run `make lock`' >&2; exit 1; }
	$(BIN)/pip check
	touch $@

# Re-resolve requirements.lock from pyproject.toml with pip-compile (pip-tools), keeping the current pins
# where they still fit; `make lock LOCK_ARGS=--upgrade` moves every pin to the newest allowed release.
# pip, not uv: pip reads this machine's pip config (local torch wheels, torch/torchvision caps).
lock:
	test -x $(LOCK_VENV)/bin/pip-compile || { $(PYTHON) -m venv $(LOCK_VENV) \
	  && $(LOCK_VENV)/bin/pip install --quiet 'pip==$(PIP_VERSION)' 'pip-tools==$(PIP_TOOLS_VERSION)'; }
	test ! -f requirements.lock || grep -v '^##' requirements.lock > requirements.lock.tmp
	CUSTOM_COMPILE_COMMAND='make lock' $(LOCK_VENV)/bin/pip-compile --quiet $(LOCK_FLAGS) $(LOCK_ARGS) \
	  --output-file requirements.lock.tmp pyproject.toml
	{ echo '## Lock for video-assets: base deps + the [cpu] and [dev] extras + build deps, CPython 3.11, Linux x86_64.'; \
	  echo '## Made by `make lock`, i.e. pip-tools $(PIP_TOOLS_VERSION) (pip $(PIP_VERSION)):'; \
	  echo '##   pip-compile $(LOCK_FLAGS) pyproject.toml'; \
	  echo '## Do not edit by hand.'; \
	  echo '## `make install` installs exactly this, then the project with no index.'; \
	  cat requirements.lock.tmp; } > requirements.lock
	rm -f requirements.lock.tmp

install: $(BIN)/.installed

# GPU machines: a separate environment (.venv-gpu) with vLLM at Ray's pin and the torch build vLLM
# needs. It cannot share .venv, whose CPU torch is pinned by requirements.lock. Not used by make test.
GPU_VENV ?= .venv-gpu
install-gpu:
	test -x $(GPU_VENV)/bin/python || $(PYTHON) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/pip install --quiet 'pip==$(PIP_VERSION)'
	$(GPU_VENV)/bin/pip install --quiet -e '.[gpu,dev]'
	$(GPU_VENV)/bin/pip check

demo: $(BIN)/.installed
	mkdir -p $(DAGSTER_HOME)
	test -f $(DAGSTER_HOME)/dagster.yaml || cp dagster_home/dagster.yaml $(DAGSTER_HOME)/
	$(BIN)/video-assets demo

# Lint + format check (configured in pyproject.toml); `make test` runs it first.
lint: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/pytest $(PYTEST_ARGS)

ui: $(BIN)/.installed
	$(BIN)/dagster dev -w workspace.yaml -h 127.0.0.1 -p 3000

# The MLflow UI on the embedded SQLite store (the evaluation metadata links to it).
mlflow-ui: $(BIN)/.installed
	$(BIN)/mlflow ui --backend-store-uri "$${MLFLOW_TRACKING_URI:-sqlite:///$(DAGSTER_HOME)/mlflow.db}" -h 127.0.0.1 -p 5000

clean-data:
	find dagster_home -mindepth 1 ! -name dagster.yaml -exec rm -rf {} +

# GPU check on a machine with only torch + transformers (no venv, no network): the transformers engine
# on a full-size random-weight Qwen2.5-VL. `make gpu-check GPU_CHECK_ARGS="--shape 7b --json out.json"`;
# `--smoke` is a CPU plumbing run. See docs/benchmarks.md.
GPU_CHECK_PYTHON ?= python
gpu-check:
	$(GPU_CHECK_PYTHON) scripts/gpu_check.py $(GPU_CHECK_ARGS)
