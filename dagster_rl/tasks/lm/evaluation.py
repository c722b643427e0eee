"""Held-out evaluation of a policy: greedy completions of the eval split, scored by the rubric.

`accuracy` is the mean of the verifier's scores (the fraction answered right; a reasoning-gym
dataset's partial credit counts as it scores), `mean_reward` the mean of the rubric's rewards, the
reward functions' included. A reward function or verifier that fails on a held-out answer (after
`RETRIES` more tries) fails the evaluation, naming it: never a score of 0.
"""

from concurrent.futures import ThreadPoolExecutor

from dagster_rl.base.retries import with_retries
from dagster_rl.core.records import Record
from dagster_rl.tasks.lm.data.prompts import PromptItem, PromptSet
from dagster_rl.tasks.lm.model.policy import Policy
from dagster_rl.tasks.lm.rewards import LMRubric, Scored, Scorer
from dagster_rl.tasks.lm.rollout.hf import greedy_generations
from dagster_rl.tasks.lm.verifiers import Verifier

RETRIES = 2  # as the judge environment's default: a call that timed out under load may pass the next time


class Evaluation(Record):
    """Greedy accuracy and mean reward of one policy on the held-out prompts (stored per weights),
    and each prompt's greedy answer (prompt id -> completion text)."""

    weights_hash: str  # content hash of the evaluated weights; "" for a policy that is not stored
    n: int
    accuracy: float
    mean_reward: float
    answers: dict[str, str] = {}


def evaluate(
    policy: Policy, prompt_set: PromptSet, scorer: Scorer | LMRubric, max_new_tokens: int, weights_hash: str = ""
) -> Evaluation:
    """`scorer`: the experiment's (`rewards.scorer_of`), or a built-in rubric (the number rule)."""
    if not isinstance(scorer, Scorer):
        scorer = Scorer(scorer, Verifier("number"), ())
    generated = greedy_generations(policy, prompt_set.eval, prompt_set.template, max_new_tokens)

    def one(item: PromptItem, text: str, ids: list[int]) -> Scored:
        what = f"scoring the greedy answer to held-out prompt {item.id}"
        return with_retries(what, lambda _: scorer.score(f"eval:{item.id}", item, item.reference, text, ids), RETRIES, 1e9)

    work = [(it, text, ids) for it, (text, ids) in zip(prompt_set.eval, generated, strict=True)]
    workers = scorer.workers()
    if workers is None:
        scored = [one(*w) for w in work]
    else:  # each answer waits on a worker process: as many at once as there are workers
        with ThreadPoolExecutor(workers.size, "evaluate-score") as pool:
            scored = list(pool.map(lambda w: one(*w), work))
    n = len(scored)
    return Evaluation(
        weights_hash=weights_hash,
        n=n,
        accuracy=sum(s.score for s in scored) / n if n else 0.0,
        mean_reward=sum(s.reward for s in scored) / n if n else 0.0,
        answers={it.id: text for it, (text, _) in zip(prompt_set.eval, generated, strict=True)},
    )
