"""What the driver needs of a task's training loop, whatever the task, and what every loop shares.

A loop knows how to make its initial policy, load a policy stored by an earlier step, and walk a
range of steps, yielding one `StepResult` per step as soon as the step's artifacts are stored.
"""

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel

from dagster_rl.checks import CheckOutcome
from dagster_rl.errors import TooFewTrialsError
from dagster_rl.experiment import step_key
from dagster_rl.hashing import cache_key
from dagster_rl.retries import AttemptsExhausted
from dagster_rl.store import ArtifactRef, ArtifactStore

Warn = Callable[[str], None]
STATS = "stats.json"  # beside a trained weights artifact's own files: what trained it (lineage) and how


@dataclass(frozen=True)
class Policy:
    """The weights a step starts from, and where they came from."""

    partition: str  # "initial" or the step key that produced them
    ref: ArtifactRef
    weights: Any
    version: int

    def lineage(self) -> dict[str, str | int]:
        return {"partition": self.partition, "key": self.ref.key, "content_hash": self.ref.content_hash, "version": self.version}


class StepResult(BaseModel):
    step: int
    n_trials: int
    n_trials_planned: int
    mean_reward: float
    success_rate: float
    weights_version: int
    cache: dict[str, str]  # asset -> hit | miss
    refs: dict[str, ArtifactRef]
    behavior_policy: dict[str, str | int]
    skipped_trials: list[str]
    trials_executed: int
    judge_calls: int
    metrics: dict[str, float]  # task-specific numbers, drawn as plots
    timings: dict[str, float]
    checks: list[CheckOutcome]


class EvaluationResult(BaseModel):
    """Held-out evaluation of the weights of one step, produced off the critical path."""

    step: int
    weights_version: int
    n: int
    accuracy: float
    mean_reward: float
    base_accuracy: float
    cache: str
    ref: ArtifactRef
    eval_s: float


@dataclass(frozen=True)
class Engines:
    """The environments one loop calls: built by the Dagster resources, or directly in a plain loop."""

    rollout: Any
    judge: Any
    trainer: Any


class TaskLoop(Protocol):
    def initial_policy(self, exp: Any, store: ArtifactStore) -> Policy: ...

    def load_policy(self, exp: Any, store: ArtifactStore, partition: str, key: str) -> Policy: ...

    def iter_steps(
        self, exp: Any, steps: list[int], policy: Policy, store: ArtifactStore, engines: Engines, warn: Warn
    ) -> Iterator[StepResult | EvaluationResult]: ...


def loop_for(exp: Any) -> TaskLoop:
    if exp.kind == "secret_search":
        from dagster_rl.secret_search.loop import SecretSearchLoop

        return SecretSearchLoop()
    if exp.kind == "verifiable_prompts":
        from dagster_rl.lm.taskloop import LMLoop

        return LMLoop()
    raise ValueError(f"no training loop for task kind {exp.kind!r}")


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


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


def judge_all(exp: Any, trajectories: list, judge: Any, warn: Warn) -> tuple[list, list[str]]:
    """Judge every trajectory concurrently, `judge.limits.max_concurrency` at a time."""
    with ThreadPoolExecutor(judge.limits.max_concurrency) as pool:
        return collect_rewards({pool.submit(judge.judge, exp, t): t.trial_id for t in trajectories}, warn)


def rewards_key(code_version: str, judge: Any, **inputs: Any) -> str:
    """The key of a step's rewards. A judge other than the in-process rubric (an LLM judge) names
    itself in it, by its `cache_version` (prompt version and model); the rubric judge adds nothing."""
    judged_by = getattr(judge, "cache_version", None)
    extra = {"judge": judged_by} if judged_by else {}
    return cache_key("rewards", code_version, **inputs, **extra)


def require_enough_trials(exp: Any, step: int, usable: int, planned: int, skipped: list[str]) -> None:
    """Fail the step, before anything of it is stored, when too few trials are usable."""
    if usable < exp.min_trials_per_step:
        raise TooFewTrialsError(
            f"step {step_key(step)} of {exp.name} has {usable} usable trials of {planned} planned, "
            f"fewer than min_trials_per_step={exp.min_trials_per_step} ({len(skipped)} failed after their retries: "
            f"{', '.join(sorted(skipped)[:5])}...). Nothing of this step was stored; fix the failing environment "
            "or lower min_trials_per_step, then re-run the step."
        )
