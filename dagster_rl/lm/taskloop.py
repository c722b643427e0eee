"""The language-model training loop: generate, judge, train, evaluate, cached by content.

With `max_policy_lag: 1` generation of step k+1 (with the weights of step k-1) runs in a thread
while step k trains; the loss's clipped importance ratio against the recorded sampling
log-probabilities corrects for the stale behavior policy. Held-out evaluation of step k runs in
another thread and is awaited after step k+1 trains.
"""

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from safetensors.torch import load as load_safetensors

from dagster_rl import counters
from dagster_rl.checks import step_checks, tensors_finite
from dagster_rl.experiment import step_key
from dagster_rl.hashing import cache_key, canonical_json
from dagster_rl.lm.experiment import LMExperiment
from dagster_rl.lm.loop import evaluate
from dagster_rl.lm.policy import ADAPTER, checkpoint_bytes, load_policy, read_state
from dagster_rl.lm.rewards import LMReward
from dagster_rl.lm.rollout_hf import LMRollout, plan_requests
from dagster_rl.lm.tasks import PromptSet, load_prompt_set, prompts_for_step
from dagster_rl.loop import (
    STATS,
    Engines,
    EvaluationResult,
    Policy,
    StepResult,
    Warn,
    judge_all,
    mean,
    require_enough_trials,
    rewards_key,
)
from dagster_rl.records import Record
from dagster_rl.retries import AttemptsExhausted
from dagster_rl.store import ArtifactRef, ArtifactStore

CODE_VERSIONS = {
    "initial": "lora-init-1",
    "rollouts": "hf-rollouts-1",
    "rewards": "lm-rubric-1",
    "weights": "grpo-lora-1",
    "evaluation": "greedy-eval-1",
}


class LMRollouts(Record):
    step: int
    behavior_policy: dict[str, str | int]
    n_trials_planned: int
    trajectories: list[LMRollout]  # sorted by trial id
    skipped: list[str]


class LMRewards(Record):
    step: int
    rollouts_key: str
    rollouts_hash: str
    rubric: dict[str, str | float]
    rewards: list[LMReward]  # sorted by trial id
    skipped: list[str]


class LMTrainStats(Record):
    step: int
    version: int
    prev_weights_key: str
    prev_weights_hash: str
    rewards_key: str
    rewards_hash: str
    metrics: dict[str, float]


class Evaluation(Record):
    weights_hash: str
    n: int
    accuracy: float
    mean_reward: float


@dataclass
class Generated:
    """A step's rollouts and rewards, stored."""

    rollouts: LMRollouts
    rollouts_ref: ArtifactRef
    rewards: LMRewards
    rewards_ref: ArtifactRef
    cache: dict[str, str]
    trials: int
    judge_calls: int
    seconds: float


def _checkpoint(files: dict[str, bytes]) -> dict[str, bytes]:
    return {k: v for k, v in files.items() if k != STATS}


class LMLoop:
    def initial_policy(self, exp: LMExperiment, store: ArtifactStore) -> Policy:
        """A fresh adapter (LoRA B = 0: the base model), the same in every run."""
        key = cache_key("weights", CODE_VERSIONS["initial"], policy=exp.policy)
        if not store.exists("weights", key):
            store.put("weights", key, checkpoint_bytes(load_policy(exp.policy), None))
        return self.load_policy(exp, store, "initial", key)

    def load_policy(self, exp: LMExperiment, store: ArtifactStore, partition: str, key: str) -> Policy:
        files = _checkpoint(store.get_all("weights", key))
        return Policy(partition, store.ref("weights", key), files, read_state(files)["version"])

    def _trained_from(self, exp: LMExperiment, store: ArtifactStore, policy: Policy, step: int) -> Policy:
        """The weights `policy` was trained from (the behavior policy of a lagged step)."""
        if policy.partition == "initial":
            return policy
        stats = LMTrainStats.model_validate_json(store.get("weights", policy.ref.key, STATS))
        partition = step_key(step) if step >= 0 else "initial"
        return self.load_policy(exp, store, partition, stats.prev_weights_key)

    def iter_steps(
        self, exp: LMExperiment, steps: list[int], policy: Policy, store: ArtifactStore, engines: Engines, warn: Warn
    ) -> Iterator[StepResult | EvaluationResult]:
        prompts = load_prompt_set(exp.task.source)
        lag, first, last = exp.max_policy_lag, steps[0], steps[-1]
        weights = {first - 1: policy}  # step -> the weights it produced; -1: initial
        if lag and first - 2 >= -1:
            weights[first - 2] = self._trained_from(exp, store, policy, first - 2)
        base = self.initial_policy(exp, store)

        def behavior(k: int) -> Policy:
            return weights[max(k - 1 - lag, -1)]

        threads = torch.get_num_threads()
        torch.set_num_threads(exp.generation_threads)
        try:
            with ThreadPoolExecutor(1, "generate") as gen_pool, ThreadPoolExecutor(1, "evaluate") as eval_pool:
                generating = gen_pool.submit(self._generate, exp, first, behavior(first), prompts, store, engines, warn)
                evaluating: list = []
                for k in steps:
                    gen = generating.result()
                    if lag and k < last:  # step k+1 generates with the weights of step k-1 while step k trains
                        generating = gen_pool.submit(self._generate, exp, k + 1, behavior(k + 1), prompts, store, engines, warn)
                    result, weights[k] = self._train(exp, k, weights[k - 1], gen, store, engines)
                    if not lag and k < last:
                        generating = gen_pool.submit(self._generate, exp, k + 1, behavior(k + 1), prompts, store, engines, warn)
                    yield result
                    while evaluating:  # evaluation of step k-1 is awaited after step k trains
                        yield evaluating.pop(0).result()
                    evaluating.append(eval_pool.submit(self._evaluate, exp, k, weights[k], base, prompts, store))
                for pending in evaluating:
                    yield pending.result()
        finally:
            torch.set_num_threads(threads)

    def _generate(
        self, exp: LMExperiment, step: int, behavior: Policy, prompts: PromptSet, store: ArtifactStore, engines: Engines, warn: Warn
    ) -> Generated:
        t0 = time.monotonic()
        requests = plan_requests(prompts_for_step(prompts.train, exp.seed, step, exp.prompts_per_step), exp.seed, step, exp.n_samples)
        key = cache_key(
            "rollouts",
            CODE_VERSIONS["rollouts"],
            task=exp.task,
            policy=exp.policy,
            sampling=exp.sampling,
            seed=exp.seed,
            step=step,
            prompts_per_step=exp.prompts_per_step,
            n_samples=exp.n_samples,
            behavior=behavior.ref.content_hash,
        )
        cache, trials = {}, 0
        if store.exists("rollouts", key):
            cache["rollouts"] = "hit"
            rollouts = store.get_model("rollouts", key, LMRollouts)
        else:
            cache["rollouts"] = "miss"
            skipped: list[str] = []
            try:
                generated = engines.rollout.generate(exp, requests, behavior.weights, prompts.template)
                trials = len(requests)
            except AttemptsExhausted as e:
                warn(f"generation of step {step_key(step)} failed after its retries: {e}")
                generated, skipped, trials = [], [r.trial_id for r in requests], len(requests)
            rollouts = LMRollouts(
                step=step, behavior_policy=behavior.lineage(), n_trials_planned=len(requests), trajectories=generated, skipped=skipped
            )
        rewards, rewards_ref, rollouts_ref, calls = self._judge(exp, step, key, rollouts, store, engines, warn, cache)
        return Generated(rollouts, rollouts_ref, rewards, rewards_ref, cache, trials, calls, time.monotonic() - t0)

    def _judge(self, exp, step, rollouts_key, rollouts, store, engines, warn, cache):
        """Score every rollout (reusing stored rewards of the same rollouts and rubric)."""
        rollouts_hash = store.ref("rollouts", rollouts_key).content_hash if cache["rollouts"] == "hit" else None
        rewards_key = self._rewards_key(exp, rollouts_hash, engines.judge) if rollouts_hash else None
        if rewards_key and store.exists("rewards", rewards_key):
            cache["rewards"] = "hit"
            return store.get_model("rewards", rewards_key, LMRewards), store.ref("rewards", rewards_key), store.ref("rollouts", rollouts_key), 0
        cache["rewards"] = "miss"
        usable, judge_skipped = judge_all(exp, rollouts.trajectories, engines.judge, warn)
        skipped = list(rollouts.skipped) + judge_skipped
        require_enough_trials(exp, step, len(usable), rollouts.n_trials_planned, skipped)
        rollouts_ref = store.put_model("rollouts", rollouts_key, rollouts)
        rewards_key = self._rewards_key(exp, rollouts_ref.content_hash, engines.judge)
        rewards = LMRewards(
            step=step,
            rollouts_key=rollouts_key,
            rollouts_hash=rollouts_ref.content_hash,
            rubric=exp.rubric.model_dump(),
            rewards=sorted(usable, key=lambda r: r.trial_id),
            skipped=sorted(skipped),
        )
        return rewards, store.put_model("rewards", rewards_key, rewards), rollouts_ref, len(rollouts.trajectories)

    def _rewards_key(self, exp: LMExperiment, rollouts_hash: str, judge: object) -> str:
        return rewards_key(CODE_VERSIONS["rewards"], judge, rubric=exp.rubric, rollouts=rollouts_hash)

    def _train(
        self, exp: LMExperiment, step: int, previous: Policy, gen: Generated, store: ArtifactStore, engines: Engines
    ) -> tuple[StepResult, Policy]:
        t0 = time.monotonic()
        key = cache_key(
            "weights",
            CODE_VERSIONS["weights"],
            grpo=exp.grpo,
            policy=exp.policy,
            world_size=exp.world_size,
            prev=previous.ref.content_hash,
            rewards=gen.rewards_ref.content_hash,
        )
        cache = dict(gen.cache)
        if store.exists("weights", key):
            cache["weights"] = "hit"
            stats = LMTrainStats.model_validate_json(store.get("weights", key, STATS))
            policy = self.load_policy(exp, store, step_key(step), key)
        else:
            cache["weights"] = "miss"
            files, metrics = engines.trainer.train(exp, previous.weights, gen.rollouts.trajectories, gen.rewards.rewards)
            stats = LMTrainStats(
                step=step,
                version=metrics.version,
                prev_weights_key=previous.ref.key,
                prev_weights_hash=previous.ref.content_hash,
                rewards_key=gen.rewards_ref.key,
                rewards_hash=gen.rewards_ref.content_hash,
                metrics={k: float(v) for k, v in metrics.model_dump().items()},
            )
            ref = store.put("weights", key, {**files, STATS: canonical_json(stats)})
            policy = Policy(step_key(step), ref, files, metrics.version)
        rewards = gen.rewards.rewards
        by_trial = {r.trial_id: r for r in gen.rollouts.trajectories}
        tokens = [len(by_trial[r.trial_id].completion_token_ids) for r in rewards]
        result = StepResult(
            step=step,
            n_trials=len(rewards),
            n_trials_planned=gen.rollouts.n_trials_planned,
            mean_reward=mean([r.reward for r in rewards]),
            success_rate=mean([float(r.correct) for r in rewards]),
            weights_version=policy.version,
            cache=cache,
            refs={"rollouts": gen.rollouts_ref, "rewards": gen.rewards_ref, "weights": policy.ref},
            behavior_policy=gen.rollouts.behavior_policy,
            skipped_trials=gen.rewards.skipped,
            trials_executed=gen.trials,
            judge_calls=gen.judge_calls,
            metrics={
                **{k: stats.metrics[k] for k in ("loss", "ratio", "kl", "clip_frac", "grad_norm", "samples_used", "groups_with_signal")},
                "policy_lag": float(previous.version - int(gen.rollouts.behavior_policy["version"])),
                "mean_completion_tokens": mean([float(t) for t in tokens]),
            },
            timings={"generate_s": gen.seconds, "train_s": time.monotonic() - t0},
            checks=step_checks(exp, tensors_finite(load_safetensors(policy.weights[ADAPTER])), rewards, gen.rollouts.n_trials_planned),
        )
        return result, policy

    def _evaluate(
        self, exp: LMExperiment, step: int, policy: Policy, base: Policy, prompts: PromptSet, store: ArtifactStore
    ) -> EvaluationResult:
        t0 = time.monotonic()
        scored, cache, ref = self._evaluation(exp, policy, prompts, store)
        base_scored, _, _ = self._evaluation(exp, base, prompts, store)
        return EvaluationResult(
            step=step,
            weights_version=policy.version,
            n=scored.n,
            accuracy=scored.accuracy,
            mean_reward=scored.mean_reward,
            base_accuracy=base_scored.accuracy,
            cache=cache,
            ref=ref,
            eval_s=time.monotonic() - t0,
        )

    def _evaluation_key(self, exp: LMExperiment, policy: Policy, prompts: PromptSet) -> str:
        return cache_key(
            "evaluation",
            CODE_VERSIONS["evaluation"],
            weights=policy.ref.content_hash,
            policy=exp.policy,
            prompts=[p.id for p in prompts.eval],
            rubric=exp.rubric,
            max_new_tokens=exp.eval_max_new_tokens,
        )

    def _evaluation(
        self, exp: LMExperiment, policy: Policy, prompts: PromptSet, store: ArtifactStore
    ) -> tuple[Evaluation, str, ArtifactRef]:
        key = self._evaluation_key(exp, policy, prompts)
        if store.exists("evaluations", key):
            return store.get_model("evaluations", key, Evaluation), "hit", store.ref("evaluations", key)
        counters.bump("evaluations")
        result = evaluate(load_policy(exp.policy, policy.weights), prompts, exp.rubric, exp.eval_max_new_tokens)
        evaluation = Evaluation(weights_hash=policy.ref.content_hash, n=result.n, accuracy=result.accuracy, mean_reward=result.mean_reward)
        return evaluation, "miss", store.put_model("evaluations", key, evaluation)
