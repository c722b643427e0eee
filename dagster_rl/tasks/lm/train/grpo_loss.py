"""The GRPO loss of completions, as a pure function of their per-token log-probabilities.

loss_i = -( mean_t w_t min(r_t A_i, clip(r_t, 1-eps, 1+eps) A_i) - beta mean_t KL_t ), t over the
completion tokens of sample i; r_t = exp(new_t - old_t), against the behavior policy's log-probs:
those the sampler recorded when the rollouts are stale (a lag), and, when the trained weights are
the ones that sampled them, the trainer's own `new_t` detached (as TRL does with one iteration:
the same gradient, A_i grad new_t, free of the sampler's float noise); w_t = 1, or the weight of
the off-policy corrections, which also choose the old policy (`lm.train.corrections`);
KL_t = exp(d_t) - d_t - 1 with d_t = ref_t - new_t (the k3 estimator, >= 0), ref the base with the
adapter disabled. At r = 1 the surrogate's gradient is REINFORCE's (its value is A). A step's
loss is the mean of loss_i over its samples (the trainer's scale).

`grpo_batch_loss` takes a padded batch (a completion-token mask); `grpo_sample_loss` is one unpadded
sample, the same function on a batch of one.
"""

from dataclasses import dataclass

import torch
from pydantic import BaseModel


class LossStats(BaseModel):
    loss: float
    ratio: float  # mean over tokens
    kl: float  # mean k3 over tokens
    clip_frac: float  # share of tokens with |r - 1| > eps
    ratio_max_dev: float  # max over tokens of |r - 1|
    logp_max_dev: float  # max over tokens of |new - old|: the on_policy check's number


@dataclass(frozen=True)
class BatchStats:
    """Per-sample token means (B,), detached, and the batch's max |r - 1|."""

    ratio: torch.Tensor
    kl: torch.Tensor
    clip_frac: torch.Tensor
    ratio_max_dev: torch.Tensor  # scalar
    logp_max_dev: torch.Tensor  # scalar: max |new - old| over the batch's tokens (new before any update: the trainer's
    # log-prob of what the sampler drew, against the sampler's own)
    logp_dev_sum: torch.Tensor  # scalar: sum of (new - old) over the batch's tokens (their mean is a bias, where there is one)


def grpo_batch_loss(
    new_logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps: float,
    kl_beta: float,
    sampler_logp: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    scored_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, BatchStats]:
    """fp32 (B, T) log-probs, `mask` (B, T) bool (True on completion tokens, at least one per row),
    `advantages` (B,). `old_logp`: the ratio's old policy; `sampler_logp`: what the sampler recorded,
    which `logp_max_dev` and `logp_dev_sum` compare the trainer's log-probs with (default: `old_logp`):
    `scored_logp` (the trainer's of the behavior weights, where it recomputed them) or `new_logp`.
    `weight` (B, T): what multiplies each token's policy term (the off-policy corrections,
    `lm.train.corrections`); None: 1. Returns loss_i (B,) and the stats; only `new_logp` carries grad."""
    if not (new_logp.shape == old_logp.shape == ref_logp.shape == mask.shape) or new_logp.dim() != 2:
        raise ValueError(
            f"log-prob shapes differ or are not (batch, tokens): new {tuple(new_logp.shape)}, old {tuple(old_logp.shape)}, "
            f"ref {tuple(ref_logp.shape)}, mask {tuple(mask.shape)}; all cover the same completion tokens"
        )
    if advantages.shape != new_logp.shape[:1]:
        raise ValueError(f"{tuple(advantages.shape)} advantages for {new_logp.shape[0]} samples")
    tokens = mask.to(new_logp.dtype)
    count = tokens.sum(-1)

    def token_mean(x: torch.Tensor) -> torch.Tensor:
        return (x * tokens).sum(-1) / count

    adv = advantages.to(new_logp)[:, None]
    ratio = torch.exp(torch.where(mask, new_logp - old_logp, 0.0))
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    policy_term = torch.minimum(ratio * adv, clipped * adv)
    surrogate = token_mean(policy_term if weight is None else weight * policy_term)
    delta = torch.where(mask, ref_logp - new_logp, 0.0)
    kl = token_mean(torch.exp(delta) - delta - 1.0)
    loss = -(surrogate - kl_beta * kl)
    dev = (ratio.detach() - 1.0).abs()
    sampled = old_logp if sampler_logp is None else sampler_logp
    scored = new_logp.detach() if scored_logp is None else scored_logp
    stats = BatchStats(
        ratio=token_mean(ratio.detach()),
        kl=kl.detach(),
        clip_frac=token_mean((dev > clip_eps).to(tokens)),
        ratio_max_dev=torch.where(mask, dev, 0.0).max(),
        logp_max_dev=torch.where(mask, (scored - sampled).abs(), 0.0).max(),
        logp_dev_sum=torch.where(mask, scored - sampled, 0.0).sum(),
    )
    return loss, stats


def grpo_sample_loss(
    new_logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor,
    advantage: float,
    clip_eps: float,
    kl_beta: float,
) -> tuple[torch.Tensor, LossStats]:
    """fp32 (T,) tensors over the completion tokens of one sample; only `new_logp` carries grad."""
    if not (new_logp.shape == old_logp.shape == ref_logp.shape) or new_logp.dim() != 1:
        raise ValueError(
            f"log-prob shapes differ or are not 1-d: new {tuple(new_logp.shape)}, old {tuple(old_logp.shape)}, "
            f"ref {tuple(ref_logp.shape)}; all three cover the same completion tokens"
        )
    mask = torch.ones((1, new_logp.shape[0]), dtype=torch.bool, device=new_logp.device)
    adv = torch.tensor([advantage], dtype=new_logp.dtype, device=new_logp.device)
    loss, stats = grpo_batch_loss(new_logp[None], old_logp[None], ref_logp[None], mask, adv, clip_eps, kl_beta)
    return loss[0], LossStats(
        loss=float(loss.detach()[0]),
        ratio=float(stats.ratio[0]),
        kl=float(stats.kl[0]),
        clip_frac=float(stats.clip_frac[0]),
        ratio_max_dev=float(stats.ratio_max_dev),
        logp_max_dev=float(stats.logp_max_dev),
    )
