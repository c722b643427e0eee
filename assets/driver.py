"""The driver: one multi-asset per experiment that walks its partition range in step order.

For each step it calls the rollout, judge and trainer environments through the task's loop
(`dagster_rl.task`), then yields a materialization of `<exp>/rollouts`, `<exp>/rewards` and
`<exp>/weights` for that partition (and of the task's extra step assets, such as a language
model's `<exp>/evaluation`, once they are done), so the UI fills in step by step. A backfill of a range is one
run (`BackfillPolicy.single_run()`). A subset selection materializes only the selected assets; every
step still computes (or reuses) all of its artifacts.
"""

import warnings
from datetime import datetime, timezone

from dagster import (
    AssetCheckEvaluation,
    AssetCheckKey,
    AssetCheckSpec,
    AssetExecutionContext,
    AssetKey,
    AssetMaterialization,
    AssetSpec,
    BackfillPolicy,
    MetadataValue,
    StaticPartitionsDefinition,
    PreviewWarning,
    multi_asset,
)

from assets.predecessor import starting_weights
from dagster_rl.checks import CHECK_NAMES
from dagster_rl.errors import CheckFailedError, DagsterRLError, SimulatedCrash
from dagster_rl.experiment import Experiment, step_key
from dagster_rl.task import Backends, StepAsset, StepResult, task_of
from resources import ArtifactStoreResource, JudgeEnvironment, RolloutEnvironment, TrainerEnvironment

CHAIN = ("rollouts", "rewards", "weights")
CHAIN_DESCRIPTIONS = {
    "rollouts": "Trajectories of every trial of the step, generated with the previous step's weights.",
    "rewards": "Verifier + rubric reward of every trajectory of the step, sorted by trial id.",
    "weights": "The policy after the step's GRPO update: the step's checkpoint.",
}


def step_assets(exp: Experiment) -> dict[str, str]:
    """The per-step assets of an experiment's group, in order, with their descriptions: the chain,
    then the task's own (a language model's held-out `evaluation`)."""
    return CHAIN_DESCRIPTIONS | {spec.name: spec.description for spec in task_of(exp.kind).step_assets}


def step_partitions(exp: Experiment) -> StaticPartitionsDefinition:
    return StaticPartitionsDefinition(exp.step_keys)


def chain_specs(exp: Experiment) -> list[AssetSpec]:
    specs, dep = [], None
    for name, description in step_assets(exp).items():
        specs.append(
            AssetSpec(
                AssetKey([exp.name, name]),
                deps=[dep] if dep else [],
                skippable=True,
                group_name=exp.name,
                description=description,
                metadata={"experiment": exp.name, "fork_of": exp.fork_of or ""},
            )
        )
        dep = AssetKey([exp.name, name])
    return specs


CHECK_DESCRIPTIONS = {
    "weights_finite": "The new weights hold only finite numbers (and document priors sum to 1).",
    "rewards_in_bounds": "Every reward of the step lies in [0, the rubric's maximum reward].",
    "enough_usable_trials": "Usable trials / planned trials is at least the experiment's checks.min_usable_fraction.",
}


def check_specs(exp: Experiment) -> list[AssetCheckSpec]:
    with warnings.catch_warnings():  # partitioned checks are a preview feature of dagster 1.13: known, wanted
        warnings.simplefilter("ignore", PreviewWarning)
        return _check_specs(exp)


def _check_specs(exp: Experiment) -> list[AssetCheckSpec]:
    return [
        AssetCheckSpec(
            name,
            asset=AssetKey([exp.name, "weights"]),
            blocking=True,
            partitions_def=step_partitions(exp),
            description=CHECK_DESCRIPTIONS[name],
        )
        for name in CHECK_NAMES
    ]


def _run_info(context: AssetExecutionContext, store) -> dict[str, str | int]:
    run = context.run
    root = run.root_run_id or run.run_id
    attempt = int(run.tags.get("dagster/retry_number", "0"))
    record = store.put_record(f"runs/{root}", {"started_at": datetime.now(timezone.utc).isoformat()})
    return {"attempt": attempt, "started_at": record["started_at"], "root_run_id": root}


def step_metadata(exp: Experiment, result: StepResult, run_info: dict, asset: str) -> dict[str, MetadataValue]:
    ref = result.refs[asset]
    shared = {
        "n_trials": MetadataValue.int(result.n_trials),
        "n_trials_planned": MetadataValue.int(result.n_trials_planned),
        "mean_reward": MetadataValue.float(result.mean_reward),
        "success_rate": MetadataValue.float(result.success_rate),
        "weights_version": MetadataValue.int(result.weights_version),
        "trials_executed": MetadataValue.int(result.trials_executed),
        "judge_calls": MetadataValue.int(result.judge_calls),
        "cache": MetadataValue.text(result.cache[asset]),
        "behavior_policy": MetadataValue.json(result.behavior_policy),
        "artifact_key": MetadataValue.text(ref.key),
        "content_hash": MetadataValue.text(ref.content_hash),
        "artifact_uri": MetadataValue.path(ref.uri),
        "attempt": MetadataValue.int(run_info["attempt"]),
        "started_at": MetadataValue.text(run_info["started_at"]),
        "training_hash": MetadataValue.text(exp.training_hash()),
        "skipped_trials": MetadataValue.int(len(result.skipped_trials)),
    }
    shared.update({k: MetadataValue.float(v) for k, v in result.metrics.items()})
    shared.update({k: MetadataValue.float(round(v, 6)) for k, v in result.timings.items()})
    if asset == "rewards":
        shared["rubric"] = MetadataValue.json(exp.rubric.model_dump())
    if asset == "weights":
        shared["checks_failed"] = MetadataValue.text(",".join(c.name for c in result.checks if not c.passed))
    return shared


def build_driver(exp: Experiment):
    @multi_asset(
        name=f"{exp.name}_driver",
        specs=chain_specs(exp),
        check_specs=check_specs(exp),
        partitions_def=step_partitions(exp),
        backfill_policy=BackfillPolicy.single_run(),
        can_subset=True,  # makes check outputs optional: checks are reported per step as events
        # on Kubernetes (k8s_job_executor) the driver's step pod gets what the experiment says it needs
        op_tags={"dagster-k8s/config": exp.driver_pod.dagster_k8s_config()} if exp.driver_pod else None,
        description=f"Drives the training steps of experiment {exp.name} in order. {exp.description}",
    )
    def driver(
        context: AssetExecutionContext,
        rollout: RolloutEnvironment,
        judge: JudgeEnvironment,
        trainer: TrainerEnvironment,
        artifact_store: ArtifactStoreResource,
    ):
        try:
            yield from _drive(context, exp, rollout, judge, trainer, artifact_store)
        except DagsterRLError as e:
            if not e.retryable:  # a run retry would fail the same way: tell the daemon not to retry
                context.instance.add_run_tags(context.run_id, {NO_RETRY_TAG: "false"})
            raise

    return driver


NO_RETRY_TAG = "dagster/retry_on_asset_or_op_failure"


def _drive(
    context: AssetExecutionContext,
    exp: Experiment,
    rollout: RolloutEnvironment,
    judge: JudgeEnvironment,
    trainer: TrainerEnvironment,
    artifact_store: ArtifactStoreResource,
):
    """Walk the run's range of steps in order; yield each step's materializations as it ends."""
    steps = sorted(int(k) for k in context.partition_keys)
    if steps != list(range(steps[0], steps[-1] + 1)):
        raise DagsterRLError(f"a run drives a contiguous range of steps; got {[step_key(s) for s in steps]}")
    store = artifact_store.get_store()
    info = _run_info(context, store)
    loop = task_of(exp.kind).loop()
    start = starting_weights(context.instance, exp, steps[0], store, loop)
    backends = Backends(rollout.backend_for(exp), judge.backend_for(exp), trainer.backend_for(exp, context))
    for result in loop.iter_steps(exp, steps, start, store, backends, context.log.warning):
        if isinstance(result, StepAsset):
            if AssetKey([exp.name, result.asset]) in context.selected_asset_keys:
                yield _step_asset_materialization(exp, result, info)
            continue
        step = result.step
        context.log.info(
            f"step {step_key(step)}: {result.n_trials}/{result.n_trials_planned} trials, mean reward "
            f"{result.mean_reward:.3f}, weights v{result.weights_version}, cache {result.cache}, attempt {info['attempt']}"
        )
        for asset in CHAIN:
            if AssetKey([exp.name, asset]) in context.selected_asset_keys:
                yield AssetMaterialization(
                    asset_key=AssetKey([exp.name, asset]),
                    partition=step_key(step),
                    metadata=step_metadata(exp, result, info, asset),
                )
        failed = _report_checks(context, exp, result)
        if failed:
            raise CheckFailedError(
                f"step {step_key(step)} of {exp.name}: blocking check(s) failed, the range stops here: "
                + "; ".join(f"{c.name}: {c.message}" for c in failed)
            )
        if step == exp.faults.crash_driver_at_step and result.cache["weights"] == "miss" and info["attempt"] == 0:
            raise SimulatedCrash(f"driver crash after step {step_key(step)} on attempt 0 (faults.crash_driver_at_step)")


def _step_asset_materialization(exp: Experiment, result: StepAsset, info: dict) -> AssetMaterialization:
    values = {
        **result.metadata,
        "cache": result.cache,
        "artifact_key": result.ref.key,
        "content_hash": result.ref.content_hash,
        "attempt": info["attempt"],
        "started_at": info["started_at"],
    }
    return AssetMaterialization(
        asset_key=AssetKey([exp.name, result.asset]),
        partition=step_key(result.step),
        metadata={k: _metadata_value(v) for k, v in values.items()},
    )


def _metadata_value(value: float | int | str) -> MetadataValue:
    if isinstance(value, bool) or isinstance(value, str):
        return MetadataValue.text(str(value))
    return MetadataValue.int(value) if isinstance(value, int) else MetadataValue.float(value)


def _report_checks(context: AssetExecutionContext, exp: Experiment, result: StepResult) -> list:
    """Log each selected check's evaluation on the step's partition; return the failed ones."""
    weights = AssetKey([exp.name, "weights"])
    failed = []
    for check in result.checks:
        if AssetCheckKey(weights, check.name) not in context.selected_asset_check_keys:
            continue
        context.log_event(
            AssetCheckEvaluation(
                asset_key=weights,
                check_name=check.name,
                passed=check.passed,
                partition=step_key(result.step),
                blocking=True,
                description=check.message,
                metadata={"value": MetadataValue.float(check.value), "message": MetadataValue.text(check.message)},
            )
        )
        if not check.passed:
            failed.append(check)
    return failed
