"""The tags of an experiment's runs: the range of steps a run drives, as its tags say it, and what a
run without one gets; the experiment a run belongs to.

A run of an experiment's steps names its range with Dagster's partition tags:
`dagster/asset_partition_range_start` and `_end` (a UI backfill, `dagster asset materialize
--partition-range`, `dagster job launch --tags`, `dagster-rl train`), or `dagster/partition` (one
step). Dagster launches `<exp>_train` without them too (`dagster job launch` with no `--tags`):
the driver could then only fail with Dagster's "Cannot access partition_key for a non-partitioned
run", and the daemon would retry that twice. The code location's executor (`assets.concurrency`)
refuses such a run before any step runs, saying which command to use, and tags it never to be
retried (`dagster/max_retries: 0`). It tags every run with its range (`dagster_rl/range`), which
the UI's Runs page shows beside the run.

No Dagster import here: `dagster-rl` reads it before it loads Dagster.
"""

from dagster_rl.base.errors import DagsterRLError
from dagster_rl.core.experiment import step_key

EXPERIMENT_TAG = "dagster_rl/experiment"  # set by the executor (`assets.concurrency`); `dagster-rl runs` reads it
RANGE_TAG = "dagster_rl/range"
RANGE_START, RANGE_END = "dagster/asset_partition_range_start", "dagster/asset_partition_range_end"
PARTITION = "dagster/partition"
MAX_RETRIES_TAG = "dagster/max_retries"
RESUME = "interrupted; re-run the same range to resume"  # what an interrupted run of a range says


class NoRangeError(DagsterRLError):
    """A run of an experiment's steps names no range of steps."""

    retryable = False


def run_range(tags: dict) -> str:
    """The steps a run's tags name: `0008...0011`, `0003` (one step), or '' (none)."""
    if tags.get(RANGE_START) and tags.get(RANGE_END):
        return f"{tags[RANGE_START]}...{tags[RANGE_END]}"
    return tags.get(PARTITION, "")


def range_tags(first: int, last: int) -> dict[str, str]:
    """The run tags of the range first...last (Dagster's, and `dagster_rl/range`)."""
    start, end = step_key(first), step_key(last)
    return {RANGE_START: start, RANGE_END: end, RANGE_TAG: f"{start}...{end}"}


def launch_command(job: str, experiment: str, first: str, last: str) -> str:
    """The two commands that launch the steps first...last of an experiment."""
    tags = f'{{"{RANGE_START}": "{first}", "{RANGE_END}": "{last}"}}'
    return (
        f"    .venv/bin/dagster job launch -w workspace.yaml -l dagster_rl -j {job} --tags '{tags}'\n"
        f"or, in this process, with the checks first:\n"
        f"    .venv/bin/dagster-rl train {experiment} {first}...{last}"
    )


def no_range(job: str, experiment: str, keys: list[str]) -> NoRangeError:
    """The error of a run of `job` that names no range; `keys`: the experiment's steps."""
    first, last = (keys[0], keys[-1]) if keys else ("0000", "0000")
    train = job if job.endswith("_train") else f"{experiment}_train"
    return NoRangeError(
        f"this run of {train} names no range of steps (no tags {RANGE_START} and {RANGE_END}): nothing ran, and it "
        f"is not retried. Launch a range of steps of {experiment} ({first}...{last}), e.g.\n"
        f"{launch_command(train, experiment, first, last)}"
    )
