"""Shared fixtures: experiments written to temp dirs, a real SQLite Dagster instance per test."""

import os
import tempfile
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DAGSTER_RL_MODEL_CACHE", str(Path(tempfile.gettempdir()) / "dagster-rl-test-models"))
os.environ.setdefault("DAGSTER_RL_DATA_CACHE", str(Path(tempfile.gettempdir()) / "dagster-rl-test-data"))
# the code location refuses to load without DAGSTER_HOME (`make test` sets it); each test opens its own instance
if not os.environ.get("DAGSTER_HOME"):
    os.environ["DAGSTER_HOME"] = tempfile.mkdtemp(prefix="dagster-rl-test-home-")


# tiny_grpo's steps at the size of the driver's plumbing tests (caching, lineage, retries, trainers,
# servers): 8 prompts x 8 samples. The shipped 64 prompts a step are what its learning needs; tests of
# the learning itself run the shipped settings.
TINY_PLUMBING = {"prompts_per_step": 8, "n_samples": 8, "min_trials_per_step": 32}


def demo_settings(**overrides) -> dict:
    """The demo experiment's settings, with overrides merged one level deep."""
    return shipped_settings("demo", **overrides)


def shipped_settings(experiment: str, **overrides) -> dict:
    """The settings of `experiments/<name>.yaml`, with overrides merged one level deep."""
    raw = yaml.safe_load((REPO / "experiments" / f"{experiment}.yaml").read_text())
    for key, value in overrides.items():
        raw[key] = {**raw[key], **value} if isinstance(value, dict) and isinstance(raw.get(key), dict) else value
    return raw


def write_experiments(folder: Path, *raws: dict) -> Path:
    """One YAML file per experiment in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    for raw in raws:
        (folder / f"{raw['name']}.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    return folder


def new_dagster_home(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "dagster.yaml").write_text((REPO / "deploy" / "dagster.local.yaml").read_text())
    return path


@pytest.fixture
def lab(tmp_path):
    """lab(name, *experiment_settings, **resources): a fresh Dagster home, store and experiments."""
    from tests.harness import open_lab

    labs = []

    def make(name: str, *raws: dict, **resources):
        home = new_dagster_home(tmp_path / name)
        made = open_lab(home, write_experiments(home / "experiments", *raws), **resources)
        labs.append(made)
        return made

    yield make
    for made in labs:
        made.close()


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    """The reference: steps 0000..0007 of the demo settings in one clean run."""
    from dagster_rl.core import counters
    from tests.harness import open_lab

    home = new_dagster_home(tmp_path_factory.mktemp("ref") / "home")
    lab = open_lab(home, write_experiments(home / "experiments", demo_settings()))
    before = counters.snapshot()
    result = lab.run("demo", "0000", "0007")
    lab.counted = {k: v - before.get(k, 0) for k, v in counters.snapshot().items()}
    lab.result = result
    yield lab
    lab.close()


SESSION_STEPS = ("0000", "0001", "0002")


def session_settings(**overrides) -> dict:
    """`tiny_grpo` without its warm-up, trained by 2 torchrun ranks (a trainer session by default)."""
    trainer = {"backend": "torchrun", "nproc_per_node": 2, "threads_per_process": 1, **overrides.pop("trainer", {})}
    return shipped_settings("tiny_grpo", warmup=None, trainer=trainer, **overrides)


@pytest.fixture(scope="session")
def session_run(tmp_path_factory):
    """The reference of the trainer-session tests: steps 0000..0002 of `session_settings()` in one
    uninterrupted run, its trainer one session of 2 torchrun ranks."""
    from dagster_rl.core import counters
    from tests.harness import open_lab

    home = new_dagster_home(tmp_path_factory.mktemp("session_ref") / "home")
    lab = open_lab(home, write_experiments(home / "experiments", session_settings()))
    before = counters.snapshot()
    lab.result = lab.run("tiny_grpo", SESSION_STEPS[0], SESSION_STEPS[-1])
    lab.counted = {k: v - before.get(k, 0) for k, v in counters.snapshot().items()}
    yield lab
    lab.close()
