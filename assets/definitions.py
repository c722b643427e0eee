"""The code location: every valid experiment in `experiments/` becomes an asset group and a train job
(invalid files are reported, see `assets.experiments`)."""

import os
import warnings

from dagster import AssetSelection, Definitions, EnvVar, define_asset_job

from assets.console import concise_console, quiet_interrupted_connection_closes, refuse_to_load
from assets.deployment import artifact_url, executor, rollout_environment, sandbox_environment, trainer_environment
from assets.driver import build_driver, build_warmup
from assets.experiments import missing_folder, problems, read
from dagster_rl.base.errors import DagsterRLError, ExperimentError, SettingError
from dagster_rl.core.experiment import Experiment
from resources import ArtifactStoreResource, JudgeEnvironment
from resources.artifact_store import dagster_home

JUDGE_URL, JUDGE_MODEL, JUDGE_API_KEY = "DAGSTER_RL_JUDGE_URL", "DAGSTER_RL_JUDGE_MODEL", "DAGSTER_RL_JUDGE_API_KEY"


def judge_environment(store: ArtifactStoreResource) -> JudgeEnvironment:
    """The in-process rubric judge; the LLM judge (backend `openai`) when DAGSTER_RL_JUDGE_URL is set.

    The choice is made where the definitions load; the URL, model and API key are `EnvVar`s, read
    where the run executes (the UI shows the variable's name, never the key).
    """
    if not os.environ.get(JUDGE_URL):
        return JudgeEnvironment(artifact_store=store)
    if not os.environ.get(JUDGE_MODEL):
        raise SettingError(
            f"{JUDGE_URL} is set, so the judge is an LLM over that endpoint: set {JUDGE_MODEL} to its model's name"
        )
    return JudgeEnvironment(
        artifact_store=store,
        backend="openai",
        base_url=EnvVar(JUDGE_URL),
        model=EnvVar(JUDGE_MODEL),
        api_key=EnvVar(JUDGE_API_KEY) if os.environ.get(JUDGE_API_KEY) else "",
    )


def default_resources(store: ArtifactStoreResource) -> dict:
    """The embedded default: every environment in this process (torchrun as a Pipes subprocess);
    a rollout server and Kubernetes trainer pods where the environment names them (`assets.deployment`)."""
    return {
        "rollout": rollout_environment(),
        "judge": judge_environment(store),
        "trainer": trainer_environment(),
        "artifact_store": store,
        "sandbox": sandbox_environment(),
    }


def build_definitions(experiments: dict[str, Experiment], resources: dict | None = None) -> Definitions:
    """The asset groups and train jobs of `experiments`, with the default resources overridden by
    `resources` (the judge journals into the `artifact_store` given there)."""
    drivers = {name: build_driver(exp) for name, exp in experiments.items()}
    warmups = {name: w for name, exp in experiments.items() if (w := build_warmup(exp)) is not None}
    jobs = [
        define_asset_job(
            f"{name}_train",
            # with a warm-up (`<exp>/sft`), a range's run materializes it first (a cache hit once it exists)
            selection=AssetSelection.assets(driver, *([warmups[name]] if name in warmups else [])),
            description=f"Train experiment {name}: pick a range of steps; one run walks it in order.",
        )
        for name, driver in drivers.items()
    ]
    resources = dict(resources or {})
    store = resources.get("artifact_store") or ArtifactStoreResource(url=artifact_url())
    return Definitions(
        assets=[*warmups.values(), *drivers.values()],
        jobs=jobs,
        resources={**default_resources(store), **resources},
        executor=executor(),  # one run of an experiment at a time (a pool); k8s_job_executor on a cluster
        loggers={"console": concise_console},  # a line per step on the terminal; the full log stays in the run
    )


def _valid_experiments() -> dict[str, Experiment]:
    files = read()
    missing = missing_folder(files)
    if missing:  # no experiment can be served: the location itself is misconfigured
        raise ExperimentError(missing)
    if files.errors:  # the `invalid_experiment_files` code location shows them in the UI
        warnings.warn(problems(files), stacklevel=2)
    return files.experiments


def _code_location() -> Definitions:
    """What Dagster loads. Refused when DAGSTER_HOME is unset (Dagster's CLI would then run it on a
    throwaway instance and lose the runs' records), when the experiments folder is not there, or
    when a setting it reads is wrong: each error says what to set, as one message on a terminal."""
    try:
        dagster_home()
        return build_definitions(_valid_experiments())
    except DagsterRLError as e:
        refuse_to_load(e)


quiet_interrupted_connection_closes()  # in every process that loads the location: the run's and each step's
defs = _code_location()
