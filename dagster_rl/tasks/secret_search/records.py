"""The records of a secret_search step: trials, trajectories, rewards, the tabular weights."""

from dagster_rl.core.records import Record, TrainedFrom


class TrialSpec(Record):
    trial_id: str  # s{step}-p{prompt}-n{sample}
    step: int
    prompt: int
    sample: int
    world_id: str
    seed: int


class Trajectory(Record):
    trial_id: str
    step: int
    prompt: int
    world_id: str
    seed: int
    docs_read: list[int]
    answer: str | None
    turns: int
    files_left: list[str]  # files the agent left in its sandbox beyond the world's
    foreign_notes_seen: int  # notes of other trials found in the sandbox (must be 0)
    behavior_version: int


class Reward(Record):
    trial_id: str
    prompt: int
    world_id: str
    docs_read: list[int]
    verified: bool
    components: dict[str, float]
    score: float
    reward: float  # verified + score


class TabularWeights(Record):
    """The secret_search policy: per world, a prior over its documents."""

    version: int
    doc_prior: dict[str, list[float]]


class TabularTrainStats(TrainedFrom):
    groups: int
    groups_with_signal: int
    samples_used: int
    grad_norm: float
