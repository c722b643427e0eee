"""Where a range of steps starts from, and what Dagster's event log recorded of what it reads.

A range that starts after step 0 starts from the weights the predecessor step's materialization
points to. The materialization is checked against the store before anything trains from it:
- the artifact's content hash equals the `content_hash` the materialization recorded (Dagster's
  event log is a record independent of the store: a change of an artifact's files and manifest
  together passes the manifest's own hashes, not this);
- the weights' own record (`TrainedFrom`, in their `stats.json`) names that step and this
  experiment's cache family: a materialization copied from another partition or experiment (a
  runless one, say) is refused whatever its metadata says.

`expect_recorded` gives the store the content hashes the event log recorded for every artifact a
range may read (its steps' latest materializations, the predecessor's, the warm-up's), so that a
cache hit of a changed artifact stops the step too, naming both hashes.
"""

import json
from collections.abc import Iterable

from dagster import AssetKey, AssetRecordsFilter, DagsterInstance

from dagster_rl.base.errors import CorruptArtifactError, DagsterRLError, MissingPredecessorError
from dagster_rl.core.experiment import Experiment, step_key
from dagster_rl.core.records import STATS
from dagster_rl.core.task import TaskLoop, Weights
from dagster_rl.store.artifact_store import ArtifactStore, check_key

PAGE = 1000  # materialization records read at a time
NONE = "none"  # what a metadata value that names nothing says (`checks_failed`, `fork_of`): never a blank row


def weights_key(exp: Experiment) -> AssetKey:
    return AssetKey([exp.name, "weights"])


def artifact_of(md: dict, asset: str) -> tuple[str, str]:
    """(kind, key) of the artifact a materialization names (`artifact_path` is `<kind>/<key>`,
    relative to the store; older ones name only the key, of the asset's kind), key checked."""
    kind, _, key = str(md.get("artifact_path", f"{asset}/{md.get('artifact_key')}")).partition("/")
    return kind, check_key(key, f"artifact key {key!r} of a materialization of {asset}")


def not_ours(md: dict, what: str, rerun_from: str) -> str | None:
    """Why a materialization (its metadata values, `md`) was not written by dagster-rl, or None: every
    step it materializes records the artifact it stored (`artifact_key`, `artifact_path`). A runless
    materialization reported by hand without them names nothing to train from or check."""
    if "artifact_key" in md or "artifact_path" in md:  # names an artifact: the checks of its key and content say the rest
        return None
    return (
        f"the materialization of {what} was not written by dagster-rl: it records no artifact (no artifact_key), as a "
        f"runless materialization reported by hand without metadata does. Re-run the range from step {rerun_from}, "
        "which materializes it again"
    )


def missing_before(instance: DagsterInstance, exp: Experiment, first_step: int) -> list[str]:
    """The steps before `first_step` whose weights are not materialized: a range that starts at
    `first_step` needs every one of them first."""
    done = instance.get_materialized_partitions(weights_key(exp)) if first_step else set()
    return [step_key(k) for k in range(first_step) if step_key(k) not in done]


def starting_weights(
    instance: DagsterInstance, exp: Experiment, first_step: int, store: ArtifactStore, loop: TaskLoop
) -> Weights:
    """Initial weights for step 0; otherwise the weights materialized for step first_step - 1."""
    if first_step == 0:
        return loop.initial_weights(exp, store)
    asset = weights_key(exp)
    prev = step_key(first_step - 1)
    missing = missing_before(instance, exp, first_step)
    if missing:
        raise MissingPredecessorError(
            f"step {step_key(first_step)} of {exp.name} starts from the weights of step {prev}, which are not "
            f"materialized (steps {', '.join(missing[:8])}{'...' if len(missing) > 8 else ''} are missing). "
            f"Run step {missing[0]} first, e.g. the range {missing[0]}...{step_key(first_step)}."
        )
    record = instance.fetch_materializations(AssetRecordsFilter(asset_key=asset, asset_partitions=[prev]), limit=1).records[0]
    assert record.asset_materialization is not None  # fetch_materializations returns materialization events alone
    metadata = record.asset_materialization.metadata
    foreign = not_ours({k: v.value for k, v in metadata.items()}, f"{exp.name}/weights {prev}", prev)
    if foreign:
        raise MissingPredecessorError(f"{foreign}; step {step_key(first_step)} starts from its weights.")
    trained_with = metadata["training_hash"].value if "training_hash" in metadata else None
    if trained_with != exp.training_hash():
        raise MissingPredecessorError(
            f"the weights of step {prev} of {exp.name} were trained with other experiment settings "
            f"(training hash {trained_with}, now {exp.training_hash()}). Re-run the range from 0000: steps whose "
            "inputs did not change are cache hits."
        )
    failed_checks = str(metadata["checks_failed"].value) if "checks_failed" in metadata else NONE
    if failed_checks not in (NONE, ""):  # '': how materializations of earlier versions say none
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
    content = metadata["content_hash"].value if "content_hash" in metadata else None
    if not isinstance(content, str):
        raise MissingPredecessorError(
            f"the materialization of {exp.name}/weights {prev} records no content hash: it was not written by the "
            f"driver, and nothing says which weights it means. Refusing to train from it: {rerun}."
        )
    if not store.exists("weights", artifact):
        raise MissingPredecessorError(
            f"the weights of step {prev} of {exp.name} (artifact weights/{artifact}) are not in the artifact store at "
            f"{store.url} (moved aside as corrupt, or deleted): {rerun}."
        )
    store.expect("weights", artifact, content, f"{exp.name}/weights {prev}", f"re-run the range from step {prev}")
    try:
        weights = loop.load_weights(exp, store, prev, artifact)
        trained = _trained_from(store, artifact)
    except CorruptArtifactError as e:
        raise MissingPredecessorError(f"the weights of step {prev} of {exp.name} cannot be used: {e} Then {rerun}.") from None
    _check_trained_by(exp, prev, artifact, trained, rerun)
    return weights


def _trained_from(store: ArtifactStore, artifact: str) -> dict:
    """The weights' own record of what trained them (`TrainedFrom`), or {} when they hold none."""
    try:
        stats = json.loads(store.get("weights", artifact, STATS))
    except CorruptArtifactError:
        raise
    except (DagsterRLError, ValueError):
        return {}
    return stats if isinstance(stats, dict) else {}


def _check_trained_by(exp: Experiment, prev: str, artifact: str, trained: dict, rerun: str) -> None:
    """Refuse weights whose own record names another step or another experiment than the materialization claims."""
    step, family = trained.get("step"), trained.get("experiment")
    if step == int(prev) and family == exp.family:
        return
    claimed = f"the materialization of {exp.name}/weights {prev} points to artifact weights/{artifact}"
    ours = exp.name if exp.family == exp.name else f"{exp.name}'s cache family {exp.family} (the root of its forks)"
    if not trained:
        made = f"which holds no record of a training step ({STATS}): initial or warm-up weights, not those of step {prev}"
    elif family is None:  # every earlier step's weights are as old: the chain is computed again from step 0
        made = f"whose record ({STATS}, written by an older dagster-rl) names step {step} but no experiment"
        rerun = "re-run the range from 0000 (the rollouts and rewards of step 0000 are reused; weights are trained again)"
    else:
        made = f"which step {step_key(int(step)) if isinstance(step, int) else step} of experiment {family} trained ({STATS})"
    raise MissingPredecessorError(
        f"{claimed}, {made}; step {step_key(int(prev) + 1)} of {exp.name} trains only from the weights of step {prev} "
        f"of {ours}. The materialization is not the step's own (reported by hand, or copied from another partition or "
        f"experiment): refusing to train from it. To fix, {rerun}."
    )


def expect_recorded(
    instance: DagsterInstance,
    exp: Experiment,
    assets: Iterable[str],
    steps: list[int],
    store: ArtifactStore,
    warmup: AssetKey | None,
) -> None:
    """Give the store the content hash the event log recorded for each artifact this range may read:
    the latest materialization of each of `assets` for the range's steps and its predecessor, and of
    the warm-up when the range starts at step 0 (see the module doc)."""
    partitions = [step_key(s) for s in range(max(steps[0] - 1, 0), steps[-1] + 1)] if steps else []
    for asset in assets if partitions else ():
        for partition, md in _latest_by_partition(instance, AssetKey([exp.name, asset]), partitions).items():
            _expect(store, md, asset, f"{exp.name}/{asset} {partition}", f"re-run the range from step {partition}")
    if warmup is not None and (not steps or steps[0] == 0):
        latest = instance.get_latest_materialization_event(warmup)
        if latest is not None and latest.asset_materialization is not None:
            md = {k: v.value for k, v in latest.asset_materialization.metadata.items()}
            what = warmup.to_user_string()
            _expect(
                store, {"artifact_path": f"weights/{md.get('artifact_key')}", **md}, "weights", what, f"materialize {what} again"
            )


def _expect(store: ArtifactStore, md: dict, asset: str, what: str, fix: str) -> None:
    try:
        kind, key = artifact_of(md, asset)
    except DagsterRLError:
        return  # a key that is not one: the read that would use it refuses it, naming it
    if isinstance(md.get("content_hash"), str):
        store.expect(kind, key, md["content_hash"], what, fix)


def _latest_by_partition(instance: DagsterInstance, asset: AssetKey, partitions: list[str]) -> dict[str, dict]:
    """partition -> metadata values of its latest materialization, newest records read first."""
    latest: dict[str, dict] = {}
    cursor = None
    while len(latest) < len(partitions):
        page = instance.fetch_materializations(
            AssetRecordsFilter(asset_key=asset, asset_partitions=partitions), limit=PAGE, cursor=cursor
        )
        for record in page.records:
            m = record.asset_materialization
            if m is not None and m.partition is not None and m.partition not in latest:
                latest[m.partition] = {k: v.value for k, v in m.metadata.items()}
        if not page.has_more:
            break
        cursor = page.cursor
    return latest
