"""The driver: one multi-asset per experiment that walks its partition range in step order.

For each step it calls the rollout, judge and trainer environments through the task's loop
(`dagster_rl.core.task`), then yields a materialization of `<exp>/rollouts`, `<exp>/rewards` and
`<exp>/weights` for that partition (and of the task's extra step assets, such as a language
model's `<exp>/evaluation`, once they are done), so the UI fills in step by step. A backfill of a range is one
run (`BackfillPolicy.single_run()`). A subset selection materializes only the selected assets; every
step still computes (or reuses) all of its artifacts.

A task's warm-up (`Task.warmup`, a language model's `<exp>/sft`) is an unpartitioned asset upstream
of the chain, with a single-run backfill policy too: measured with dagster 1.13.27, a
`dagster asset materialize --select group:<exp> --partition-range ...` and a `dagster job launch`
of `<exp>_train` with the range tags are then one run that materializes it first and the range
after it, and a UI backfill of the group is two runs, the warm-up's then the range's. A range that
starts at step 0 without it (a backfill of the chain alone) computes it through the artifact cache
and records its materialization itself.
"""

import warnings

from dagster import (
    AssetCheckKey,
    AssetExecutionContext,
    AssetKey,
    AssetMaterialization,
    AssetSpec,
    BackfillPolicy,
    BetaWarning,
    MaterializeResult,
    MetadataValue,
    StaticPartitionsDefinition,
    asset,
    multi_asset,
)

from assets.chain import CHAIN, step_assets
from assets.concurrency import experiment_pool
from assets.console import CONSOLE
from assets.console_lines import numbers_line, progress_line, warming_up
from assets.metadata import run_info, step_asset_materialization, step_metadata, superseded, warmup_metadata
from assets.predecessor import NONE, expect_recorded, starting_weights
from assets.progress_reporting import reporting, timed
from assets.run_tags import no_range
from assets.weights_checks import check_outputs, check_specs, report_checks
from dagster_rl.base.errors import CheckFailedError, DagsterRLError, SimulatedCrash
from dagster_rl.core.experiment import Experiment, step_key
from dagster_rl.core.progress import Progress
from dagster_rl.core.task import Backends, StepAsset, task_of
from dagster_rl.runtime.lifetime import die_with_parent
from resources import ArtifactStoreResource, JudgeEnvironment, RolloutEnvironment, SandboxEnvironment, TrainerEnvironment


def step_partitions(exp: Experiment) -> StaticPartitionsDefinition:
    return StaticPartitionsDefinition(exp.step_keys)


def warmup_key(exp: Experiment) -> AssetKey | None:
    """The key of the experiment's warm-up asset (`<exp>/sft`), or None when it has none."""
    spec = task_of(exp.kind).warmup_of(exp)
    return AssetKey([exp.name, spec.name]) if spec is not None else None


def chain_specs(exp: Experiment) -> list[AssetSpec]:
    specs, dep = [], warmup_key(exp)
    for name, description in step_assets(exp).items():
        specs.append(
            AssetSpec(
                AssetKey([exp.name, name]),
                deps=[dep] if dep else [],
                skippable=True,
                group_name=exp.name,
                description=description,
                metadata={"experiment": exp.name, "fork_of": exp.fork_of or NONE},
            )
        )
        dep = AssetKey([exp.name, name])
    return specs


def build_warmup(exp: Experiment):
    """The experiment's warm-up asset (`<exp>/sft`), or None when it has none."""
    spec = task_of(exp.kind).warmup_of(exp)
    if spec is None:
        return None
    key = AssetKey([exp.name, spec.name])

    def warmup(context: AssetExecutionContext, artifact_store: ArtifactStoreResource) -> MaterializeResult:
        die_with_parent()  # as the driver's step process
        store = artifact_store.get_store(warn=context.log.warning)
        expect_recorded(context.instance, exp, (), [], store, key)  # the event log's record of it
        progress = Progress()
        try:
            with (
                reporting(progress, lambda line: context.log.info(line, extra=CONSOLE), PROGRESS_EVERY_S),
                progress.doing(warming_up(key)),
            ):
                result = spec.run(exp, store)
        except DagsterRLError as e:
            _no_retry_unless_retryable(context, e)
            raise
        context.log.info(f"{exp.name}/{spec.name}  cache {result.cache}  {numbers_line(result.metadata)}", extra=CONSOLE)
        return MaterializeResult(metadata=warmup_metadata(exp, result))

    with warnings.catch_warnings():  # an unpartitioned asset's backfill policy is a beta parameter of dagster 1.13: known, wanted
        warnings.simplefilter("ignore", BetaWarning)
        return asset(
            key=key,
            group_name=exp.name,
            backfill_policy=BackfillPolicy.single_run(),  # lets a --partition-range of the group include it
            pool=experiment_pool(exp.name),  # the driver's pool: a second run of the experiment waits here too
            description=spec.description,
            metadata={"experiment": exp.name, "fork_of": exp.fork_of or NONE},
        )(warmup)


def build_driver(exp: Experiment):
    @multi_asset(
        name=f"{exp.name}_driver",
        specs=chain_specs(exp),
        check_specs=check_specs(exp, step_partitions(exp)),
        partitions_def=step_partitions(exp),
        backfill_policy=BackfillPolicy.single_run(),
        pool=experiment_pool(exp.name),  # one run of an experiment at a time (assets.concurrency)
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
        sandbox: SandboxEnvironment,
    ):
        die_with_parent()  # a step process of the multiprocess executor ends when its run worker dies
        try:
            yield from _drive(context, exp, rollout, judge, trainer, artifact_store, sandbox)
        except DagsterRLError as e:
            _no_retry_unless_retryable(context, e)
            raise

    return driver


NO_RETRY_TAG = "dagster/retry_on_asset_or_op_failure"


def _no_retry_unless_retryable(context: AssetExecutionContext, error: DagsterRLError) -> None:
    if not error.retryable:  # a run retry would fail the same way: tell the daemon not to retry
        context.instance.add_run_tags(context.run_id, {NO_RETRY_TAG: "false"})


PROGRESS_EVERY_S = 30.0  # while a step or a long phase runs, its progress is logged at least this often


def _drive(
    context: AssetExecutionContext,
    exp: Experiment,
    rollout: RolloutEnvironment,
    judge: JudgeEnvironment,
    trainer: TrainerEnvironment,
    artifact_store: ArtifactStoreResource,
    sandbox: SandboxEnvironment,
):
    """Walk the run's range of steps in order; yield each step's materializations as it ends."""
    steps = _range_of(context, exp)
    store = artifact_store.get_store(warn=context.log.warning)
    expect_recorded(context.instance, exp, step_assets(exp), steps, store, warmup_key(exp))  # the event log's record
    info = run_info(context)
    progress, idle = Progress(), f"{exp.name}: steps {step_key(steps[0])}...{step_key(steps[-1])}"
    with reporting(progress, lambda line: context.log.info(line, extra=CONSOLE), PROGRESS_EVERY_S, idle):
        if steps[0] == 0:
            yield from _ensure_warmup(context, exp, store, progress)
        loop = task_of(exp.kind).loop()
        with progress.doing(f"{exp.name}: loading the weights step {step_key(steps[0])} starts from"):
            start = starting_weights(context.instance, exp, steps[0], store, loop)
        backends = Backends(
            rollout.backend_for(exp, sandbox.sandboxes()), judge.backend_for(exp), trainer.backend_for(exp, context), progress
        )
        evaluated: set[AssetCheckKey] = set()
        with backends.closed_at_end(context.log.warning):
            for result, seconds in timed(loop.iter_steps(exp, steps, start, store, backends, context.log.warning)):
                if isinstance(result, StepAsset):
                    if AssetKey([exp.name, result.asset]) in context.selected_asset_keys:
                        context.log.info(
                            f"step {step_key(result.step)}  {result.asset}  cache {result.cache}  {numbers_line(result.metadata)}",
                            extra=CONSOLE,
                        )
                        yield step_asset_materialization(exp, result, info)
                    continue
                step = result.step
                context.log.info(progress_line(result, seconds), extra=CONSOLE)
                for asset in CHAIN:
                    if AssetKey([exp.name, asset]) in context.selected_asset_keys:
                        yield AssetMaterialization(
                            asset_key=AssetKey([exp.name, asset]),
                            partition=step_key(step),
                            metadata={**step_metadata(exp, result, info, asset), **superseded(context, exp, result, asset)},
                        )
                failed = report_checks(context, exp, result, evaluated)
                if failed:
                    raise CheckFailedError(
                        f"step {step_key(step)} of {exp.name}: blocking check(s) failed, the range stops here: "
                        + "; ".join(f"{c.name}: {c.message}" for c in failed)
                    )
                if step == exp.faults.crash_driver_at_step and result.cache["weights"] == "miss" and info["attempt"] == 0:
                    raise SimulatedCrash(f"driver crash after step {step_key(step)} on attempt 0 (faults.crash_driver_at_step)")
        yield from check_outputs(context, evaluated)


def _range_of(context: AssetExecutionContext, exp: Experiment) -> list[int]:
    """The run's steps, in order; an error that says how to write the range when it is empty or has holes."""
    if not (context.has_partition_key_range or context.has_partition_key):  # the executor refuses it first (`assets.run_tags`)
        raise no_range(context.run.job_name, exp.name, exp.step_keys)
    steps = sorted(int(k) for k in context.partition_keys)
    if not steps:
        tags = context.run.tags
        first, last = tags.get("dagster/asset_partition_range_start", "?"), tags.get("dagster/asset_partition_range_end", "?")
        hint = (
            f"its first step comes after its last: give it as {last}...{first}"
            if first > last
            else "give a first and a last step"
        )
        raise DagsterRLError(
            f"the range {first}...{last} of {exp.name} holds no step: {hint} (steps 0000...{step_key(exp.n_steps - 1)})"
        )
    if steps != list(range(steps[0], steps[-1] + 1)):
        raise DagsterRLError(f"a run drives a contiguous range of steps; got {[step_key(s) for s in steps]}")
    return steps


def _ensure_warmup(context: AssetExecutionContext, exp: Experiment, store, progress: Progress):
    """Step 0 starts from the warm-up: compute it (or find it in the store), and record its
    materialization when the instance has none of these contents (the warm-up asset was not run)."""
    spec = task_of(exp.kind).warmup_of(exp)
    if spec is None:
        return
    key = AssetKey([exp.name, spec.name])
    with progress.doing(warming_up(key)):
        result = spec.run(exp, store)
    latest = context.instance.get_latest_materialization_event(key)
    recorded = latest.asset_materialization.metadata.get("content_hash") if latest and latest.asset_materialization else None
    if recorded is None or recorded.value != result.ref.content_hash:
        context.log.info(
            f"{key.to_user_string()} was not materialized with these contents; the driver records it (cache {result.cache})"
        )
        yield AssetMaterialization(
            asset_key=key, metadata={**warmup_metadata(exp, result), "recorded_by": MetadataValue.text("driver")}
        )
