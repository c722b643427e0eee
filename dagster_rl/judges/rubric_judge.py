"""The judge environment's `in_process` backend: the task's own verifier + rubric, in this process."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dagster_rl.base import counters
from dagster_rl.base.faults import maybe_fail
from dagster_rl.base.retries import Limits, with_retries


@dataclass(frozen=True)
class RubricJudge:
    score: Callable[[Any, Any], Any]  # the task's `score(exp, trajectory) -> reward`
    limits: Limits = Limits()
    cache_version: None = None  # the rubric is in the rewards key already; nothing else judges

    def judge(self, exp: Any, trajectory: Any) -> Any:
        def attempt(n: int) -> Any:
            counters.bump("judge_calls")
            maybe_fail(exp.faults.judge_flake_rate, n, exp.seed, "judge", trajectory.trial_id)
            return self.score(exp, trajectory)

        return with_retries(f"judging {trajectory.trial_id}", attempt, self.limits.max_retries, self.limits.timeout_s)
