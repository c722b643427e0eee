"""What the driver needs of a task's training loop, whatever the task.

A loop knows how to make its initial policy, load a policy stored by an earlier step, and walk a
range of steps, yielding one `StepResult` per step as soon as the step's artifacts are stored.
"""

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel

from dagster_rl.checks import CheckOutcome
from dagster_rl.store import ArtifactRef, ArtifactStore

Warn = Callable[[str], None]


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
