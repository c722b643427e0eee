"""Per-step checks, pure functions over a step's rewards and weights; the driver reports them as
blocking asset checks of `<exp>/weights`. A task adds its own `weights_finite` check."""

import math

from pydantic import BaseModel

from dagster_rl.errors import TooFewTrialsError
from dagster_rl.experiment import Experiment, step_key


class CheckOutcome(BaseModel):
    name: str
    passed: bool
    message: str
    value: float


def rewards_in_bounds(rewards: list, low: float, high: float) -> CheckOutcome:
    outside = [r.trial_id for r in rewards if not (low <= r.reward <= high and math.isfinite(r.reward))]
    passed = not outside
    message = f"all {len(rewards)} rewards in [{low}, {high}]" if passed else f"rewards outside [{low}, {high}]: {outside[:5]}"
    return CheckOutcome(name="rewards_in_bounds", passed=passed, message=message, value=float(len(outside)))


def enough_usable_trials(n_trials: int, planned: int, minimum: float) -> CheckOutcome:
    fraction = n_trials / planned if planned else 0.0
    passed = fraction >= minimum
    message = f"{n_trials}/{planned} trials usable ({fraction:.0%}), minimum {minimum:.0%}"
    return CheckOutcome(name="enough_usable_trials", passed=passed, message=message, value=fraction)


def step_checks(exp: Experiment, finite: CheckOutcome, rewards: list, planned: int) -> list[CheckOutcome]:
    """The checks of every step; `finite` is the task's own check that its weights are finite."""
    return [
        finite,
        rewards_in_bounds(rewards, 0.0, exp.max_reward),
        enough_usable_trials(len(rewards), planned, exp.checks.min_usable_fraction),
    ]


CHECK_NAMES = ("weights_finite", "rewards_in_bounds", "enough_usable_trials")


def require_enough_trials(exp: Experiment, step: int, usable: int, planned: int, skipped: list[str]) -> None:
    """Fail the step, before anything of it is stored, when too few trials are usable."""
    if usable < exp.min_trials_per_step:
        raise TooFewTrialsError(
            f"step {step_key(step)} of {exp.name} has {usable} usable trials of {planned} planned, "
            f"fewer than min_trials_per_step={exp.min_trials_per_step} ({len(skipped)} failed after their retries: "
            f"{', '.join(sorted(skipped)[:5])}...). No result of this step was stored (the trials that succeeded are "
            "kept, so a re-run attempts only the failed ones); fix the failing environment or lower "
            "min_trials_per_step, then re-run the step."
        )
