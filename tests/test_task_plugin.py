"""A third task, registered from this test alone: a multi-armed bandit with a fixed payout table.

It is what a new task's author writes after reading `dagster_rl/core/task.py`, and nothing else of the
generic layer changes: an experiment class, a loop, a scorer, a rollout and a trainer backend,
and one `register(...)` call. It then runs through the real driver like the shipped tasks.
"""

import math
import random
from typing import Literal

from dagster_rl.base.hashing import cache_key, canonical_json, seed_of
from dagster_rl.base.retries import Limits
from dagster_rl.base.strict import Strict
from dagster_rl.core.advantages import group_normalized_advantages
from dagster_rl.core.checks import step_checks, weights_finite
from dagster_rl.core.experiment import Experiment, step_key
from dagster_rl.core.records import STATS, Record, Rewards, Rollouts, TrainedFrom
from dagster_rl.core.steps import Judged, mean, rewards_key, step_rewards, trained_from, trial_set, weights_key
from dagster_rl.core.task import Backends, StepResult, Task, Weights, register
from dagster_rl.store.artifact_store import DATA, ArtifactStore
from tests.harness import CHAIN


class BanditTask(Strict):
    kind: Literal["bandit"] = "bandit"
    payouts: tuple[float, ...] = (0.1, 0.5, 0.9)  # the reward of each arm


class Payout(Strict):
    name: str = "payout"
    max_reward: float = 1.0


class BanditExperiment(Experiment):
    task: BanditTask
    rubric: Payout = Payout()
    learning_rate: float = 1.0


class Pull(Record):
    trial_id: str
    prompt: int
    arm: int


class PullReward(Record):
    trial_id: str
    prompt: int
    reward: float


class ArmLogits(Record):
    version: int
    logits: list[float]


def softmax(logits: list[float]) -> list[float]:
    exps = [math.exp(x - max(logits)) for x in logits]
    return [e / sum(exps) for e in exps]


class Pulls:  # the rollout backend: one seeded pull per trial
    def __init__(self, limits: Limits):
        self.limits = limits

    def pull(self, trial_id: str, prompt: int, seed: int, weights: ArmLogits) -> Pull:
        arm = random.Random(seed).choices(range(len(weights.logits)), softmax(weights.logits))[0]
        return Pull(trial_id=trial_id, prompt=prompt, arm=arm)


class Reinforce:  # the trainer backend: REINFORCE with GRPO advantages on the arm logits
    def __init__(self, limits: Limits):
        self.limits = limits

    def train(self, exp: BanditExperiment, weights: ArmLogits, pulls: list[Pull], rewards: list[PullReward]) -> ArmLogits:
        advantages = group_normalized_advantages([r.prompt for r in rewards], [r.reward for r in rewards])
        probs, arms = softmax(weights.logits), {p.trial_id: p.arm for p in pulls}
        grad = [0.0] * len(probs)
        for r, a in zip(rewards, advantages, strict=True):
            for i, p in enumerate(probs):
                grad[i] += a * ((i == arms[r.trial_id]) - p) / len(rewards)
        return ArmLogits(
            version=weights.version + 1, logits=[x + exp.learning_rate * g for x, g in zip(weights.logits, grad, strict=True)]
        )


class BanditLoop:
    def initial_weights(self, exp: BanditExperiment, store: ArtifactStore) -> Weights[ArmLogits]:
        uniform = ArmLogits(version=0, logits=[0.0] * len(exp.task.payouts))
        return Weights(
            "initial", store.put_model("weights", cache_key("weights", "bandit-0", task=exp.task), uniform), uniform, 0
        )

    def load_weights(self, exp: BanditExperiment, store: ArtifactStore, partition: str, key: str) -> Weights[ArmLogits]:
        stored = store.get_model("weights", key, ArmLogits)
        return Weights(partition, store.ref("weights", key), stored, stored.version)

    def iter_steps(self, exp, steps, start, store, backends: Backends, warn):
        weights = start
        for step in steps:
            trials = [
                (f"s{step}-p{p}-n{n}", p, seed_of(exp.seed, step, p, n))
                for p in range(exp.prompts_per_step)
                for n in range(exp.n_samples)
            ]
            stored = trial_set(  # trial by trial: a failed pull is never cached as a result
                store,
                "rollouts",
                cache_key("rollouts", "bandit-1", task=exp.task, seed=exp.seed, step=step, behavior=weights.ref.content_hash),
                Rollouts[Pull],
                [t for t, _, _ in trials],
                lambda pending, trials=trials, weights=weights: [
                    backends.rollout.pull(t, p, s, weights.payload) for t, p, s in trials if t in pending
                ],
                lambda pulls, failed, step=step, weights=weights, trials=trials: Rollouts[Pull](
                    step=step, behavior_policy=weights.lineage(), n_trials_planned=len(trials), trajectories=pulls, skipped=failed
                ),
                warn,
            )
            rollouts, rollouts_ref, rollouts_hit = stored.value, stored.ref, stored.hit
            key = rewards_key("bandit-1", backends.judge, rollouts_ref, task=exp.task)
            scored = step_rewards(store, exp, key, stored, Judged(), backends.judge, warn, Rewards[PullReward])
            rewards, rewards_ref, rewards_hit = scored.value, scored.ref, scored.hit
            key = weights_key("bandit-1", exp, weights.ref, rewards_ref, lr=exp.learning_rate)
            files, weights_ref, weights_hit = store.get_or_put_files(  # the logits, and what trained them (step, experiment)
                "weights", key, lambda step=step, weights=weights, rollouts=rollouts, rewards=rewards, rewards_ref=rewards_ref: {
                    DATA: canonical_json(backends.trainer.train(exp, weights.payload, rollouts.trajectories, rewards.rewards)),
                    STATS: canonical_json(TrainedFrom(**trained_from(exp, step, weights, rewards_ref))),
                },
            )  # fmt: skip
            trained = ArmLogits.model_validate_json(files[DATA])
            weights = Weights(step_key(step), weights_ref, trained, trained.version)
            finite = weights_finite(sum(not math.isfinite(x) for x in trained.logits), "")
            yield StepResult(
                step=step, n_trials=len(rewards.rewards), n_trials_planned=len(trials),
                mean_reward=mean([r.reward for r in rewards.rewards]),
                success_rate=mean([float(p.arm == len(exp.task.payouts) - 1) for p in rollouts.trajectories]),
                weights_version=trained.version,
                cache={"rollouts": "hit" if rollouts_hit else "miss", "rewards": "hit" if rewards_hit else "miss", "weights": "hit" if weights_hit else "miss"},
                refs={"rollouts": rollouts_ref, "rewards": rewards_ref, "weights": weights_ref},
                behavior_policy=rollouts.behavior_policy, skipped_trials=rewards.skipped, trials_executed=0 if rollouts_hit else len(trials),
                judge_calls=0 if rewards_hit else len(trials), metrics={"p_best_arm": softmax(trained.logits)[-1]}, timings={},
                checks=step_checks(exp, finite, rewards.rewards, len(trials)),
            )  # fmt: skip


def payout(exp: BanditExperiment, pull: Pull) -> PullReward:
    return PullReward(trial_id=pull.trial_id, prompt=pull.prompt, reward=exp.task.payouts[pull.arm])


register(
    Task(
        kind="bandit",
        experiment=BanditExperiment,
        loop=BanditLoop,
        score=payout,
        rollout={"in_process": lambda exp, env: Pulls(env.limits)},
        trainer={"in_process": lambda exp, env: Reinforce(env.limits)},
    )
)

BANDIT = {"name": "bandit", "n_steps": 3, "prompts_per_step": 4, "n_samples": 8, "task": {"kind": "bandit"}}


def test_a_task_registered_by_a_test_runs_three_steps_through_the_driver(lab):
    bandit = lab("bandit", BANDIT)
    assert bandit.run("bandit", "0000", "0002").success
    for asset in CHAIN:
        assert [e.asset_materialization.partition for e in bandit.events("bandit", asset)] == ["0000", "0001", "0002"]
    md = [bandit.latest("bandit", "weights", s) for s in ("0000", "0001", "0002")]
    assert [m["weights_version"] for m in md] == [1, 2, 3]
    assert md[0]["n_trials"] == 32 and md[0]["cache"] == "miss"
    p_best = [m["p_best_arm"] for m in md]
    assert 1 / 3 < p_best[0] < p_best[1] < p_best[2], p_best  # the best arm gains probability every step
    assert bandit.latest("bandit", "rollouts", "0001")["behavior_policy"]["partition"] == "0000"
    assert all(e.passed for e in bandit.check_evaluations("bandit", "rewards_in_bounds"))

    assert bandit.run("bandit", "0000", "0002").success  # a second run reuses every artifact
    assert all(bandit.latest("bandit", a, s)["cache"] == "hit" for a in CHAIN for s in ("0000", "0001", "0002"))
    assert bandit.run("bandit", "0002", "0002").success  # a range that starts from a materialized step's weights
