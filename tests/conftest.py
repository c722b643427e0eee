"""The tests' environment and shared fixtures: experiments written to temp dirs, a real SQLite Dagster
instance per test, the tiny model on disk, a `dagster-rl serve` of it. `pytest_plugins` adds the fixtures that live with their
helpers: `postgres_server`, `dagster_servers`, `smollm2_dir`, `vllm`, and the `readonly://` protocol.
Helpers are imported from their modules (tests/__init__.py lists them), never from this file."""

import os
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("DAGSTER_RL_MODEL_CACHE", str(Path(tempfile.gettempdir()) / "dagster-rl-test-models"))
os.environ.setdefault("DAGSTER_RL_DATA_CACHE", str(Path(tempfile.gettempdir()) / "dagster-rl-test-data"))
# the code location refuses to load without DAGSTER_HOME (`make test` sets it); each test opens its own instance
if not os.environ.get("DAGSTER_HOME"):
    os.environ["DAGSTER_HOME"] = tempfile.mkdtemp(prefix="dagster-rl-test-home-")

# light to import: what they need of torch, Dagster or vLLM they import when a fixture runs
pytest_plugins = ["tests.postgres", "tests.servers", "tests.smollm2", "tests.vllm_server", "tests.readonly_fs"]


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """The tiny causal LM of the language-model tests, saved once per session."""
    from dagster_rl.tasks.lm.model.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module")
def tiny_serve(tmp_path_factory):
    """One `dagster-rl serve` of builtin:tiny-qwen2 kept up for a module's tests, loading adapters from
    the tests' temporary folders."""
    from tests.serve_process import ServeProcess

    with ServeProcess(tmp_path_factory.mktemp("serve"), adapter_roots=[str(tmp_path_factory.getbasetemp())]) as s:
        yield s


@pytest.fixture
def lab(tmp_path):
    """lab(name, *experiment_settings, files={name: text}, **resources): a fresh Dagster home, store and
    experiments; `files` are written beside the experiment files first (a user's reward functions)."""
    from tests.harness import new_dagster_home, open_lab
    from tests.settings import write_experiments

    labs = []

    def make(name: str, *raws: dict, files: dict[str, str] | None = None, **resources):
        home = new_dagster_home(tmp_path / name)
        (home / "experiments").mkdir()
        for file, text in (files or {}).items():
            (home / "experiments" / file).write_text(text)
        made = open_lab(home, write_experiments(home / "experiments", *raws), **resources)
        labs.append(made)
        return made

    yield make
    for made in labs:
        made.close()


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    """The reference: steps 0000..0007 of the demo settings in one clean run."""
    from dagster_rl.base import counters
    from tests.harness import new_dagster_home, open_lab
    from tests.settings import demo_settings, write_experiments

    home = new_dagster_home(tmp_path_factory.mktemp("ref") / "home")
    lab = open_lab(home, write_experiments(home / "experiments", demo_settings()))
    before = counters.snapshot()
    result = lab.run("demo", "0000", "0007")
    lab.counted = {k: v - before.get(k, 0) for k, v in counters.snapshot().items()}
    lab.result = result
    yield lab
    lab.close()


@pytest.fixture(scope="session")
def session_run(tmp_path_factory):
    """The reference of the trainer-session tests: steps 0000..0002 of `session_settings()` in one
    uninterrupted run, its trainer one session of 2 torchrun ranks."""
    from dagster_rl.base import counters
    from tests.harness import new_dagster_home, open_lab
    from tests.settings import SESSION_STEPS, session_settings, write_experiments

    home = new_dagster_home(tmp_path_factory.mktemp("session_ref") / "home")
    lab = open_lab(home, write_experiments(home / "experiments", session_settings()))
    before = counters.snapshot()
    lab.result = lab.run("tiny_grpo", SESSION_STEPS[0], SESSION_STEPS[-1])
    lab.counted = {k: v - before.get(k, 0) for k, v in counters.snapshot().items()}
    yield lab
    lab.close()
