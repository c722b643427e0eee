"""How a range of steps finds the weights it starts from: the predecessor's materialization."""

from dagster import AssetKey, AssetRecordsFilter, DagsterInstance

from dagster_rl.errors import CorruptArtifactError, MissingPredecessorError
from dagster_rl.experiment import Experiment, step_key
from dagster_rl.store import ArtifactStore, check_key
from dagster_rl.task import TaskLoop, Weights


def weights_key(exp: Experiment) -> AssetKey:
    return AssetKey([exp.name, "weights"])


def starting_weights(instance: DagsterInstance, exp: Experiment, first_step: int, store: ArtifactStore, loop: TaskLoop) -> Weights:
    """Initial weights for step 0; otherwise the weights materialized for step first_step - 1."""
    if first_step == 0:
        return loop.initial_weights(exp, store)
    asset = weights_key(exp)
    prev = step_key(first_step - 1)
    done = instance.get_materialized_partitions(asset)
    missing = [step_key(k) for k in range(first_step) if step_key(k) not in done]
    if missing:
        raise MissingPredecessorError(
            f"step {step_key(first_step)} of {exp.name} starts from the weights of step {prev}, which are not "
            f"materialized (steps {', '.join(missing[:8])}{'...' if len(missing) > 8 else ''} are missing). "
            f"Run step {missing[0]} first, e.g. the range {missing[0]}...{step_key(first_step)}."
        )
    record = instance.fetch_materializations(AssetRecordsFilter(asset_key=asset, asset_partitions=[prev]), limit=1).records[0]
    metadata = record.asset_materialization.metadata
    trained_with = metadata["training_hash"].value if "training_hash" in metadata else None
    if trained_with != exp.training_hash():
        raise MissingPredecessorError(
            f"the weights of step {prev} of {exp.name} were trained with other experiment settings "
            f"(training hash {trained_with}, now {exp.training_hash()}). Re-run the range from 0000: steps whose "
            "inputs did not change are cache hits."
        )
    failed_checks = str(metadata["checks_failed"].value) if "checks_failed" in metadata else ""
    if failed_checks:
        raise MissingPredecessorError(
            f"the weights of step {prev} of {exp.name} failed blocking check(s) {failed_checks}; later steps do not "
            f"start from them. Fix the cause (see the checks of {exp.name}/weights, partition {prev}), then re-run "
            "from the first step whose settings you changed."
        )
    recorded = metadata["artifact_key"].value if "artifact_key" in metadata else None
    artifact = check_key(recorded, f"artifact key of {exp.name}/weights {prev}")
    rerun = (
        f"re-run the range from step {prev} (its inputs are reused from the store; if they are gone too, "
        "from the first step whose artifacts are still there, or from 0000)"
    )
    if not store.exists("weights", artifact):
        raise MissingPredecessorError(
            f"the weights of step {prev} of {exp.name} (artifact weights/{artifact}) are not in the artifact store at "
            f"{store.url} (moved aside as corrupt, or deleted): {rerun}."
        )
    try:
        return loop.load_weights(exp, store, prev, artifact)
    except CorruptArtifactError as e:
        raise MissingPredecessorError(f"the weights of step {prev} of {exp.name} cannot be used: {e} Then {rerun}.") from None
