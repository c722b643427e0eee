"""The records every task's step stores, generic over the task's trajectory and reward types.

A step stores three artifacts, each naming what it was made from, so that any checkpoint can be
traced back to step 0 (`dagster_rl.core.lineage`):

    rollouts  `Rollouts[T]`: the step's trajectories and the weights that generated them
    rewards   `Rewards[R]`: their rewards, and the rollouts artifact they score
    weights   the task's files, with a `TrainedFrom` record: the weights and rewards it came from
"""

from typing import Any, Generic, TypeVar

from dagster_rl.base.hashing import cache_key, content_hash
from dagster_rl.base.strict import Record

T = TypeVar("T")  # a task's trajectory
R = TypeVar("R")  # a task's reward


class TrialFailed(Record):
    """A trial that still failed after its retries: skipped by its step, never stored as a result."""

    trial_id: str
    error: str  # what its last attempt raised


class Rollouts(Record, Generic[T]):
    step: int
    behavior_policy: dict[str, str | int]  # weights partition, key, content hash, version
    n_trials_planned: int
    trajectories: list[T]  # sorted by trial id
    skipped: list[str]  # trials that failed after their retries: a re-run attempts them again

    def outcomes(self) -> list[T]:
        """What succeeded, trial by trial (see `dagster_rl.core.steps.trial_set`)."""
        return self.trajectories


class Rewards(Record, Generic[R]):
    step: int
    rollouts_key: str
    rollouts_hash: str
    rubric: dict[str, Any]  # the rubric's settings (a rubric of reward functions holds a list of them)
    rewards: list[R]  # sorted by trial id
    skipped: list[str]  # trials not generated, or whose judging failed after its retries

    def outcomes(self) -> list[R]:
        return self.rewards


class TrainedFrom(Record):
    """Stored beside trained weights (`STATS`): what trained them. Tasks add how it went.

    `step` and `experiment` (the experiment's cache family, `Experiment.family`) are what the driver
    checks before a range starts from weights a materialization points to: the weights of another
    step, or of another experiment, are refused whatever the metadata says."""

    step: int
    experiment: str
    prev_weights_key: str
    prev_weights_hash: str
    rewards_key: str
    rewards_hash: str


STATS = "stats.json"  # the file of a trained weights artifact that holds its `TrainedFrom` record


CALL_TIMES = "call_times"  # the artifact kind of the wall times of a trajectory's programs


class CallTimes(Record):
    """The wall time of each program a trial's environment ran, per turn (seconds). Times differ from
    run to run and a trajectory must not: they are stored beside it, under its content
    (`call_times_key`), the first writer's kept; `dagster-rl lineage --trial` shows them."""

    trial_id: str
    seconds: list[list[float]]


def call_times_key(trajectory: Any) -> str:
    """The key of a trajectory's call times: its content (a record, or its JSON as the rollouts store it)."""
    return cache_key(CALL_TIMES, "call-times-1", trajectory=content_hash(trajectory))
