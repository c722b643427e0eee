"""The code location: every experiment in `experiments/` becomes an asset group and a train job."""

import os
from pathlib import Path

from dagster import AssetSelection, Definitions, define_asset_job

from assets.driver import build_driver
from dagster_rl.experiment import ExperimentBase as Experiment
from dagster_rl.experiment import load_experiments
from resources import ArtifactStoreResource, JudgeEnvironment, RolloutEnvironment, TrainerEnvironment

DEFAULT_EXPERIMENTS = Path(__file__).resolve().parent.parent / "experiments"


def default_resources() -> dict:
    return {
        "rollout": RolloutEnvironment(),
        "judge": JudgeEnvironment(),
        "trainer": TrainerEnvironment(),
        "artifact_store": ArtifactStoreResource(),
    }


def build_definitions(experiments: dict[str, Experiment], resources: dict | None = None) -> Definitions:
    drivers = {name: build_driver(exp) for name, exp in experiments.items()}
    jobs = [
        define_asset_job(
            f"{name}_train",
            selection=AssetSelection.assets(driver),
            description=f"Train experiment {name}: pick a range of steps; one run walks it in order.",
        )
        for name, driver in drivers.items()
    ]
    return Definitions(assets=list(drivers.values()), jobs=jobs, resources={**default_resources(), **(resources or {})})


defs = build_definitions(load_experiments(Path(os.environ.get("DAGSTER_RL_EXPERIMENTS", DEFAULT_EXPERIMENTS))))
