# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
export DAGSTER_HOME ?= $(CURDIR)/dagster_home
export RAY_AUTH_MODE ?= disabled
export RAY_USAGE_STATS_ENABLED ?= 0
export MLFLOW_ENABLE_TELEMETRY ?= false

.PHONY: demo test ui mlflow-ui install clean-data

# The stamp is refreshed when pyproject.toml changes, so a new dependency is installed.
$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[cpu,dev]'
	touch $@

install: $(BIN)/.installed

demo: $(BIN)/.installed
	mkdir -p $(DAGSTER_HOME)
	test -f $(DAGSTER_HOME)/dagster.yaml || cp dagster_home/dagster.yaml $(DAGSTER_HOME)/
	$(BIN)/video-assets demo

test: $(BIN)/.installed
	$(BIN)/pytest $(PYTEST_ARGS)

ui: $(BIN)/.installed
	$(BIN)/dagster dev -w workspace.yaml -h 127.0.0.1 -p 3000

# The MLflow UI on the embedded SQLite store (the evaluation metadata links to it).
mlflow-ui: $(BIN)/.installed
	$(BIN)/mlflow ui --backend-store-uri "$${MLFLOW_TRACKING_URI:-sqlite:///$(DAGSTER_HOME)/mlflow.db}" -h 127.0.0.1 -p 5000

clean-data:
	find dagster_home -mindepth 1 ! -name dagster.yaml -exec rm -rf {} +
