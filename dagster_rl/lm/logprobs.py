"""The one definition of a completion's log-probabilities, shared by the sampler and the trainer.

logp_t = log softmax(logits_t / temperature)[token_t]: the tempered distribution BEFORE top-p
truncation (temperature 0, greedy, counts as 1). The rollout records these for the behavior policy
and the trainer computes new_logp with this same function, a full forward of one unpadded sequence,
so on-policy the importance ratio is exactly 1, bit for bit.
"""

import torch


def completion_logprobs(model: torch.nn.Module, prompt_ids: list[int], completion_ids: list[int], temperature: float) -> torch.Tensor:
    """fp32 tensor (T,) over the completion tokens; carries grad when grad is enabled."""
    if not completion_ids:
        raise ValueError("a completion of no tokens has no log-probabilities; drop the empty rollout")
    ids = torch.tensor([list(prompt_ids) + list(completion_ids)], device=_device(model))
    # the head runs on the positions that predict a completion token (and the last) only
    logits = model(input_ids=ids, use_cache=False, logits_to_keep=len(completion_ids) + 1).logits[0, :-1].float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, ids[0, len(prompt_ids) :, None])[:, 0]


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device
