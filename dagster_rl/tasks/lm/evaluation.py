"""Held-out evaluation of a policy: greedy completions of the eval split, scored by the rubric."""

from dagster_rl.core.records import Record
from dagster_rl.tasks.lm.data.prompts import PromptSet
from dagster_rl.tasks.lm.model.policy import Policy
from dagster_rl.tasks.lm.rewards import LMRubric, score_text
from dagster_rl.tasks.lm.rollout.hf import greedy_completions


class Evaluation(Record):
    """Greedy accuracy and mean reward of one policy on the held-out prompts (stored per weights),
    and each prompt's greedy answer (prompt id -> completion text)."""

    weights_hash: str  # content hash of the evaluated weights; "" for a policy that is not stored
    n: int
    accuracy: float
    mean_reward: float
    answers: dict[str, str] = {}


def evaluate(policy: Policy, prompt_set: PromptSet, rubric: LMRubric, max_new_tokens: int, weights_hash: str = "") -> Evaluation:
    texts = greedy_completions(policy, prompt_set.eval, prompt_set.template, max_new_tokens)
    scored = [score_text(t, it.reference, rubric) for t, it in zip(texts, prompt_set.eval, strict=True)]
    correct = [a is not None and a == it.reference for (a, _), it in zip(scored, prompt_set.eval, strict=True)]
    n = len(texts)
    return Evaluation(
        weights_hash=weights_hash,
        n=n,
        accuracy=sum(correct) / n if n else 0.0,
        mean_reward=sum(sum(c.values()) for _, c in scored) / n if n else 0.0,
        answers={it.id: t for it, t in zip(prompt_set.eval, texts, strict=True)},
    )
