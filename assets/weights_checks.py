"""The blocking checks of `<exp>/weights`: their specs, and each step's evaluations, logged as
events on the step's partition as the driver walks a range."""

import warnings
from collections.abc import Iterator

from dagster import (
    AssetCheckEvaluation,
    AssetCheckKey,
    AssetCheckSpec,
    AssetExecutionContext,
    AssetKey,
    AssetRecordsFilter,
    MetadataValue,
    Output,
    PartitionsDefinition,
    PreviewWarning,
)

from assets.metadata import metadata_float
from dagster_rl.core.checks import CHECK_NAMES
from dagster_rl.core.experiment import Experiment, step_key
from dagster_rl.core.task import StepResult, task_of
from resources.dagster_internals import AssetCheckEvaluationTargetMaterializationData

CHECK_DESCRIPTIONS = {
    "weights_finite": "The new weights hold only finite numbers (and document priors sum to 1).",
    "rewards_in_bounds": "Every reward of the step lies in [0, the rubric's maximum reward].",
    "enough_usable_trials": "Usable trials / planned trials is at least the experiment's checks.min_usable_fraction.",
}


def check_specs(exp: Experiment, partitions: PartitionsDefinition) -> list[AssetCheckSpec]:
    with warnings.catch_warnings():  # partitioned checks are a preview feature of dagster 1.13: known, wanted
        warnings.simplefilter("ignore", PreviewWarning)
        return _check_specs(exp, partitions)


def check_descriptions(exp: Experiment) -> dict[str, str]:
    """The blocking checks of `<exp>/weights`, by name: the generic ones, then the task's own."""
    return {name: CHECK_DESCRIPTIONS[name] for name in CHECK_NAMES} | {c.name: c.description for c in task_of(exp.kind).checks}


def _check_specs(exp: Experiment, partitions: PartitionsDefinition) -> list[AssetCheckSpec]:
    return [
        AssetCheckSpec(
            name,
            asset=AssetKey([exp.name, "weights"]),
            blocking=True,
            partitions_def=partitions,
            description=description,
        )
        for name, description in check_descriptions(exp).items()
    ]


def report_checks(context: AssetExecutionContext, exp: Experiment, result: StepResult, evaluated: set[AssetCheckKey]) -> list:
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


def _target_materialization(
    context: AssetExecutionContext, asset: AssetKey, partition: str
) -> AssetCheckEvaluationTargetMaterializationData | None:
    """The materialization a step's check evaluations are about: the partition's latest.

    Dagster's UI (the check's Partitions tab, `AssetCheckState`) counts an evaluation of a partition
    only while it targets the partition's latest materialization; an evaluation logged without a
    target counts as stale, and the partition shows "Missing". An `AssetCheckResult` returned by an
    asset gets its target from Dagster; one logged as an event, as the driver does step by step,
    names it itself, as Dagster would (its `_get_partitioned_target_materialization_data`)."""
    records = context.instance.fetch_materializations(
        AssetRecordsFilter(asset_key=asset, asset_partitions=[partition]), limit=1
    ).records
    if not records:
        return None
    return AssetCheckEvaluationTargetMaterializationData(
        storage_id=records[0].storage_id, run_id=records[0].run_id, timestamp=records[0].timestamp
    )
