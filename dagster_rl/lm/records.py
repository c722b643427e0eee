"""The records of a language-model step: the trials' requests, planned, and the rollouts they produce."""

from collections.abc import Sequence

from dagster_rl.hashing import seed_of
from dagster_rl.lm.prompts import PromptItem
from dagster_rl.records import Record


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


def plan_requests(prompts: Sequence[PromptItem], seed: int, step: int, n_samples: int) -> list[RolloutRequest]:
    return [
        RolloutRequest(trial_id=f"s{step}-p{p}-n{s}", step=step, prompt=p, sample=s, item=item, seed=seed_of(seed, step, p, s))
        for p, item in enumerate(prompts)
        for s in range(n_samples)
    ]
