"""The GRPO loss of one completion, as a pure function of its per-token log-probabilities.

loss = -( mean_t min(r_t A, clip(r_t, 1-eps, 1+eps) A) - beta mean_t KL_t )
r_t = exp(new_t - old_t), against the behavior log-probs recorded at sampling;
KL_t = exp(d_t) - d_t - 1 with d_t = ref_t - new_t (the k3 estimator, >= 0), ref the base with
the adapter disabled. At r = 1 the surrogate's gradient is REINFORCE's (its value is A).
"""

import torch
from pydantic import BaseModel


class LossStats(BaseModel):
    loss: float
    ratio: float  # mean over tokens
    kl: float  # mean k3 over tokens
    clip_frac: float  # share of tokens with |r - 1| > eps


def grpo_sample_loss(
    new_logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor,
    advantage: float,
    clip_eps: float,
    kl_beta: float,
) -> tuple[torch.Tensor, LossStats]:
    """fp32 (T,) tensors over the completion tokens; only `new_logp` carries grad."""
    if not (new_logp.shape == old_logp.shape == ref_logp.shape) or new_logp.dim() != 1:
        raise ValueError(
            f"log-prob shapes differ or are not 1-d: new {tuple(new_logp.shape)}, old {tuple(old_logp.shape)}, "
            f"ref {tuple(ref_logp.shape)}; all three cover the same completion tokens"
        )
    ratio = torch.exp(new_logp - old_logp)
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    surrogate = torch.minimum(ratio * advantage, clipped * advantage).mean()
    delta = ref_logp - new_logp
    kl = (torch.exp(delta) - delta - 1.0).mean()
    loss = -(surrogate - kl_beta * kl)
    stats = LossStats(
        loss=float(loss.detach()),
        ratio=float(ratio.detach().mean()),
        kl=float(kl.detach()),
        clip_frac=float(((ratio.detach() - 1.0).abs() > clip_eps).float().mean()),
    )
    return loss, stats
