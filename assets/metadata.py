"""What the driver's materializations record: a step's numbers, artifacts and run as metadata
values, the warm-up's, an extra step asset's, and what a new materialization supersedes."""

import time
from datetime import UTC, datetime

from dagster import AssetExecutionContext, AssetKey, AssetMaterialization, AssetRecordsFilter, MetadataValue

from assets.predecessor import NONE
from dagster_rl.core.experiment import Experiment, step_key
from dagster_rl.core.task import StepAsset, StepResult, WarmupResult


def run_info(context: AssetExecutionContext) -> dict[str, str | int]:
    """The run's attempt, and when its root run started (the same on every retry): read from Dagster."""
    run = context.run
    root = run.root_run_id or run.run_id
    attempt = int(run.tags.get("dagster/retry_number", "0"))
    record = context.instance.get_run_record_by_id(root)
    started = record.start_time if record is not None and record.start_time else time.time()
    return {"attempt": attempt, "started_at": datetime.fromtimestamp(started, UTC).isoformat(), "root_run_id": root}


SIGNIFICANT_DIGITS = 8


def metadata_float(value: float) -> MetadataValue:
    """A float as the UI shows it: 8 significant digits (a mean reward of 2.568750000000001 reads
    2.56875), far below what a plot or a comparison of two runs needs."""
    return MetadataValue.float(float(f"{value:.{SIGNIFICANT_DIGITS}g}"))


def metadata_value(value: float | int | str) -> MetadataValue:
    if isinstance(value, bool) or isinstance(value, str):
        return MetadataValue.text(str(value))
    return MetadataValue.int(value) if isinstance(value, int) else metadata_float(value)


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
    return {**{k: metadata_value(v) for k, v in values.items()}, "artifact_uri": MetadataValue.path(result.ref.uri)}


def step_asset_materialization(exp: Experiment, result: StepAsset, info: dict) -> AssetMaterialization:
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
        metadata={k: metadata_value(v) for k, v in values.items()},
    )


def superseded(context: AssetExecutionContext, exp: Experiment, result: StepResult, asset: str) -> dict[str, MetadataValue]:
    """`supersedes` and `supersedes_reason` when this partition's latest materialization holds other
    content (formerly failed trials now succeeded, an earlier step changed, other settings); else {}."""
    key, partition = AssetKey([exp.name, asset]), step_key(result.step)
    records = context.instance.fetch_materializations(
        AssetRecordsFilter(asset_key=key, asset_partitions=[partition]), limit=1
    ).records
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
