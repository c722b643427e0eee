"""The secret_search loop, one step at a time, cached by content: generate, judge, train.

Every trial of a step runs concurrently in its own sandbox, and each trajectory is judged the
moment it lands. Every artifact is stored under a key that hashes its code version, the settings
that affect it and the content hashes of its inputs; a key that exists is loaded, not recomputed.
The tabular update is instant, so steps run one after another (nothing to overlap).
"""

import logging
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed

from dagster_rl import counters
from dagster_rl.checks import require_enough_trials, step_checks
from dagster_rl.experiment import step_key
from dagster_rl.hashing import cache_key, canonical_json, seed_of
from dagster_rl.records import STATS, Rewards, Rollouts
from dagster_rl.retries import AttemptsExhausted
from dagster_rl.secret_search.backends import SandboxRollouts, TabularTrainer
from dagster_rl.secret_search.experiment import SecretSearchExperiment as Exp
from dagster_rl.secret_search.prior import uniform
from dagster_rl.secret_search.records import Reward, TabularTrainStats, TabularWeights, Trajectory, TrialSpec
from dagster_rl.secret_search.update import prior_finite
from dagster_rl.secret_search.world import WORLD_CODE_VERSION, build_world, world_ids
from dagster_rl.steps import by_trial, collect_rewards, mean, rewards_key, rollouts_key, step_rewards
from dagster_rl.store import DATA, ArtifactRef, ArtifactStore
from dagster_rl.task import Backends, JudgeBackend, StepResult, Warn, Weights

CODE_VERSIONS = {
    "initial": "tabular-uniform-1",
    "rollouts": "secret-search-agent-1",
    "rewards": "verifier-rubric-1",
    "weights": "tabular-grpo-1",
}
log = logging.getLogger("dagster_rl")
Worlds = dict[str, tuple[ArtifactRef, dict[str, bytes]]]


def initial_weights(exp: Exp, store: ArtifactStore) -> Weights[TabularWeights]:
    """Uniform priors: deterministic, so step 0's inputs hash the same in every run."""
    uniform_priors = TabularWeights(version=0, doc_prior={w: uniform(exp.task.n_docs) for w in world_ids(exp.task.n_worlds)})
    key = cache_key("weights", CODE_VERSIONS["initial"], task=exp.task)
    return Weights("initial", store.put_model("weights", key, uniform_priors), uniform_priors, 0)


def load_weights(store: ArtifactStore, partition: str, key: str) -> Weights[TabularWeights]:
    stored = store.get_model("weights", key, TabularWeights)
    return Weights(partition, store.ref("weights", key), stored, stored.version)


def ensure_worlds(exp: Exp, store: ArtifactStore) -> Worlds:
    worlds = {}
    for w in world_ids(exp.task.n_worlds):
        key = cache_key("world", WORLD_CODE_VERSION, world_id=w, n_docs=exp.task.n_docs)
        files, ref, _ = store.get_or_put_files("worlds", key, lambda w=w: build_world(w, exp.task.n_docs))
        worlds[w] = (ref, files)
    return worlds


def plan_trials(exp: Exp, step: int) -> list[TrialSpec]:
    ids = world_ids(exp.task.n_worlds)
    return [
        TrialSpec(
            trial_id=f"s{step}-p{p}-n{s}", step=step, prompt=p, sample=s, world_id=ids[p % len(ids)], seed=seed_of(exp.seed, step, p, s)
        )
        for p in range(exp.prompts_per_step)
        for s in range(exp.n_samples)
    ]


def run_step(
    exp: Exp, step: int, start: Weights[TabularWeights], store: ArtifactStore, backends: Backends, warn: Warn = log.warning
) -> tuple[StepResult, Weights[TabularWeights]]:
    """Generate, judge and train one step from `start`; reuse every artifact whose key exists."""
    t0, before, timings = time.monotonic(), counters.snapshot(), {}
    worlds = ensure_worlds(exp, store)
    specs = plan_trials(exp, step)
    judged: dict[str, list] = {}  # rewards judged while generating, when the rollouts are new

    def generate() -> Rollouts[Trajectory]:
        trajectories, rewards, skipped, fan_out_s = _fan_out(exp, specs, start, worlds, backends.rollout, backends.judge, warn)
        timings.update(fan_out_s)
        require_enough_trials(exp, step, len(rewards), len(specs), skipped)  # before anything is stored
        judged.update(rewards=rewards, skipped=skipped)
        produced = {t.trial_id for t in trajectories}
        return Rollouts[Trajectory](
            step=step,
            behavior_policy=start.lineage(),
            n_trials_planned=len(specs),
            trajectories=by_trial(trajectories),
            skipped=sorted(t for t in skipped if t not in produced),
        )

    rollouts, rollouts_ref, rollouts_hit = store.get_or_put(
        "rollouts", _rollouts_key(exp, step, start, worlds), Rollouts[Trajectory], generate
    )

    t = time.monotonic()
    rewards, rewards_ref, rewards_hit = store.get_or_put(
        "rewards",
        _rewards_key(exp, rollouts_ref.content_hash, backends.judge),
        Rewards[Reward],
        lambda: step_rewards(exp, rollouts, rollouts_ref, judged, backends.judge, warn, Rewards[Reward]),
    )
    if rollouts_hit and not rewards_hit:  # judged now, not while generating
        timings["judge_s"] = time.monotonic() - t

    def train() -> dict[str, bytes]:
        if exp.faults.step_delay_s:  # fault injection: a step slow enough to be killed in the middle
            time.sleep(exp.faults.step_delay_s)
        t = time.monotonic()
        trained, raw = backends.trainer.train(exp, start.payload, rewards.rewards)
        timings["train_s"] = time.monotonic() - t
        stats = TabularTrainStats(
            step=step,
            groups=int(raw["groups"]),
            groups_with_signal=int(raw["groups_with_signal"]),
            samples_used=int(raw["samples_used"]),
            grad_norm=raw["grad_norm"],
            prev_weights_key=start.ref.key,
            prev_weights_hash=start.ref.content_hash,
            rewards_key=rewards_ref.key,
            rewards_hash=rewards_ref.content_hash,
        )
        return {DATA: canonical_json(trained), STATS: canonical_json(stats)}

    weights_key = cache_key(
        "weights", CODE_VERSIONS["weights"], grpo=exp.grpo, prev=start.ref.content_hash, rewards=rewards_ref.content_hash
    )
    files, weights_ref, weights_hit = store.get_or_put_files("weights", weights_key, train)
    stats = TabularTrainStats.model_validate_json(files[STATS])
    trained = TabularWeights.model_validate_json(files[DATA])
    weights = Weights(step_key(step), weights_ref, trained, trained.version)

    after = counters.snapshot()
    usable = rewards.rewards
    turns = {t.trial_id: t.turns for t in rollouts.trajectories}
    timings["step_s"] = time.monotonic() - t0
    result = StepResult(
        step=step,
        n_trials=len(usable),
        n_trials_planned=len(specs),
        mean_reward=mean([r.reward for r in usable]),
        success_rate=mean([float(r.verified) for r in usable]),
        weights_version=trained.version,
        cache={a: "hit" if hit else "miss" for a, hit in (("rollouts", rollouts_hit), ("rewards", rewards_hit), ("weights", weights_hit))},
        refs={"rollouts": rollouts_ref, "rewards": rewards_ref, "weights": weights_ref},
        behavior_policy=rollouts.behavior_policy,
        skipped_trials=rewards.skipped,
        trials_executed=after.get("trials_executed", 0) - before.get("trials_executed", 0),
        judge_calls=after.get("judge_calls", 0) - before.get("judge_calls", 0),
        metrics={
            "mean_turns": mean([float(turns[r.trial_id]) for r in usable]),
            "groups_with_signal": float(stats.groups_with_signal),
            "grad_norm": stats.grad_norm,
        },
        timings=timings,
        checks=step_checks(exp, prior_finite(trained), usable, len(specs)),
    )
    return result, weights


def _fan_out(
    exp: Exp,
    specs: list[TrialSpec],
    start: Weights[TabularWeights],
    worlds: Worlds,
    rollout: SandboxRollouts,
    judge: JudgeBackend,
    warn: Warn,
) -> tuple[list[Trajectory], list[Reward], list[str], dict[str, float]]:
    """Run every trial concurrently and judge each trajectory the moment it lands."""
    t0 = time.monotonic()
    trajectories, skipped = [], []
    with ThreadPoolExecutor(rollout.limits.max_concurrency) as gen_pool, ThreadPoolExecutor(judge.limits.max_concurrency) as judge_pool:
        gens = {gen_pool.submit(rollout.run, exp, s, start.payload, worlds[s.world_id][1]): s for s in specs}
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
        generate_s = time.monotonic() - t0
        rewards, judge_skipped = collect_rewards(judging, warn)
    return trajectories, rewards, skipped + judge_skipped, {"generate_s": generate_s, "judge_s": time.monotonic() - t0}


def _rollouts_key(exp: Exp, step: int, behavior: Weights, worlds: Worlds) -> str:
    worlds_hashes = {w: ref.content_hash for w, (ref, _) in worlds.items()}
    return rollouts_key(CODE_VERSIONS["rollouts"], exp, step, behavior.ref.content_hash, worlds=worlds_hashes)


def _rewards_key(exp: Exp, rollouts_hash: str, judge: JudgeBackend) -> str:
    return rewards_key(CODE_VERSIONS["rewards"], judge, rubric=exp.rubric, max_turns=exp.task.max_turns, rollouts=rollouts_hash)


class SecretSearchLoop:
    def initial_weights(self, exp: Exp, store: ArtifactStore) -> Weights[TabularWeights]:
        return initial_weights(exp, store)

    def load_weights(self, exp: Exp, store: ArtifactStore, partition: str, key: str) -> Weights[TabularWeights]:
        return load_weights(store, partition, key)

    def iter_steps(
        self, exp: Exp, steps: Sequence[int], start: Weights[TabularWeights], store: ArtifactStore, backends: Backends, warn: Warn
    ) -> Iterator[StepResult]:
        weights = start
        for step in steps:
            result, weights = run_step(exp, step, weights, store, backends, warn)
            yield result
