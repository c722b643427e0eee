"""The one definition of a completion's log-probabilities, shared by the sampler and the trainer.

logp_t = log softmax(logits_t / temperature)[token_t], in float32, over the tempered distribution
BEFORE top-p truncation (temperature 0, greedy, counts as 1). The sampler records it from the very
logits it samples from (`token_logprobs`); the trainer computes it for a padded batch of sequences
in one forward (`packed_logprobs`). The two agree up to float rounding (other kernels, other batch
layouts), so the on-policy importance ratio is 1 within a tolerance, not bit for bit.

A packed batch is right-padded: row i holds its prompt, its completion, then padding, with an
attention mask and a completion-token mask. The model's head runs only on the positions that
predict a completion token (a boolean `logits_to_keep`), so no logits are computed for prompt or
padding positions: with a real vocabulary those are most of the memory of a forward.

A completion may hold tokens the model did not sample (a multi-turn trajectory's observations,
`dagster_rl.tasks.agent.records`): its `mask` (1 on sampled tokens, 0 on the others) keeps them in the
sequence, as context, and out of the completion-token mask, so that no logits are computed for them
and nothing is scored on them. No mask is the all-ones mask: the same tensors, bit for bit.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """log softmax(logits / temperature)[tokens] over the last dim, fp32.

    logits (..., V); tokens (...); temperature a float or a tensor that broadcasts to (...) (0: 1).
    One gather and one logsumexp: the full (..., V) log-softmax is never materialized.
    """
    logits = logits.float()
    if isinstance(temperature, torch.Tensor):
        t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).to(logits)
        logits = logits / t[..., None]
    elif temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, tokens[..., None].long())[..., 0] - torch.logsumexp(logits, dim=-1)


@dataclass(frozen=True)
class PackedBatch:
    """Sequences right-padded to one width W; C is the longest completion."""

    input_ids: torch.Tensor  # (B, W)
    attention_mask: torch.Tensor  # (B, W), 1 on prompt and completion tokens
    predicts: torch.Tensor  # (B, W) bool: the positions whose logits predict a completion token
    targets: torch.Tensor  # (B, C) the completion tokens, padded
    completion_mask: torch.Tensor  # (B, C) bool
    temperature: torch.Tensor  # (B,) fp32

    @property
    def tokens(self) -> int:
        """Padded size: what a forward of this batch costs."""
        return self.input_ids.numel()


def pack(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    temperatures: Sequence[float],
    pad_id: int,
    device,
    masks: Sequence[Sequence[int] | None] | None = None,
) -> PackedBatch:
    """`masks[i]` (or None: all ones): 1 on the completion tokens of row i the model sampled."""
    masks = list(masks) if masks is not None else [None] * len(prompts)
    if not (len(prompts) == len(completions) == len(temperatures) == len(masks)) or not prompts:
        raise ValueError(
            f"pack needs as many prompts, completions, temperatures and masks, at least one: {len(prompts)}, "
            f"{len(completions)}, {len(temperatures)}, {len(masks)}"
        )
    if any(not c for c in completions) or any(not p for p in prompts):
        raise ValueError("a sequence needs a prompt token and a completion token; drop empty rollouts before packing")
    for c, m in zip(completions, masks, strict=True):
        if m is not None and (len(m) != len(c) or not any(m) or any(v not in (0, 1) for v in m)):
            raise ValueError(
                f"a completion's mask needs one 0 or 1 per token ({len(c)} tokens, mask {list(m)[:8]}...) and a 1 somewhere"
            )
    width = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    longest = max(len(c) for c in completions)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    predicts = torch.zeros((len(prompts), width), dtype=torch.bool)
    targets = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    completion_mask = torch.zeros((len(prompts), longest), dtype=torch.bool)
    for i, (p, c, m) in enumerate(zip(prompts, completions, masks, strict=True)):
        n = len(p) + len(c)
        ids[i, :n] = torch.tensor([*p, *c])
        mask[i, :n] = 1
        targets[i, : len(c)] = torch.tensor(list(c))
        if m is None:
            predicts[i, len(p) - 1 : n - 1] = True
            completion_mask[i, : len(c)] = True
        else:
            sampled = torch.tensor(list(m), dtype=torch.bool)
            predicts[i, len(p) - 1 : n - 1] = sampled
            completion_mask[i, : len(c)] = sampled
    return PackedBatch(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        predicts=predicts.to(device),
        targets=targets.to(device),
        completion_mask=completion_mask.to(device),
        temperature=torch.tensor(list(temperatures), dtype=torch.float32, device=device),
    )


def packed_logprobs(model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
    """fp32 (B, C): the log-prob of every completion token, 0 at padding; carries grad when grad is enabled.

    `model` is a causal LM (or a DDP module around one) whose forward takes transformers' boolean
    `logits_to_keep`, returning logits of the kept positions only, flattened.
    """
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False, logits_to_keep=batch.predicts)
    logits = out.logits
    kept = int(batch.completion_mask.sum())
    if logits.dim() != 2 or logits.shape[0] != kept:
        raise RuntimeError(
            f"the model returned logits of shape {tuple(logits.shape)} for a boolean logits_to_keep of {kept} positions; "
            "it needs transformers >= 5.24 (slice_logits_to_keep with a 2-d boolean mask)"
        )
    temperature = batch.temperature[:, None].expand_as(batch.completion_mask)[batch.completion_mask]
    flat = token_logprobs(logits, batch.targets[batch.completion_mask], temperature)
    # the kept positions, row by row, are the completion tokens, row by row: scatter them back in place
    return torch.zeros(batch.completion_mask.shape, dtype=flat.dtype, device=flat.device).masked_scatter(
        batch.completion_mask, flat
    )


def completion_logprobs(
    model: torch.nn.Module, prompt_ids: list[int], completion_ids: list[int], temperature: float
) -> torch.Tensor:
    """fp32 (T,): one sequence alone, unpadded (the per-sample computation the batched one must match)."""
    batch = pack([prompt_ids], [completion_ids], [temperature], 0, next(model.parameters()).device)
    return packed_logprobs(model, batch)[0]
