"""Trace a checkpoint back to step 0: weights <- rewards <- rollouts <- behavior weights <- ...

Walks the artifact store alone: every weights artifact names the rewards and previous weights it was
trained from, every rewards artifact its rollouts, every rollouts artifact its behavior policy. One
trial of the chain (`trial_of`) is its trajectory and its reward as stored: a multi-turn
trajectory's record carries its turns (`dagster_rl.tasks.agent.records.Turn`).
"""

import json

from pydantic import BaseModel

from dagster_rl.base.errors import DagsterRLError
from dagster_rl.base.hashing import content_hash
from dagster_rl.core.records import CALL_TIMES, STATS, CallTimes, call_times_key
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


class TrialLineage(BaseModel):
    """One trial of a chain: the step that sampled it, its trajectory and its reward as stored."""

    step: int
    trial_id: str
    seed: int
    trajectory: dict  # the rollouts record's entry
    reward: dict | None  # the rewards record's entry; None: the trial was skipped (its judging failed)
    call_seconds: list[list[float]] | None = None  # the wall times of its programs, per turn, when it ran any


def trial_of(store: ArtifactStore, chain: list[StepLineage], trial_id: str) -> TrialLineage:
    """The trial `trial_id` of the chain's rollouts, with its reward."""
    for s in chain:
        if trial_id not in s.seeds:
            continue
        trajectories = json.loads(store.get("rollouts", s.rollouts_key, DATA))["trajectories"]
        rewards = json.loads(store.get("rewards", s.rewards_key, DATA))["rewards"]
        trajectory = next(t for t in trajectories if t["trial_id"] == trial_id)
        times = call_times_key(trajectory)
        return TrialLineage(
            step=s.step,
            trial_id=trial_id,
            seed=s.seeds[trial_id],
            trajectory=trajectory,
            reward=next((r for r in rewards if r["trial_id"] == trial_id), None),
            call_seconds=store.get_model(CALL_TIMES, times, CallTimes).seconds if store.exists(CALL_TIMES, times) else None,
        )
    some = sorted(t for s in chain[:1] for t in s.seeds)[:3]
    raise DagsterRLError(
        f"no trial {trial_id!r} in this lineage's rollouts; its trials are named like {', '.join(some) or '(none)'}: "
        "the step's number, the prompt's, the sample's"
    )
