"""The secret_search training loop, one step at a time, cached by content: generate, judge, train.

`run_step` is what the Dagster driver calls (through `SecretSearchLoop.iter_steps`) for every
partition and what a plain Python loop calls in the benchmark. Every artifact is stored under a key
that hashes its code version, the settings that affect it and the content hashes of its inputs; a
key that exists is loaded, not recomputed.
"""

import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed

from dagster_rl import counters
from dagster_rl.checks import prior_finite, step_checks
from dagster_rl.environments import InProcessTrainer, RubricJudge, SandboxRollouts
from dagster_rl.experiment import SecretSearchExperiment as Experiment
from dagster_rl.experiment import step_key
from dagster_rl.hashing import cache_key, canonical_json, seed_of
from dagster_rl.loop import (
    STATS,
    Engines,
    Policy,
    StepResult,
    Warn,
    collect_rewards,
    judge_all,
    mean,
    require_enough_trials,
    rewards_key,
)
from dagster_rl.records import Reward, Rewards, Rollouts, TabularWeights, Trajectory, TrainStats, TrialSpec
from dagster_rl.retries import AttemptsExhausted
from dagster_rl.secret_search.prior import uniform
from dagster_rl.secret_search.world import WORLD_CODE_VERSION, build_world, world_ids
from dagster_rl.store import DATA, ArtifactRef, ArtifactStore

CODE_VERSIONS = {
    "initial": "tabular-uniform-1",
    "rollouts": "secret-search-agent-1",
    "rewards": "verifier-rubric-1",
    "weights": "tabular-grpo-1",
}
log = logging.getLogger("dagster_rl")


def initial_policy(exp: Experiment, store: ArtifactStore) -> Policy:
    """Uniform priors: deterministic, so step 0's inputs hash the same in every run."""
    weights = TabularWeights(
        version=0, doc_prior={w: uniform(exp.task.n_docs) for w in world_ids(exp.task.n_worlds)}
    )
    key = cache_key("weights", CODE_VERSIONS["initial"], task=exp.task)
    return Policy("initial", store.put_model("weights", key, weights), weights, weights.version)


def load_policy(store: ArtifactStore, partition: str, key: str) -> Policy:
    weights = store.get_model("weights", key, TabularWeights)
    return Policy(partition, store.ref("weights", key), weights, weights.version)


def ensure_worlds(exp: Experiment, store: ArtifactStore) -> dict[str, tuple[ArtifactRef, dict[str, bytes]]]:
    worlds = {}
    for w in world_ids(exp.task.n_worlds):
        key = cache_key("world", WORLD_CODE_VERSION, world_id=w, n_docs=exp.task.n_docs)
        ref = store.ref("worlds", key) if store.exists("worlds", key) else store.put("worlds", key, build_world(w, exp.task.n_docs))
        worlds[w] = (ref, store.get_all("worlds", key))
    return worlds


def plan_trials(exp: Experiment, step: int) -> list[TrialSpec]:
    ids = world_ids(exp.task.n_worlds)
    return [
        TrialSpec(
            trial_id=f"s{step}-p{p}-n{s}",
            step=step,
            prompt=p,
            sample=s,
            world_id=ids[p % len(ids)],
            seed=seed_of(exp.seed, step, p, s),
        )
        for p in range(exp.prompts_per_step)
        for s in range(exp.n_samples)
    ]


def _fan_out(
    exp: Experiment,
    specs: list[TrialSpec],
    policy: Policy,
    worlds: dict[str, tuple[ArtifactRef, dict[str, bytes]]],
    rollout: SandboxRollouts,
    judge: RubricJudge,
    warn: Callable[[str], None],
) -> tuple[list[Trajectory], list[Reward], list[str], dict[str, float]]:
    """Run every trial concurrently and judge each trajectory the moment it lands."""
    start = time.monotonic()
    trajectories, rewards, skipped = [], [], []
    with ThreadPoolExecutor(rollout.limits.max_concurrency) as gen_pool, ThreadPoolExecutor(judge.limits.max_concurrency) as judge_pool:
        gens = {gen_pool.submit(rollout.run, exp, s, policy.weights, worlds[s.world_id][1]): s for s in specs}
        judging = {}
        for fut in as_completed(gens):
            try:
                traj = fut.result()
            except AttemptsExhausted as e:
                warn(f"trial failed after its retries, skipped: {e}")
                skipped.append(gens[fut].trial_id)
                continue
            trajectories.append(traj)
            judging[judge_pool.submit(judge.judge, exp, traj)] = traj.trial_id
        generate_s = time.monotonic() - start
        rewards, judge_skipped = collect_rewards(judging, warn)
    return trajectories, rewards, skipped + judge_skipped, {"generate_s": generate_s, "judge_s": time.monotonic() - start}


def _by_trial(items: list) -> list:
    """Canonical order: completion order differs between attempts; sorted inputs hash the same."""
    return sorted(items, key=lambda x: x.trial_id)


def _rollouts_key(exp: Experiment, step: int, policy: Policy, worlds: dict) -> str:
    return cache_key(
        "rollouts",
        CODE_VERSIONS["rollouts"],
        task=exp.task,
        seed=exp.seed,
        step=step,
        prompts_per_step=exp.prompts_per_step,
        n_samples=exp.n_samples,
        behavior=policy.ref.content_hash,
        worlds={w: ref.content_hash for w, (ref, _) in worlds.items()},
    )


def run_step(
    exp: Experiment,
    step: int,
    policy: Policy,
    store: ArtifactStore,
    rollout: SandboxRollouts,
    judge: RubricJudge,
    trainer: InProcessTrainer,
    warn: Callable[[str], None] = log.warning,
) -> tuple[StepResult, Policy]:
    """Generate, judge and train one step from `policy`; reuse every artifact whose key exists."""
    t0 = time.monotonic()
    before = counters.snapshot()
    worlds = ensure_worlds(exp, store)
    specs = plan_trials(exp, step)
    cache: dict[str, str] = {}
    timings: dict[str, float] = {}

    rollouts_key = _rollouts_key(exp, step, policy, worlds)
    judged: list[Reward] | None = None
    if store.exists("rollouts", rollouts_key):
        cache["rollouts"] = "hit"
        rollouts = store.get_model("rollouts", rollouts_key, Rollouts)
        skipped = list(rollouts.skipped)
    else:
        cache["rollouts"] = "miss"
        trajectories, judged, skipped, timings = _fan_out(exp, specs, policy, worlds, rollout, judge, warn)
        produced = {t.trial_id for t in trajectories}
        rollouts = Rollouts(
            step=step,
            behavior_policy=policy.lineage(),
            n_trials_planned=len(specs),
            trajectories=_by_trial(trajectories),
            skipped=sorted(t for t in skipped if t not in produced),
        )

    rewards_key = None
    if judged is None:
        rewards_key = _rewards_key(exp, store.ref("rollouts", rollouts_key).content_hash, judge)
        if store.exists("rewards", rewards_key):
            cache["rewards"] = "hit"
            rewards = store.get_model("rewards", rewards_key, Rewards)
        else:
            t = time.monotonic()
            judged, judge_skipped = judge_all(exp, rollouts.trajectories, judge, warn)
            skipped = sorted(set(skipped) | set(judge_skipped))
            timings["judge_s"] = time.monotonic() - t
    if judged is not None:
        cache["rewards"] = "miss"
        require_enough_trials(exp, step, len(judged), len(specs), skipped)
        rollouts_ref = store.put_model("rollouts", rollouts_key, rollouts)
        rewards_key = _rewards_key(exp, rollouts_ref.content_hash, judge)
        rewards = Rewards(
            step=step,
            rollouts_key=rollouts_key,
            rollouts_hash=rollouts_ref.content_hash,
            rubric=exp.rubric.model_dump(),
            rewards=_by_trial(judged),
            skipped=sorted(skipped),
        )
        if store.exists("rewards", rewards_key):  # same rollouts judged before: keep what was stored
            cache["rewards"] = "hit"
            rewards = store.get_model("rewards", rewards_key, Rewards)
        else:
            store.put_model("rewards", rewards_key, rewards)
    rewards_ref = store.ref("rewards", rewards_key)

    weights_key = cache_key(
        "weights", CODE_VERSIONS["weights"], grpo=exp.grpo, prev=policy.ref.content_hash, rewards=rewards_ref.content_hash
    )
    if store.exists("weights", weights_key):
        cache["weights"] = "hit"
        stats = TrainStats.model_validate_json(store.get("weights", weights_key, STATS))
    else:
        cache["weights"] = "miss"
        if exp.faults.step_delay_s:  # fault injection: a step slow enough to be killed in the middle
            time.sleep(exp.faults.step_delay_s)
        t = time.monotonic()
        new_weights, raw = trainer.train(exp, policy.weights, rewards.rewards)
        timings["train_s"] = time.monotonic() - t
        stats = TrainStats(
            step=step,
            groups=int(raw["groups"]),
            groups_with_signal=int(raw["groups_with_signal"]),
            samples_used=int(raw["samples_used"]),
            grad_norm=raw["grad_norm"],
            prev_weights_key=policy.ref.key,
            prev_weights_hash=policy.ref.content_hash,
            rewards_key=rewards_key,
            rewards_hash=rewards_ref.content_hash,
        )
        store.put("weights", weights_key, {DATA: canonical_json(new_weights), STATS: canonical_json(stats)})
    new_policy = load_policy(store, step_key(step), weights_key)

    after = counters.snapshot()
    usable = rewards.rewards
    by_trial = {t.trial_id: t for t in rollouts.trajectories}
    timings["step_s"] = time.monotonic() - t0
    result = StepResult(
        step=step,
        n_trials=len(usable),
        n_trials_planned=len(specs),
        mean_reward=mean([r.reward for r in usable]),
        success_rate=mean([float(r.verified) for r in usable]),
        weights_version=new_policy.weights.version,
        cache=cache,
        refs={
            "rollouts": store.ref("rollouts", rollouts_key),
            "rewards": rewards_ref,
            "weights": new_policy.ref,
        },
        behavior_policy=rollouts.behavior_policy,
        skipped_trials=rewards.skipped,
        trials_executed=after.get("trials_executed", 0) - before.get("trials_executed", 0),
        judge_calls=after.get("judge_calls", 0) - before.get("judge_calls", 0),
        metrics={
            "mean_turns": mean([float(by_trial[r.trial_id].turns) for r in usable]),
            "groups_with_signal": float(stats.groups_with_signal),
            "grad_norm": stats.grad_norm,
        },
        timings=timings,
        checks=step_checks(exp, prior_finite(new_policy.weights), usable, len(specs)),
    )
    return result, new_policy


def _rewards_key(exp: Experiment, rollouts_hash: str, judge: object) -> str:
    return rewards_key(CODE_VERSIONS["rewards"], judge, rubric=exp.rubric, max_turns=exp.task.max_turns, rollouts=rollouts_hash)


class SecretSearchLoop:
    """Steps run one after another: the tabular update is instant, there is nothing to overlap."""

    def initial_policy(self, exp: Experiment, store: ArtifactStore) -> Policy:
        return initial_policy(exp, store)

    def load_policy(self, exp: Experiment, store: ArtifactStore, partition: str, key: str) -> Policy:
        return load_policy(store, partition, key)

    def iter_steps(
        self, exp: Experiment, steps: list[int], policy: Policy, store: ArtifactStore, engines: Engines, warn: Warn
    ) -> Iterator[StepResult]:
        for step in steps:
            result, policy = run_step(exp, step, policy, store, engines.rollout, engines.judge, engines.trainer, warn)
            yield result
