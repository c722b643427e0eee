"""Rollouts of a step on `transformers`: generate, record, and greedy completions for evaluation.

A rollout records what the trainer needs and nothing it must recompute: the prompt and completion
token ids, the behavior log-probability of every completion token as the sampler drew it (see
`logprobs`; the sampler runs the policy with its adapter folded in, `Policy.merged`), the adapter version that sampled it, its trial id and seed. Trial (step, p, n) is
seeded by seed_of(experiment seed, step, p, n): a retried rollout draws the same uniforms whatever
batch it lands in, so it samples the same tokens wherever the logits agree; its log-probs, from a
batched decode, agree with another batch's to float rounding. The same requests in the same
batches give the same bytes.
"""

from collections.abc import Sequence

from dagster_rl.tasks.lm.data.prompts import PromptItem, decode_completion, encode_prompt
from dagster_rl.tasks.lm.model.policy import Policy
from dagster_rl.tasks.lm.records import LMRollout, RolloutRequest, rollout_of
from dagster_rl.tasks.lm.rollout.sampling import Generation, generate
from dagster_rl.tasks.lm.settings import SamplingSettings


def generate_rollouts(
    policy: Policy, requests: Sequence[RolloutRequest], sampling: SamplingSettings, template: str, batch_size: int = 256
) -> list[LMRollout]:
    """Sample every request with the policy's current adapter, in batches of `batch_size` rows (one
    forward per token for a whole batch: its Python overhead is what small batches pay for); sorted
    by trial id."""
    tok = policy.tokenizer
    policy.mode(training=False)
    rollouts: list[LMRollout] = []
    encoded: dict[str, list[int]] = {}  # the samples of a group share their prompt's tokens
    with policy.merged() as model:
        for start in range(0, len(requests), batch_size):
            batch = list(requests[start : start + batch_size])
            prompt_ids = [_encode(tok, r.item, template, encoded) for r in batch]
            gens = generate(model, prompt_ids, [r.seed for r in batch], sampling, tok.eos_token_id, tok.pad_token_id)
            rollouts += [_rollout(policy, r, ids, g, sampling) for r, ids, g in zip(batch, prompt_ids, gens, strict=True)]
    return sorted(rollouts, key=lambda r: r.trial_id)


def _rollout(policy: Policy, r: RolloutRequest, ids: list[int], g: Generation, sampling: SamplingSettings) -> LMRollout:
    text = decode_completion(policy.tokenizer, g.completion_ids)
    return rollout_of(
        r, ids, g.completion_ids, text, g.logprobs, g.finish_reason, sampling.temperature, sampling.top_p, policy.version
    )


def _encode(tok, item: PromptItem, template: str, encoded: dict[str, list[int]]) -> list[int]:
    if item.question not in encoded:
        encoded[item.question] = encode_prompt(tok, item, template)
    return list(encoded[item.question])


def greedy_completions(
    policy: Policy, items: Sequence[PromptItem], template: str, max_new_tokens: int, batch_size: int = 256
) -> list[str]:
    """Greedy completions (evaluation), in the order of `items`."""
    return [text for text, _ in greedy_generations(policy, items, template, max_new_tokens, batch_size)]


def greedy_generations(
    policy: Policy, items: Sequence[PromptItem], template: str, max_new_tokens: int, batch_size: int = 256
) -> list[tuple[str, list[int]]]:
    """Greedy completions (evaluation) and their token ids, in the order of `items`."""
    tok = policy.tokenizer
    greedy = SamplingSettings(temperature=0.0, max_new_tokens=max_new_tokens)
    out: list[tuple[str, list[int]]] = []
    policy.mode(training=False)
    with policy.merged() as model:
        for start in range(0, len(items), batch_size):
            batch = list(items[start : start + batch_size])
            ids = [encode_prompt(tok, it, template) for it in batch]
            gens = generate(model, ids, [0] * len(batch), greedy, tok.eos_token_id, tok.pad_token_id)
            out += [(decode_completion(tok, g.completion_ids), list(g.completion_ids)) for g in gens]
    return out
