"""Rollouts of a step on `transformers`: generate, record, and greedy completions for evaluation.

A rollout records what the trainer needs and nothing it must recompute: the prompt and completion
token ids, the behavior log-probability of every completion token (see `logprobs`), the adapter
version that sampled it, its trial id and seed. Trial (step, p, n) is seeded by
seed_of(experiment seed, step, p, n), so a retried rollout is the same rollout, token for token and
bit for bit, whatever batch it lands in: tokens come from its own generator, and its log-probs from
a forward of its own sequence alone.
"""

from collections.abc import Sequence

import torch

from dagster_rl.lm.logprobs import completion_logprobs
from dagster_rl.lm.policy import Policy
from dagster_rl.lm.sampling import generate
from dagster_rl.lm.settings import SamplingSettings
from dagster_rl.lm.records import LMRollout, RolloutRequest, rollout_of
from dagster_rl.lm.prompts import PromptItem, render


def generate_rollouts(
    policy: Policy, requests: Sequence[RolloutRequest], sampling: SamplingSettings, template: str, batch_size: int = 64
) -> list[LMRollout]:
    """Sample every request with the policy's current adapter, in batches; sorted by trial id."""
    tok = policy.tokenizer
    model = policy.model.eval()
    rollouts: list[LMRollout] = []
    # Log-probs are a pure function of the sequence: samples of a group that sampled the same
    # completion (common once the policy is sure of itself) share one forward, bit for bit.
    logps: dict[tuple[tuple[int, ...], tuple[int, ...]], list[float]] = {}
    for start in range(0, len(requests), batch_size):
        batch = list(requests[start : start + batch_size])
        prompt_ids = [tok(render(r.item, template))["input_ids"] for r in batch]
        gens = generate(model, prompt_ids, [r.seed for r in batch], sampling, tok.eos_token_id, tok.pad_token_id)
        for r, ids, g in zip(batch, prompt_ids, gens):
            key = (tuple(ids), tuple(g.completion_ids))
            if key not in logps:
                with torch.inference_mode():
                    logps[key] = completion_logprobs(model, ids, g.completion_ids, sampling.temperature).tolist()
            text = tok.decode(g.completion_ids, skip_special_tokens=True)
            rollouts.append(
                rollout_of(r, ids, g.completion_ids, text, logps[key], g.finish_reason, sampling.temperature, sampling.top_p, policy.version)
            )
    return sorted(rollouts, key=lambda r: r.trial_id)


def greedy_completions(policy: Policy, items: Sequence[PromptItem], template: str, max_new_tokens: int, batch_size: int = 64) -> list[str]:
    """Greedy completions (evaluation), in the order of `items`."""
    tok = policy.tokenizer
    greedy = SamplingSettings(temperature=0.0, max_new_tokens=max_new_tokens)
    texts: list[str] = []
    for start in range(0, len(items), batch_size):
        batch = list(items[start : start + batch_size])
        ids = [tok(render(it, template))["input_ids"] for it in batch]
        gens = generate(policy.model.eval(), ids, [0] * len(batch), greedy, tok.eos_token_id, tok.pad_token_id)
        texts += [tok.decode(g.completion_ids, skip_special_tokens=True) for g in gens]
    return texts
