"""What every task's loop shares when it computes a step: judging, the rewards key, canonical order."""

from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from typing import Any, TypeVar

from dagster_rl.checks import require_enough_trials
from dagster_rl.hashing import cache_key
from dagster_rl.records import Rewards, Rollouts
from dagster_rl.retries import AttemptsExhausted
from dagster_rl.store import ArtifactRef
from dagster_rl.task import JudgeBackend, Warn

X = TypeVar("X")
RW = TypeVar("RW", bound=Rewards)


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def by_trial(items: Iterable[X]) -> list[X]:
    """Canonical order: completion order differs between attempts; sorted inputs hash the same."""
    return sorted(items, key=lambda x: x.trial_id)  # type: ignore[attr-defined]


def collect_rewards(judging: dict[Future, str], warn: Warn) -> tuple[list, list[str]]:
    """The rewards of judgements as they finish (future -> trial id); a trial whose judging still
    fails after its retries is skipped, not fatal."""
    rewards, skipped = [], []
    for fut in as_completed(judging):
        try:
            rewards.append(fut.result())
        except AttemptsExhausted as e:
            warn(f"judging failed after its retries, trial skipped: {e}")
            skipped.append(judging[fut])
    return rewards, skipped


def judge_all(exp: Any, trajectories: list, judge: JudgeBackend, warn: Warn) -> tuple[list, list[str]]:
    """Judge every trajectory concurrently, `judge.limits.max_concurrency` at a time."""
    with ThreadPoolExecutor(judge.limits.max_concurrency) as pool:
        return collect_rewards({pool.submit(judge.judge, exp, t): t.trial_id for t in trajectories}, warn)


def rollouts_key(code_version: str, exp: Any, step: int, behavior_hash: str, **inputs: Any) -> str:
    """The key of a step's rollouts: what every task's trials depend on (the task's settings, the
    experiment seed, the step, the trial counts, the behavior weights), and the task's own `inputs`."""
    return cache_key(
        "rollouts",
        code_version,
        task=exp.task,
        seed=exp.seed,
        step=step,
        prompts_per_step=exp.prompts_per_step,
        n_samples=exp.n_samples,
        behavior=behavior_hash,
        **inputs,
    )


def step_rewards(
    exp: Any,
    rollouts: Rollouts,
    rollouts_ref: ArtifactRef,
    judged: dict[str, list],
    judge: JudgeBackend,
    warn: Warn,
    record: type[RW],
) -> RW:
    """A step's rewards record: of the rewards `judged` while generating (`rewards`, `skipped`), or,
    when the rollouts came from the store, of every trajectory judged now (fails the step, before
    the rewards are stored, when too few trials are usable)."""
    if judged:
        rewards, skipped = judged["rewards"], judged["skipped"]
    else:
        rewards, judge_skipped = judge_all(exp, rollouts.trajectories, judge, warn)
        skipped = sorted(set(rollouts.skipped) | set(judge_skipped))
        require_enough_trials(exp, rollouts.step, len(rewards), rollouts.n_trials_planned, skipped)
    return record(
        step=rollouts.step,
        rollouts_key=rollouts_ref.key,
        rollouts_hash=rollouts_ref.content_hash,
        rubric=exp.rubric.model_dump(),
        rewards=by_trial(rewards),
        skipped=sorted(skipped),
    )


def rewards_key(code_version: str, judge: JudgeBackend, **inputs: Any) -> str:
    """The key of a step's rewards. A judge other than the task's own rubric (an LLM judge) names
    itself in it, by its `cache_version` (prompt version and model); the rubric judge adds nothing."""
    extra = {"judge": judge.cache_version} if judge.cache_version else {}
    return cache_key("rewards", code_version, **inputs, **extra)
