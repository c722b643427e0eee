"""The policy update: a pure function (weights, rewards) -> new weights.

GRPO advantages within each prompt's group; each world's prior takes a step along the mean over
trajectories of advantage x d log p(reading order) / d logits (REINFORCE on the Plackett-Luce
policy), so documents read on the way to above-average rewards gain probability. Version + 1.
"""

import math

from dagster_rl.core.advantages import group_normalized_advantages, groups_with_signal
from dagster_rl.core.checks import CheckOutcome, weights_finite
from dagster_rl.tasks.secret_search.experiment import GRPOSettings
from dagster_rl.tasks.secret_search.prior import apply_logit_step, order_log_prob_grad
from dagster_rl.tasks.secret_search.records import Reward, TabularWeights


def update(weights: TabularWeights, rewards: list[Reward], grpo: GRPOSettings) -> tuple[TabularWeights, dict[str, float]]:
    if [r.trial_id for r in rewards] != sorted(r.trial_id for r in rewards):
        raise ValueError("rewards must be sorted by trial id so the update does not depend on completion order")
    groups = [r.prompt for r in rewards]
    advantages = group_normalized_advantages(groups, [r.reward for r in rewards], grpo.advantage_eps)
    grads = {w: [0.0] * len(p) for w, p in weights.doc_prior.items()}
    for r, a in zip(rewards, advantages, strict=True):
        if a == 0.0:
            continue
        g = order_log_prob_grad(weights.doc_prior[r.world_id], r.docs_read)
        grads[r.world_id] = [acc + a * gi for acc, gi in zip(grads[r.world_id], g, strict=True)]
    n = max(len(rewards), 1)
    new_prior = {w: apply_logit_step(p, [grpo.learning_rate * g / n for g in grads[w]]) for w, p in weights.doc_prior.items()}
    grad_norm = math.sqrt(math.fsum(g * g for gs in grads.values() for g in gs)) / n
    stats = {
        "groups": float(len(set(groups))),
        "groups_with_signal": float(groups_with_signal(groups, advantages)),
        "samples_used": float(sum(1 for a in advantages if a != 0.0)),
        "grad_norm": grad_norm,
    }
    return TabularWeights(version=weights.version + 1, doc_prior=new_prior), stats


def prior_finite(weights: TabularWeights) -> CheckOutcome:
    """The `weights_finite` check of a step's tabular weights: finite priors that sum to 1."""
    bad = [(w, i) for w, p in weights.doc_prior.items() for i, x in enumerate(p) if not math.isfinite(x)]
    off = [w for w, p in weights.doc_prior.items() if abs(math.fsum(p) - 1.0) > 1e-6]
    message = (
        "every prior is finite and sums to 1"
        if not bad and not off
        else f"non-finite entries {bad[:5]}; priors not summing to 1: {off[:5]}"
    )
    return weights_finite(len(bad) + len(off), message)
