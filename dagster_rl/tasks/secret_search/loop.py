"""The secret_search loop, one step at a time, cached by content: generate, judge, train.

Every trial of a step runs concurrently in its own sandbox, and each trajectory is judged the
moment it lands. Every artifact is stored under a key that hashes its code version, the settings
that affect it and the content hashes of its inputs; a key that exists is loaded, not recomputed.
The tabular update is instant, so steps run one after another (nothing to overlap).
"""

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from functools import partial

from dagster_rl.base import counters
from dagster_rl.base.hashing import cache_key, canonical_json, seed_of
from dagster_rl.base.retries import AttemptsExhausted
from dagster_rl.core.checks import step_checks
from dagster_rl.core.experiment import step_key
from dagster_rl.core.records import STATS, Rewards, Rollouts, TrialFailed
from dagster_rl.core.steps import (
    Judged,
    judge_as_they_land,
    mean,
    recovered,
    rewards_key,
    rollouts_key,
    step_rewards,
    trained_from,
    trial_set,
    weights_key,
)
from dagster_rl.core.task import Backends, JudgeBackend, StepResult, Warn, Weights
from dagster_rl.store.artifact_store import DATA, ArtifactRef, ArtifactStore
from dagster_rl.tasks.secret_search.backends import SecretSearchRolloutBackend, SecretSearchTrainerBackend
from dagster_rl.tasks.secret_search.experiment import SecretSearchExperiment as Exp
from dagster_rl.tasks.secret_search.prior import uniform
from dagster_rl.tasks.secret_search.records import Reward, TabularTrainStats, TabularWeights, Trajectory, TrialSpec
from dagster_rl.tasks.secret_search.update import prior_finite
from dagster_rl.tasks.secret_search.world import WORLD_CODE_VERSION, build_world, world_ids

CODE_VERSIONS = {
    "initial": "tabular-uniform-2",  # 2: keyed by the worlds a step uses (prompts_per_step) and their documents
    "rollouts": "secret-search-agent-2",  # 2: keyed by the behavior weights' key, which the rollouts record
    "rewards": "verifier-rubric-2",  # 2: keyed by the rollouts' key, which the rewards record, besides their content
    "weights": "tabular-grpo-2",  # 2: keyed by the keys of the weights and rewards it was trained from, besides their content
}
log = logging.getLogger("dagster_rl")
Worlds = dict[str, tuple[ArtifactRef, dict[str, bytes]]]
SecretSearchBackends = Backends[SecretSearchRolloutBackend, SecretSearchTrainerBackend]


def initial_weights(exp: Exp, store: ArtifactStore) -> Weights[TabularWeights]:
    """Uniform priors over the worlds a step uses: deterministic, so step 0's inputs hash the same in every run."""
    uniform_priors = TabularWeights(version=0, doc_prior={w: uniform(exp.task.n_docs) for w in used_worlds(exp)})
    key = cache_key("weights", CODE_VERSIONS["initial"], worlds=used_worlds(exp), n_docs=exp.task.n_docs)
    return Weights("initial", store.put_model("weights", key, uniform_priors), uniform_priors, 0)


def load_weights(store: ArtifactStore, partition: str, key: str) -> Weights[TabularWeights]:
    stored = store.get_model("weights", key, TabularWeights)
    return Weights(partition, store.ref("weights", key), stored, stored.version)


def used_worlds(exp: Exp) -> list[str]:
    """The worlds the trials of a step use (prompt p plays world p mod n_worlds): only these are made."""
    return world_ids(exp.task.n_worlds)[: min(exp.task.n_worlds, exp.prompts_per_step)]


def ensure_worlds(exp: Exp, store: ArtifactStore) -> Worlds:
    worlds = {}
    for w in used_worlds(exp):
        key = cache_key("world", WORLD_CODE_VERSION, world_id=w, n_docs=exp.task.n_docs)
        files, ref, _ = store.get_or_put_files("worlds", key, partial(build_world, w, exp.task.n_docs))
        worlds[w] = (ref, files)
    return worlds


def plan_trials(exp: Exp, step: int) -> list[TrialSpec]:
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


def run_step(
    exp: Exp,
    step: int,
    start: Weights[TabularWeights],
    store: ArtifactStore,
    backends: SecretSearchBackends,
    warn: Warn = log.warning,
) -> tuple[StepResult, Weights[TabularWeights]]:
    """Generate, judge and train one step from `start`; reuse every artifact whose key exists, and
    every trial an earlier attempt of the step stored (only failed trials run again)."""
    t0, before, timings = time.monotonic(), counters.snapshot(), {}
    worlds = ensure_worlds(exp, store)
    specs = {s.trial_id: s for s in plan_trials(exp, step)}
    progress = backends.progress
    progress.begin(step, len(specs))
    judged = Judged()  # rewards judged while generating

    def run(pending: list[str]) -> list:
        progress.generated(step, len(specs) - len(pending))
        return _fan_out(exp, step, [specs[t] for t in pending], start, worlds, backends, judged)

    def make(trajectories: list[Trajectory], failed: list[str]) -> Rollouts[Trajectory]:
        return Rollouts[Trajectory](
            step=step, behavior_policy=start.lineage(), n_trials_planned=len(specs), trajectories=trajectories, skipped=failed
        )

    rollouts = trial_set(
        store, "rollouts", _rollouts_key(exp, step, start, worlds), Rollouts[Trajectory], list(specs), run, make, warn
    )
    if rollouts.hit:
        progress.generated(step, len(specs))
    timings["generate_s"] = time.monotonic() - t0

    t = time.monotonic()
    progress.phase(step, "judging")
    rewards = step_rewards(
        store,
        exp,
        _rewards_key(exp, rollouts.ref, backends.judge),
        rollouts,
        judged,
        backends.judge,
        warn,
        Rewards[Reward],
        lambda n: progress.judged(step, n),
    )
    timings["judge_s"] = time.monotonic() - t

    def train() -> dict[str, bytes]:
        if exp.faults.step_delay_s:  # fault injection: a step slow enough to be killed in the middle
            time.sleep(exp.faults.step_delay_s)
        t = time.monotonic()
        trained, raw = backends.trainer.train(exp, start.payload, rewards.value.rewards)
        timings["train_s"] = time.monotonic() - t
        stats = TabularTrainStats(
            **trained_from(exp, step, start, rewards.ref),
            groups=int(raw["groups"]),
            groups_with_signal=int(raw["groups_with_signal"]),
            samples_used=int(raw["samples_used"]),
            grad_norm=raw["grad_norm"],
        )
        return {DATA: canonical_json(trained), STATS: canonical_json(stats)}

    progress.phase(step, "training")
    key = weights_key(CODE_VERSIONS["weights"], exp, start.ref, rewards.ref, grpo=exp.grpo)
    files, weights_ref, weights_hit = store.get_or_put_files("weights", key, train)
    stats = TabularTrainStats.model_validate_json(files[STATS])
    trained = TabularWeights.model_validate_json(files[DATA])
    weights = Weights(step_key(step), weights_ref, trained, trained.version)

    after = counters.snapshot()
    usable = rewards.value.rewards
    turns = {t.trial_id: t.turns for t in rollouts.value.trajectories}
    timings["step_s"] = time.monotonic() - t0
    progress.end(step)
    result = StepResult(
        step=step,
        n_trials=len(usable),
        n_trials_planned=len(specs),
        mean_reward=mean([r.reward for r in usable]),
        success_rate=mean([float(r.verified) for r in usable]),
        weights_version=trained.version,
        cache={"rollouts": rollouts.cache, "rewards": rewards.cache, "weights": "hit" if weights_hit else "miss"},
        refs={"rollouts": rollouts.ref, "rewards": rewards.ref, "weights": weights_ref},
        behavior_policy=rollouts.value.behavior_policy,
        skipped_trials=rewards.value.skipped,
        recovered_trials=recovered(rollouts, rewards),
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
    step: int,
    specs: list[TrialSpec],
    start: Weights[TabularWeights],
    worlds: Worlds,
    backends: SecretSearchBackends,
    judged: Judged,
) -> list:
    """Run the trials concurrently and judge each trajectory the moment it lands: one outcome per
    trial (its trajectory, or a TrialFailed); the judgements go into `judged`."""
    rollout, progress = backends.rollout, backends.progress

    def generate(on_done: Callable[[Trajectory], None]) -> list[Trajectory | TrialFailed]:
        outcomes: list[Trajectory | TrialFailed] = []
        with ThreadPoolExecutor(rollout.limits.max_concurrency) as gen_pool:
            gens = {gen_pool.submit(rollout.run, exp, s, start.payload, worlds[s.world_id][1]): s for s in specs}
            for fut in as_completed(gens):
                progress.generated(step)
                try:
                    traj = fut.result()
                except AttemptsExhausted as e:
                    outcomes.append(TrialFailed(trial_id=gens[fut].trial_id, error=str(e)))
                    continue
                outcomes.append(traj)
                on_done(traj)
        return outcomes

    return judge_as_they_land(exp, backends.judge, judged, generate, done=lambda n: progress.judged(step, n))


def _rollouts_key(exp: Exp, step: int, behavior: Weights, worlds: Worlds) -> str:
    worlds_hashes = {w: ref.content_hash for w, (ref, _) in worlds.items()}
    return rollouts_key(CODE_VERSIONS["rollouts"], exp, step, behavior.ref, worlds=worlds_hashes)


def _rewards_key(exp: Exp, rollouts: ArtifactRef, judge: JudgeBackend) -> str:
    return rewards_key(CODE_VERSIONS["rewards"], judge, rollouts, rubric=exp.rubric, max_turns=exp.task.max_turns)


class SecretSearchLoop:
    def initial_weights(self, exp: Exp, store: ArtifactStore) -> Weights[TabularWeights]:
        return initial_weights(exp, store)

    def load_weights(self, exp: Exp, store: ArtifactStore, partition: str, key: str) -> Weights[TabularWeights]:
        return load_weights(store, partition, key)

    def iter_steps(
        self,
        exp: Exp,
        steps: Sequence[int],
        start: Weights[TabularWeights],
        store: ArtifactStore,
        backends: SecretSearchBackends,
        warn: Warn,
    ) -> Iterator[StepResult]:
        weights = start
        for step in steps:
            result, weights = run_step(exp, step, weights, store, backends, warn)
            yield result
