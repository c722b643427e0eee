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

.PHONY: install demo test test-numerics-default check-numerics bench ui clean

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

demo: install $(DAGSTER_HOME)/dagster.yaml
	$(QUIET) $(BIN)/dagster asset materialize -m assets.definitions --select 'group:demo' --partition-range $(DEMO_RANGE) $(DEMO_LOGS)
	$(BIN)/dagster-rl status demo

test: install
	$(BIN)/python -m pytest -q

# The tests marked `numerics` (their asserts depend on how the CPU's kernels round) once more, on
# torch's portable kernels: what another CPU may compute. `.ci/run` runs it after `make test`.
test-numerics-default: install
	ATEN_CPU_CAPABILITY=default $(BIN)/python -m pytest -q -m numerics

# The `numerics` tests under every kernel setting (native, avx2, default), as one table.
check-numerics: install
	$(BIN)/python -m tests.check_numerics

bench: install
	$(BIN)/python bench/driver_overhead.py

ui: install $(DAGSTER_HOME)/dagster.yaml
	$(BIN)/dagster dev -w workspace.yaml -h 127.0.0.1 -p 3000

clean:
	rm -rf $(VENV) .dagster_home
