# Everything runs from a virtual environment in the repo; DAGSTER_HOME defaults to .dagster_home/.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
export DAGSTER_HOME ?= $(CURDIR)/.dagster_home
DEMO_RANGE ?= 0000...0007

.PHONY: install demo test bench ui clean

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
	$(BIN)/dagster instance migrate

demo: install $(DAGSTER_HOME)/dagster.yaml
	$(BIN)/dagster asset materialize -m assets.definitions --select 'group:demo' --partition-range $(DEMO_RANGE)
	$(BIN)/dagster-rl status demo

test: install
	$(BIN)/python -m pytest -q

bench: install
	$(BIN)/python bench/driver_overhead.py

ui: install $(DAGSTER_HOME)/dagster.yaml
	$(BIN)/dagster dev -w workspace.yaml -h 127.0.0.1 -p 3000

clean:
	rm -rf $(VENV) .dagster_home
