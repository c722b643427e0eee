"""Trace a checkpoint back to step 0: weights <- rewards <- rollouts <- behavior weights <- ...

Walks the artifact store alone: every weights artifact names the rewards and previous weights it was
trained from, every rewards artifact its rollouts, every rollouts artifact its behavior policy.
"""

import json

from pydantic import BaseModel

from dagster_rl.core.hashing import content_hash
from dagster_rl.core.records import STATS
from dagster_rl.store.artifact_store import DATA, ArtifactStore


class StepLineage(BaseModel):
    step: int
    experiment: str | None  # the cache family that trained the weights (None: stored before it was recorded)
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
    """The chain from `weights_key` back to the initial weights, newest step first.

    Reads the lineage fields every task's artifacts share, so it serves every task kind.
    """
    chain: list[StepLineage] = []
    key = weights_key
    while True:
        files = store.get_all("weights", key)
        if STATS not in files:  # the initial weights: nothing trained them
            return chain
        stats = json.loads(files[STATS])
        rewards = json.loads(store.get("rewards", stats["rewards_key"], DATA))
        rollouts = json.loads(store.get("rollouts", rewards["rollouts_key"], DATA))
        version = stats["version"] if "version" in stats else json.loads(files[DATA])["version"]
        chain.append(
            StepLineage(
                step=stats["step"],
                experiment=stats.get("experiment"),
                weights_key=key,
                weights_hash=store.ref("weights", key).content_hash,
                weights_version=version,
                rewards_key=stats["rewards_key"],
                rewards_hash=stats["rewards_hash"],
                rubric=rewards["rubric"],
                rollouts_key=rewards["rollouts_key"],
                rollouts_hash=rewards["rollouts_hash"],
                behavior_policy=rollouts["behavior_policy"],
                n_trajectories=len(rollouts["trajectories"]),
                skipped=rollouts["skipped"],
                seeds={t["trial_id"]: t["seed"] for t in rollouts["trajectories"]},
            )
        )
        key = stats["prev_weights_key"]
