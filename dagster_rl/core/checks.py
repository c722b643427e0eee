"""Per-step checks, pure functions over a step's rewards and weights; the driver reports them as
blocking asset checks of `<exp>/weights`. A task adds its own `weights_finite` check, and may
declare checks of its own (`Task.checks`: a language model's `on_policy`)."""

import math

from pydantic import BaseModel, Field

from dagster_rl.base.errors import TooFewTrialsError
from dagster_rl.core.experiment import Experiment, step_key


class CheckOutcome(BaseModel):
    name: str
    passed: bool
    message: str
    value: float
    measure: str = Field(description="what `value` is: the name the check's evaluation shows it under, one meaning per name")


def weights_finite(bad: int, message: str) -> CheckOutcome:
    """The `weights_finite` check of a task's weights: `bad` counts the parts that are not finite
    numbers (a language model's adapter tensors; a tabular prior's entries, and its priors that do
    not sum to 1)."""
    return CheckOutcome(name="weights_finite", passed=not bad, message=message, value=float(bad), measure="bad_weights")


def rewards_in_bounds(rewards: list, low: float, high: float) -> CheckOutcome:
    outside = [r.trial_id for r in rewards if not (low <= r.reward <= high and math.isfinite(r.reward))]
    passed = not outside
    message = f"all {len(rewards)} rewards in [{low}, {high}]" if passed else f"rewards outside [{low}, {high}]: {outside[:5]}"
    return CheckOutcome(
        name="rewards_in_bounds", passed=passed, message=message, value=float(len(outside)), measure="rewards_out_of_bounds"
    )


def enough_usable_trials(n_trials: int, planned: int, minimum: float) -> CheckOutcome:
    fraction = n_trials / planned if planned else 0.0
    passed = fraction >= minimum
    message = f"{n_trials}/{planned} trials usable ({fraction:.0%}), minimum {minimum:.0%}"
    return CheckOutcome(name="enough_usable_trials", passed=passed, message=message, value=fraction, measure="usable_fraction")


def step_checks(exp: Experiment, finite: CheckOutcome, rewards: list, planned: int) -> list[CheckOutcome]:
    """The checks of every step; `finite` is the task's own check that its weights are finite."""
    return [
        finite,
        rewards_in_bounds(rewards, exp.min_reward, exp.max_reward),
        enough_usable_trials(len(rewards), planned, exp.checks.min_usable_fraction),
    ]


CHECK_NAMES = ("weights_finite", "rewards_in_bounds", "enough_usable_trials")
ON_POLICY_MEASURE = "logp_max_dev"

OFF_POLICY_CAUSES = (
    "Likely causes: the sampling fields (a server that fills the fields a request leaves out from the model's "
    "generation_config.json: start vLLM with --generation-config vllm), the logprobs mode (vLLM's default reports the "
    "raw logits' log-probs: start it with --logprobs-mode processed_logprobs for a temperature other than 1), the dtype "
    "(the server's --dtype must be the experiment's policy.dtype), a stale adapter (the server serves other weights "
    "under this version's name), or LoRA dropout (policy.lora.dropout > 0 makes the trainer's forward another one)."
)


def on_policy(
    max_dev: float | None,
    mean_dev: float | None,
    tolerance: tuple[float, float],
    dtype: str,
    behavior_version: int,
    trained_version: int,
    recomputed: bool = False,
) -> CheckOutcome:
    """The `on_policy` check of a step: where the rollouts' behavior policy is the policy the step
    trains, the trainer's log-probability of every sampled token equals the sampler's within the
    dtype's `tolerance` = (max |difference|, |mean difference|); `max_dev` and `mean_dev` are the
    step's. A lagged step (`max_policy_lag` > 0) is checked the same when the trainer `recomputed`
    the behavior weights' log-probabilities (`grpo.mismatch`), and otherwise reported, not checked:
    its difference is the lag's drift. The check's value is `max_dev`, shown as `logp_max_dev` (the
    name the step's weights record it under)."""
    if max_dev is None or mean_dev is None or not (math.isfinite(max_dev) and math.isfinite(mean_dev)):
        return CheckOutcome(
            name="on_policy", passed=False, value=float("nan"), measure=ON_POLICY_MEASURE,
            message=f"the trainer reported no finite difference of log-probabilities ({max_dev}, {mean_dev}): retrain the step",
        )  # fmt: skip
    measured = f"max |logp_trainer - logp_sampler| over the sampled tokens {max_dev:.3g}, mean {mean_dev:+.2g}"
    if behavior_version != trained_version and not recomputed:
        message = (
            f"not checked: the rollouts' behavior policy v{behavior_version} is not the trained policy v{trained_version} "
            f"(max_policy_lag); {measured} are the lag's drift"
        )
        return CheckOutcome(name="on_policy", passed=True, message=message, value=max_dev, measure=ON_POLICY_MEASURE)
    if behavior_version != trained_version:
        measured += f" (the trainer's recomputed with the behavior weights v{behavior_version})"
    max_abs, mean_abs = tolerance
    bounds = f"(bounds {max_abs:g} and {mean_abs:g}, {dtype})"
    if max_dev <= max_abs and abs(mean_dev) <= mean_abs:
        return CheckOutcome(
            name="on_policy", passed=True, message=f"{measured} {bounds}", value=max_dev, measure=ON_POLICY_MEASURE
        )
    message = (
        f"{measured}, beyond {bounds}: the rollouts were not sampled from the policy the trainer scores, so GRPO "
        f"would train off-policy. {OFF_POLICY_CAUSES} The step's rollouts were moved aside: fix the cause, then re-run "
        "the step to sample them again."
    )
    return CheckOutcome(name="on_policy", passed=False, message=message, value=max_dev, measure=ON_POLICY_MEASURE)


def require_enough_trials(
    exp: Experiment, step: int, usable: int, planned: int, skipped: list[str], errors: dict[str, str] | None = None
) -> None:
    """Fail the step, before anything of it is stored, when too few trials are usable; `errors`
    (trial id -> why it failed, for the trials that failed in this attempt) gives the error one of them."""
    if usable < exp.min_trials_per_step:
        example = ""
        if errors:
            trial = sorted(errors)[0]
            example = f" Trial {trial} failed with: {errors[trial][:1000]}."
        raise TooFewTrialsError(
            f"step {step_key(step)} of {exp.name} has {usable} usable trials of {planned} planned, "
            f"fewer than min_trials_per_step={exp.min_trials_per_step} ({len(skipped)} failed after their retries: "
            f"{', '.join(sorted(skipped)[:5])}...).{example} No result of this step was stored (the trials that succeeded are "
            "kept, so a re-run attempts only the failed ones); fix the failing environment or lower "
            "min_trials_per_step, then re-run the step."
        )
