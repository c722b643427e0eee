"""The records that flow through a step: trial specs, trajectories, rewards, weights, artifacts."""

from pydantic import BaseModel, ConfigDict


class Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


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


class Rollouts(Record):
    step: int
    behavior_policy: dict[str, str | int]  # weights partition, key, content hash, version
    n_trials_planned: int
    trajectories: list[Trajectory]  # sorted by trial id
    skipped: list[str]


class Rewards(Record):
    step: int
    rollouts_key: str
    rollouts_hash: str
    rubric: dict[str, str | float]
    rewards: list[Reward]  # sorted by trial id
    skipped: list[str]


class TrainStats(Record):
    step: int
    groups: int
    groups_with_signal: int
    samples_used: int
    grad_norm: float
    prev_weights_key: str
    prev_weights_hash: str
    rewards_key: str
    rewards_hash: str
