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

.PHONY: install demo train status test bench ui clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

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

test: install
	$(BIN)/python -m pytest -q

bench: install
	$(BIN)/python bench/driver_overhead.py

ui: install $(DAGSTER_HOME)/dagster.yaml
	@port=$${PORT:-$$($(BIN)/python -c 'import socket; print(next(p for p in range(3000, 3100) if socket.socket().connect_ex(("127.0.0.1", p))))')}; \
	echo "Dagster UI: http://127.0.0.1:$$port (DAGSTER_HOME=$(DAGSTER_HOME); PORT=<n> make ui to choose the port)"; \
	$(BIN)/dagster dev -w workspace.yaml -h 127.0.0.1 -p $$port

clean:
	rm -rf $(VENV) .dagster_home
