"""The records of a language-model step: the trials' requests, planned, and the rollouts they produce."""

from collections.abc import Sequence

from dagster_rl.base.hashing import seed_of
from dagster_rl.core.records import Record
from dagster_rl.tasks.lm.data.prompts import PromptItem


class RolloutRequest(Record):
    trial_id: str  # s{step}-p{prompt}-n{sample}
    step: int
    prompt: int  # index of the prompt in its step: the GRPO group
    sample: int
    item: PromptItem
    seed: int


class LMRollout(Record):
    trial_id: str
    step: int
    prompt: int
    sample: int
    prompt_id: str
    reference: str
    seed: int
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_text: str
    sampling_logprobs: list[float]  # log softmax(logits / temperature) at each token, before top-p
    finish_reason: str
    temperature: float
    top_p: float
    behavior_version: int


def rollout_of(
    r: RolloutRequest,
    prompt_ids: list[int],
    completion_ids: list[int],
    completion_text: str,
    logprobs: list[float],
    finish_reason: str,
    temperature: float,
    top_p: float,
    behavior_version: int,
) -> LMRollout:
    """The rollout of request `r`: what an engine sampled for it, with the request's identity."""
    return LMRollout(
        trial_id=r.trial_id,
        step=r.step,
        prompt=r.prompt,
        sample=r.sample,
        prompt_id=r.item.id,
        reference=r.item.reference,
        seed=r.seed,
        prompt_token_ids=list(prompt_ids),
        completion_token_ids=list(completion_ids),
        completion_text=completion_text,
        sampling_logprobs=list(logprobs),
        finish_reason=finish_reason,
        temperature=temperature,
        top_p=top_p,
        behavior_version=behavior_version,
    )


def plan_requests(prompts: Sequence[PromptItem], seed: int, step: int, n_samples: int) -> list[RolloutRequest]:
    return [
        RolloutRequest(trial_id=f"s{step}-p{p}-n{s}", step=step, prompt=p, sample=s, item=item, seed=seed_of(seed, step, p, s))
        for p, item in enumerate(prompts)
        for s in range(n_samples)
    ]
