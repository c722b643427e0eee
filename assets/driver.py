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

import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone

from dagster import (
    AssetCheckEvaluation,
    AssetCheckKey,
    AssetCheckSpec,
    AssetExecutionContext,
    AssetKey,
    AssetMaterialization,
    AssetRecordsFilter,
    AssetSpec,
    BackfillPolicy,
    BetaWarning,
    MaterializeResult,
    MetadataValue,
    Output,
    StaticPartitionsDefinition,
    PreviewWarning,
    asset,
    multi_asset,
)

from assets.chain import CHAIN, step_assets
from assets.concurrency import experiment_pool
from assets.console import CONSOLE
from assets.predecessor import NONE, expect_recorded, starting_weights
from assets.run_tags import no_range
from dagster_rl.core.checks import CHECK_NAMES
from dagster_rl.core.errors import CheckFailedError, DagsterRLError, SimulatedCrash
from dagster_rl.core.experiment import Experiment, step_key
from dagster_rl.runtime.lifetime import die_with_parent
from dagster_rl.core.progress import Progress
from dagster_rl.core.task import Backends, StepAsset, StepResult, WarmupResult, task_of
from resources import ArtifactStoreResource, JudgeEnvironment, RolloutEnvironment, TrainerEnvironment
from resources.dagster_internals import AssetCheckEvaluationTargetMaterializationData

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


CHECK_DESCRIPTIONS = {
    "weights_finite": "The new weights hold only finite numbers (and document priors sum to 1).",
    "rewards_in_bounds": "Every reward of the step lies in [0, the rubric's maximum reward].",
    "enough_usable_trials": "Usable trials / planned trials is at least the experiment's checks.min_usable_fraction.",
}


def check_specs(exp: Experiment) -> list[AssetCheckSpec]:
    with warnings.catch_warnings():  # partitioned checks are a preview feature of dagster 1.13: known, wanted
        warnings.simplefilter("ignore", PreviewWarning)
        return _check_specs(exp)


def check_descriptions(exp: Experiment) -> dict[str, str]:
    """The blocking checks of `<exp>/weights`, by name: the generic ones, then the task's own."""
    return {name: CHECK_DESCRIPTIONS[name] for name in CHECK_NAMES} | {c.name: c.description for c in task_of(exp.kind).checks}


def _check_specs(exp: Experiment) -> list[AssetCheckSpec]:
    return [
        AssetCheckSpec(
            name,
            asset=AssetKey([exp.name, "weights"]),
            blocking=True,
            partitions_def=step_partitions(exp),
            description=description,
        )
        for name, description in check_descriptions(exp).items()
    ]


def _run_info(context: AssetExecutionContext) -> dict[str, str | int]:
    """The run's attempt, and when its root run started (the same on every retry): read from Dagster."""
    run = context.run
    root = run.root_run_id or run.run_id
    attempt = int(run.tags.get("dagster/retry_number", "0"))
    record = context.instance.get_run_record_by_id(root)
    started = record.start_time if record is not None and record.start_time else time.time()
    return {"attempt": attempt, "started_at": datetime.fromtimestamp(started, timezone.utc).isoformat(), "root_run_id": root}


SIGNIFICANT_DIGITS = 8


def metadata_float(value: float) -> MetadataValue:
    """A float as the UI shows it: 8 significant digits (a mean reward of 2.568750000000001 reads
    2.56875), far below what a plot or a comparison of two runs needs."""
    return MetadataValue.float(float(f"{value:.{SIGNIFICANT_DIGITS}g}"))


def step_metadata(exp: Experiment, result: StepResult, run_info: dict, asset: str) -> dict[str, MetadataValue]:
    ref = result.refs[asset]
    shared = {
        "n_trials": MetadataValue.int(result.n_trials),
        "n_trials_planned": MetadataValue.int(result.n_trials_planned),
        "mean_reward": metadata_float(result.mean_reward),
        "success_rate": metadata_float(result.success_rate),
        "weights_version": MetadataValue.int(result.weights_version),
        "trials_executed": MetadataValue.int(result.trials_executed),
        "judge_calls": MetadataValue.int(result.judge_calls),
        "cache": MetadataValue.text(result.cache[asset]),
        "behavior_policy": MetadataValue.json(result.behavior_policy),
        "artifact_key": MetadataValue.text(ref.key),
        "content_hash": MetadataValue.text(ref.content_hash),
        "artifact_path": MetadataValue.path(ref.path),  # relative to the artifact store's root
        "attempt": MetadataValue.int(run_info["attempt"]),
        "started_at": MetadataValue.text(run_info["started_at"]),
        "training_hash": MetadataValue.text(exp.training_hash()),
        "skipped_trials": MetadataValue.int(len(result.skipped_trials)),
        "recovered_trials": MetadataValue.int(len(result.recovered_trials)),
    }
    shared.update({k: metadata_float(v) for k, v in result.metrics.items()})
    shared.update({k: MetadataValue.float(round(v, 6)) for k, v in result.timings.items()})
    if asset == "rewards":
        shared["rubric"] = MetadataValue.json(exp.rubric.model_dump())
    if asset == "weights":
        shared["checks_failed"] = MetadataValue.text(",".join(c.name for c in result.checks if not c.passed) or NONE)
    return shared


def warmup_metadata(exp: Experiment, result: WarmupResult) -> dict[str, MetadataValue]:
    values = {
        **result.metadata,
        "cache": result.cache,
        "artifact_key": result.ref.key,
        "content_hash": result.ref.content_hash,
        "training_hash": exp.training_hash(),
    }
    return {**{k: _metadata_value(v) for k, v in values.items()}, "artifact_uri": MetadataValue.path(result.ref.uri)}


def build_warmup(exp: Experiment):
    """The experiment's warm-up asset (`<exp>/sft`), or None when it has none."""
    spec = task_of(exp.kind).warmup_of(exp)
    if spec is None:
        return None

    def warmup(context: AssetExecutionContext, artifact_store: ArtifactStoreResource) -> MaterializeResult:
        die_with_parent()  # as the driver's step process
        store = artifact_store.get_store(warn=context.log.warning)
        expect_recorded(context.instance, exp, (), [], store, warmup_key(exp))  # the event log's record of it
        progress = Progress()
        try:
            with reporting(progress, lambda line: context.log.info(line, extra=CONSOLE), PROGRESS_EVERY_S), progress.doing(warming_up(warmup_key(exp))):
                result = spec.run(exp, store)
        except DagsterRLError as e:
            _no_retry_unless_retryable(context, e)
            raise
        context.log.info(f"{exp.name}/{spec.name}  cache {result.cache}  {numbers_line(result.metadata)}", extra=CONSOLE)
        return MaterializeResult(metadata=warmup_metadata(exp, result))

    with warnings.catch_warnings():  # an unpartitioned asset's backfill policy is a beta parameter of dagster 1.13: known, wanted
        warnings.simplefilter("ignore", BetaWarning)
        return asset(
            key=warmup_key(exp),
            group_name=exp.name,
            backfill_policy=BackfillPolicy.single_run(),  # lets a --partition-range of the group include it
            pool=experiment_pool(exp.name),  # the driver's pool: a second run of the experiment waits here too
            description=spec.description,
            metadata={"experiment": exp.name, "fork_of": exp.fork_of or NONE},
        )(warmup)


def warming_up(key: AssetKey) -> str:
    """What the console says while a warm-up runs (computed once, then read from the artifact store)."""
    return f"{key.to_user_string()}: warming up"


def superseded(context: AssetExecutionContext, exp: Experiment, result: StepResult, asset: str) -> dict[str, MetadataValue]:
    """`supersedes` and `supersedes_reason` when this partition's latest materialization holds other
    content (formerly failed trials now succeeded, an earlier step changed, other settings); else {}."""
    key, partition = AssetKey([exp.name, asset]), step_key(result.step)
    records = context.instance.fetch_materializations(AssetRecordsFilter(asset_key=key, asset_partitions=[partition]), limit=1).records
    if not records:
        return {}
    old = {k: v.value for k, v in records[0].asset_materialization.metadata.items()}
    if old.get("content_hash") == result.refs[asset].content_hash:
        return {}
    if result.recovered_trials:
        reason = (
            f"trials that failed in an earlier attempt of this step now succeeded ({old.get('n_trials')}/"
            f"{old.get('n_trials_planned')} usable before, {result.n_trials}/{result.n_trials_planned} now)"
        )
    elif old.get("training_hash") != exp.training_hash():
        reason = "the experiment's training settings changed"
    else:
        reason = "an earlier step changed, so this step's inputs did"
    was = f"run {records[0].run_id[:8]}: {old.get('n_trials')}/{old.get('n_trials_planned')} trials, content {str(old.get('content_hash'))[:16]}"
    return {"supersedes": MetadataValue.text(was), "supersedes_reason": MetadataValue.text(reason)}


def build_driver(exp: Experiment):
    @multi_asset(
        name=f"{exp.name}_driver",
        specs=chain_specs(exp),
        check_specs=check_specs(exp),
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
    ):
        die_with_parent()  # a step process of the multiprocess executor ends when its run worker dies
        try:
            yield from _drive(context, exp, rollout, judge, trainer, artifact_store)
        except DagsterRLError as e:
            _no_retry_unless_retryable(context, e)
            raise

    return driver


NO_RETRY_TAG = "dagster/retry_on_asset_or_op_failure"


def _no_retry_unless_retryable(context: AssetExecutionContext, error: DagsterRLError) -> None:
    if not error.retryable:  # a run retry would fail the same way: tell the daemon not to retry
        context.instance.add_run_tags(context.run_id, {NO_RETRY_TAG: "false"})


PROGRESS_EVERY_S = 30.0  # while a step or a long phase runs, its progress is logged at least this often
FIRST_PROGRESS_S = 10.0  # and first this soon


def _drive(
    context: AssetExecutionContext,
    exp: Experiment,
    rollout: RolloutEnvironment,
    judge: JudgeEnvironment,
    trainer: TrainerEnvironment,
    artifact_store: ArtifactStoreResource,
):
    """Walk the run's range of steps in order; yield each step's materializations as it ends."""
    steps = _range_of(context, exp)
    store = artifact_store.get_store(warn=context.log.warning)
    expect_recorded(context.instance, exp, step_assets(exp), steps, store, warmup_key(exp))  # the event log's record
    info = _run_info(context)
    progress, idle = Progress(), f"{exp.name}: steps {step_key(steps[0])}...{step_key(steps[-1])}"
    with reporting(progress, lambda line: context.log.info(line, extra=CONSOLE), PROGRESS_EVERY_S, idle):
        if steps[0] == 0:
            yield from _ensure_warmup(context, exp, store, progress)
        loop = task_of(exp.kind).loop()
        with progress.doing(f"{exp.name}: loading the weights step {step_key(steps[0])} starts from"):
            start = starting_weights(context.instance, exp, steps[0], store, loop)
        backends = Backends(rollout.backend_for(exp), judge.backend_for(exp), trainer.backend_for(exp, context), progress)
        evaluated: set[AssetCheckKey] = set()
        with closed_at_end(backends, context.log.warning):
            for result, seconds in _timed(loop.iter_steps(exp, steps, start, store, backends, context.log.warning)):
                if isinstance(result, StepAsset):
                    if AssetKey([exp.name, result.asset]) in context.selected_asset_keys:
                        context.log.info(
                            f"step {step_key(result.step)}  {result.asset}  cache {result.cache}  {numbers_line(result.metadata)}", extra=CONSOLE
                        )
                        yield _step_asset_materialization(exp, result, info)
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
                failed = _report_checks(context, exp, result, evaluated)
                if failed:
                    raise CheckFailedError(
                        f"step {step_key(step)} of {exp.name}: blocking check(s) failed, the range stops here: "
                        + "; ".join(f"{c.name}: {c.message}" for c in failed)
                    )
                if step == exp.faults.crash_driver_at_step and result.cache["weights"] == "miss" and info["attempt"] == 0:
                    raise SimulatedCrash(f"driver crash after step {step_key(step)} on attempt 0 (faults.crash_driver_at_step)")
        yield from check_outputs(context, evaluated)


def _timed(items: Iterator, clock: Callable[[], float] = time.monotonic) -> Iterator[tuple]:
    """(item, seconds the loop took to produce it): the time the driver waited for each step, not
    the time Dagster took to record what the driver yielded (materializations, checks)."""
    while True:
        began = clock()
        try:
            item = next(items)
        except StopIteration:
            return
        yield item, clock() - began


def _range_of(context: AssetExecutionContext, exp: Experiment) -> list[int]:
    """The run's steps, in order; an error that says how to write the range when it is empty or has holes."""
    if not (context.has_partition_key_range or context.has_partition_key):  # the executor refuses it first (`assets.run_tags`)
        raise no_range(context.run.job_name, exp.name, exp.step_keys)
    steps = sorted(int(k) for k in context.partition_keys)
    if not steps:
        tags = context.run.tags
        first, last = tags.get("dagster/asset_partition_range_start", "?"), tags.get("dagster/asset_partition_range_end", "?")
        hint = f"its first step comes after its last: give it as {last}...{first}" if first > last else "give a first and a last step"
        raise DagsterRLError(f"the range {first}...{last} of {exp.name} holds no step: {hint} (steps 0000...{step_key(exp.n_steps - 1)})")
    if steps != list(range(steps[0], steps[-1] + 1)):
        raise DagsterRLError(f"a run drives a contiguous range of steps; got {[step_key(s) for s in steps]}")
    return steps


def progress_line(result: StepResult, seconds: float) -> str:
    """The one line a step ends with: `step 0003  24/24 trials  mean reward 2.331  cache miss  0.41 s`."""
    caches = set(result.cache.values())
    cache = caches.pop() if len(caches) == 1 else ", ".join(f"{a} {c}" for a, c in result.cache.items())
    notes = []
    if result.skipped_trials:
        notes.append(f"{len(result.skipped_trials)} trials failed, a re-run attempts them again")
    if result.recovered_trials:
        notes.append(f"{len(result.recovered_trials)} formerly failed trials recovered")
    tail = f"  ({'; '.join(notes)})" if notes else ""
    return (
        f"step {step_key(result.step)}  {result.n_trials}/{result.n_trials_planned} trials  mean reward "
        f"{result.mean_reward:.3f}  cache {cache}  {seconds:.2f} s{tail}"
    )


def numbers_line(values: dict[str, float | int | str]) -> str:
    """`accuracy 0.76  base_accuracy 0  n_prompts 100`: an asset's numbers on one console line."""
    return "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items())


@contextmanager
def reporting(progress: Progress, log: Callable[[str], None], every_s: float, idle: str = "") -> Iterator[None]:
    """Log the progress of the running steps and phases in a thread, while inside: first after
    `min(FIRST_PROGRESS_S, every_s)` (a run's step process takes some seconds to start: the console
    is never silent for `every_s` from the run's start), then every `every_s` seconds. Between
    steps and phases, `idle` says what runs (e.g. `demo: steps 0000...0007`)."""
    stop, began = threading.Event(), time.monotonic()

    def tick() -> None:
        wait = min(FIRST_PROGRESS_S, every_s)
        while not stop.wait(wait):
            for line in progress.lines() or ([f"{idle}, {time.monotonic() - began:.0f} s so far"] if idle else []):
                log(line)
            wait = every_s

    thread = threading.Thread(target=tick, name="dagster-rl-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@contextmanager
def closed_at_end(backends: Backends, warn: Callable[[str], None]) -> Iterator[None]:
    """The range's backends, closed when it ends, however it ends (a trainer session's workers stop).
    A failure to close is reported, never raised over the error that ended the range."""
    try:
        yield
    except BaseException:
        try:
            backends.close()
        except Exception as e:  # noqa: BLE001 - the error that ended the range is the one to report
            warn(f"closing the backends after a failed range: {e!r}")
        raise
    backends.close()


def _ensure_warmup(context: AssetExecutionContext, exp: Experiment, store, progress: Progress):
    """Step 0 starts from the warm-up: compute it (or find it in the store), and record its
    materialization when the instance has none of these contents (the warm-up asset was not run)."""
    spec = task_of(exp.kind).warmup_of(exp)
    if spec is None:
        return
    key = warmup_key(exp)
    with progress.doing(warming_up(key)):
        result = spec.run(exp, store)
    latest = context.instance.get_latest_materialization_event(key)
    recorded = latest.asset_materialization.metadata.get("content_hash") if latest and latest.asset_materialization else None
    if recorded is None or recorded.value != result.ref.content_hash:
        context.log.info(f"{key.to_user_string()} was not materialized with these contents; the driver records it (cache {result.cache})")
        yield AssetMaterialization(asset_key=key, metadata={**warmup_metadata(exp, result), "recorded_by": MetadataValue.text("driver")})


def _step_asset_materialization(exp: Experiment, result: StepAsset, info: dict) -> AssetMaterialization:
    values = {
        **result.metadata,
        "cache": result.cache,
        "artifact_key": result.ref.key,
        "content_hash": result.ref.content_hash,
        "artifact_path": result.ref.path,
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
    return MetadataValue.int(value) if isinstance(value, int) else metadata_float(value)


def _report_checks(context: AssetExecutionContext, exp: Experiment, result: StepResult, evaluated: set[AssetCheckKey]) -> list:
    """Log each selected check's evaluation on the step's partition (adding its key to `evaluated`);
    return the failed ones."""
    weights, partition = AssetKey([exp.name, "weights"]), step_key(result.step)
    target = _target_materialization(context, weights, partition)
    failed = []
    for check in result.checks:
        key = AssetCheckKey(weights, check.name)
        if key not in context.selected_asset_check_keys:
            continue
        evaluated.add(key)
        context.log_event(
            AssetCheckEvaluation(
                asset_key=weights,
                check_name=check.name,
                passed=check.passed,
                partition=partition,
                target_materialization_data=target,
                blocking=True,
                description=check.message,
                metadata={check.measure: metadata_float(check.value), "message": MetadataValue.text(check.message)},
            )
        )
        if not check.passed:
            failed.append(check)
    return failed


def check_outputs(context: AssetExecutionContext, evaluated: set[AssetCheckKey]) -> Iterator[Output]:
    """The op output of each check evaluated in the range, once, after its last step: what an
    `AssetCheckResult` yields beside its evaluation. The driver logs a check's evaluation of each
    step itself (an `AssetCheckResult` names no partition of a range); without these outputs Dagster
    would log that the op "did not yield or return expected outputs"."""
    for name, spec in context.assets_def.check_specs_by_output_name.items():
        if spec.key in evaluated:
            yield Output(None, output_name=name)


def _target_materialization(context: AssetExecutionContext, asset: AssetKey, partition: str) -> AssetCheckEvaluationTargetMaterializationData | None:
    """The materialization a step's check evaluations are about: the partition's latest.

    Dagster's UI (the check's Partitions tab, `AssetCheckState`) counts an evaluation of a partition
    only while it targets the partition's latest materialization; an evaluation logged without a
    target counts as stale, and the partition shows "Missing". An `AssetCheckResult` returned by an
    asset gets its target from Dagster; one logged as an event, as the driver does step by step,
    names it itself, as Dagster would (its `_get_partitioned_target_materialization_data`)."""
    records = context.instance.fetch_materializations(AssetRecordsFilter(asset_key=asset, asset_partitions=[partition]), limit=1).records
    if not records:
        return None
    return AssetCheckEvaluationTargetMaterializationData(storage_id=records[0].storage_id, run_id=records[0].run_id, timestamp=records[0].timestamp)
