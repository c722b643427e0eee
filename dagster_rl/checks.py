"""Per-step checks of the weights a step produced: pure functions, run by the driver as asset checks."""

import math

from pydantic import BaseModel

from dagster_rl.experiment import ExperimentBase
from dagster_rl.records import TabularWeights


class CheckOutcome(BaseModel):
    name: str
    passed: bool
    message: str
    value: float


def prior_finite(weights: TabularWeights) -> CheckOutcome:
    bad = [(w, i) for w, p in weights.doc_prior.items() for i, x in enumerate(p) if not math.isfinite(x)]
    off = [w for w, p in weights.doc_prior.items() if abs(math.fsum(p) - 1.0) > 1e-6]
    passed = not bad and not off
    message = (
        "every prior is finite and sums to 1"
        if passed
        else f"non-finite entries {bad[:5]}; priors not summing to 1: {off[:5]}"
    )
    return CheckOutcome(name="weights_finite", passed=passed, message=message, value=float(len(bad) + len(off)))


def tensors_finite(tensors: dict) -> CheckOutcome:
    """Every tensor of a checkpoint (name -> torch tensor) holds only finite numbers."""
    bad = sorted(name for name, t in tensors.items() if t.is_floating_point() and not bool(t.isfinite().all()))
    message = f"all {len(tensors)} tensors finite" if not bad else f"non-finite values in {bad[:5]}"
    return CheckOutcome(name="weights_finite", passed=not bad, message=message, value=float(len(bad)))


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


def step_checks(exp: ExperimentBase, finite: CheckOutcome, rewards: list, planned: int) -> list[CheckOutcome]:
    """The checks of every step; `finite` is the task's own check that its weights are finite."""
    return [
        finite,
        rewards_in_bounds(rewards, 0.0, exp.rubric.max_reward),  # type: ignore[attr-defined]
        enough_usable_trials(len(rewards), planned, exp.checks.min_usable_fraction),
    ]


CHECK_NAMES = ("weights_finite", "rewards_in_bounds", "enough_usable_trials")
