"""Trace a checkpoint back to step 0: weights <- rewards <- rollouts <- behavior weights <- ...

Walks the artifact store alone: every weights artifact names the rewards and previous weights it was
trained from, every rewards artifact its rollouts, every rollouts artifact its behavior policy.
"""

from pydantic import BaseModel

from dagster_rl.hashing import content_hash
from dagster_rl.records import Rewards, Rollouts, TabularWeights, TrainStats
from dagster_rl.store import DATA, ArtifactStore

STATS = "stats.json"


class StepLineage(BaseModel):
    step: int
    weights_key: str
    weights_hash: str
    weights_version: int
    rewards_key: str
    rewards_hash: str
    rubric: dict
    rollouts_key: str
    rollouts_hash: str
    behavior_policy: dict
    n_trajectories: int
    skipped: list[str]
    seeds: dict[str, int]  # trial id -> seed

    @property
    def seeds_hash(self) -> str:
        return content_hash(self.seeds)


def trace(store: ArtifactStore, weights_key: str) -> list[StepLineage]:
    """The chain from `weights_key` back to the initial weights, newest step first."""
    chain = []
    key = weights_key
    while True:
        files = store.get_all("weights", key)
        if STATS not in files:  # the initial weights: nothing trained them
            return chain
        stats = TrainStats.model_validate_json(files[STATS])
        weights = TabularWeights.model_validate_json(files[DATA])
        rewards = store.get_model("rewards", stats.rewards_key, Rewards)
        rollouts = store.get_model("rollouts", rewards.rollouts_key, Rollouts)
        chain.append(
            StepLineage(
                step=stats.step,
                weights_key=key,
                weights_hash=store.ref("weights", key).content_hash,
                weights_version=weights.version,
                rewards_key=stats.rewards_key,
                rewards_hash=stats.rewards_hash,
                rubric=rewards.rubric,
                rollouts_key=rewards.rollouts_key,
                rollouts_hash=rewards.rollouts_hash,
                behavior_policy=rollouts.behavior_policy,
                n_trajectories=len(rollouts.trajectories),
                skipped=rollouts.skipped,
                seeds={t.trial_id: t.seed for t in rollouts.trajectories},
            )
        )
        key = stats.prev_weights_key
