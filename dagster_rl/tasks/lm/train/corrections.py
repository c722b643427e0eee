"""The off-policy corrections of the GRPO loss, as pure functions of per-token log-probabilities.

Three log-probabilities of each sampled token enter (B, T tensors, `mask` True on sampled tokens):

    s   what the sampler recorded as it drew the token (the behavior policy, by the sampler's numbers)
    b   the trainer's log-prob of it under the behavior weights (the weights that sampled it): at
        lag 0 those are the weights being trained, so b is the trainer's own forward, detached; at
        a lag the trainer recomputes it with the behavior adapter when `grpo.mismatch` asks for it,
        and it is unknown otherwise (s stands in)
    p   the trainer's log-prob under the weights this step trains from (the proximal policy of the
        decoupled objective), detached: its own forward

and the step's surrogate for token t of sample i is

    w_t * m_t * min(r_t A_i, clip(r_t, 1 - eps, 1 + eps) A_i),   r_t = exp(new_t - old_t)

- no correction: old = b where known (lag 0: the trainer's own, detached), else s; w = m = 1;
- `grpo.mismatch` (TIS / MIS): m = exp(b - s) per token, or exp(sum_t (b_t - s_t)) for every token
  of a completion (`sequence`), truncated at the cap (`truncate`) or set to 0 above it (`mask`);
- `grpo.decoupled` (AReaL): old = p, and w = exp(p - beta) where it is at most the cap, else 0,
  with beta = b where known, else s (so without `mismatch` it carries the mismatch too).

What each reports: the share of tokens whose weight the cap changed, and the mean weight applied.
"""

from dataclasses import dataclass

import torch

from dagster_rl.tasks.lm.settings import DecoupledObjective, GRPOLMSettings, MismatchCorrection


def mismatch_weights(
    behavior: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor, correction: MismatchCorrection
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, capped), both (B, T): exp(behavior - sampler) per token, or per completion (every
    token of row i gets exp(sum over its sampled tokens)), truncated at the cap or 0 above it; 0 off
    the mask. `capped`: the sampled tokens whose weight was above the cap."""
    log_ratio = torch.where(mask, behavior - sampler, 0.0)
    if correction.level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)
    ratio = torch.exp(log_ratio)
    capped = mask & (ratio > correction.cap)
    if correction.action == "truncate":
        weights = torch.clamp(ratio, max=correction.cap)
    else:
        weights = torch.where(capped, 0.0, ratio)
    return torch.where(mask, weights, 0.0), capped


def decoupled_weights(
    proximal: torch.Tensor, behavior: torch.Tensor, mask: torch.Tensor, objective: DecoupledObjective
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, masked), both (B, T): the behavior-to-proximal weight exp(proximal - behavior) of
    each sampled token, 0 where it exceeds the cap (AReaL's token mask) and off the mask."""
    ratio = torch.exp(torch.where(mask, proximal - behavior, 0.0))
    masked = mask & (ratio > objective.cap)
    return torch.where(mask & ~masked, ratio, 0.0), masked


@dataclass(frozen=True)
class Corrected:
    """What the loss of a micro-batch takes from the corrections."""

    old: torch.Tensor  # (B, T): the ratio's old policy
    weight: torch.Tensor | None  # (B, T): what multiplies each token's policy term; None: 1
    mismatch_capped: torch.Tensor | None = None  # (B, T) bool: tokens whose mismatch weight the cap changed
    mismatch_weight: torch.Tensor | None = None  # (B, T): that weight, as applied
    decoupled_masked: torch.Tensor | None = None  # (B, T) bool: tokens the decoupled objective masked
    decoupled_weight: torch.Tensor | None = None  # (B, T): its weight, as applied


def correct(
    proximal: torch.Tensor, sampler: torch.Tensor, behavior: torch.Tensor | None, mask: torch.Tensor, grpo: GRPOLMSettings
) -> Corrected:
    """The ratio's old policy and each token's weight (module doc). `proximal`: the trainer's
    log-probs, detached; `behavior`: the trainer's log-probs of the behavior weights (`proximal`
    itself when they are the trained ones), None when not computed. Without corrections this is
    the loss the trainer had before them, tensor for tensor."""
    if grpo.mismatch is not None and behavior is None:
        raise ValueError("grpo.mismatch compares the trainer's log-probs of the behavior weights with the sampler's: give them")
    beta = sampler if behavior is None else behavior
    if grpo.mismatch is None and grpo.decoupled is None:
        return Corrected(old=beta, weight=None)
    found: dict[str, torch.Tensor] = {}
    weight: torch.Tensor | None = None
    if grpo.mismatch is not None:
        assert behavior is not None
        weight, found["mismatch_capped"] = mismatch_weights(behavior, sampler, mask, grpo.mismatch)
        found["mismatch_weight"] = weight
    old = beta
    if grpo.decoupled is not None:
        old = proximal
        w, found["decoupled_masked"] = decoupled_weights(proximal, beta, mask, grpo.decoupled)
        found["decoupled_weight"] = w
        weight = w if weight is None else weight * w
    return Corrected(old=old, weight=weight, **found)
