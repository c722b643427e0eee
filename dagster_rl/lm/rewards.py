"""The verifier and rubric of the language-model path: accuracy plus an optional format term.

reward = accuracy * [extracted answer == reference] + format * [the completion ends with its answer]
(after the last number only whitespace or a period).
"""

import re


from dagster_rl.lm.records import LMRollout
from dagster_rl.lm.settings import LMRubric
from dagster_rl.lm.prompts import extract_answer
from dagster_rl.records import Record

ENDS_WITH_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?[\s.]*$")


class LMReward(Record):
    trial_id: str
    step: int
    prompt: int
    answer: str | None
    reference: str
    correct: bool
    components: dict[str, float]
    reward: float


def score_text(completion: str, reference: str, rubric: LMRubric) -> tuple[str | None, dict[str, float]]:
    """(extracted answer, {component: weighted value})."""
    answer = extract_answer(completion)
    return answer, {
        "accuracy": rubric.accuracy * float(answer is not None and answer == reference),
        "format": rubric.format * float(ENDS_WITH_NUMBER.search(completion) is not None),
    }


def score(rollout: LMRollout, rubric: LMRubric) -> LMReward:
    answer, components = score_text(rollout.completion_text, rollout.reference, rubric)
    return LMReward(
        trial_id=rollout.trial_id,
        step=rollout.step,
        prompt=rollout.prompt,
        answer=answer,
        reference=rollout.reference,
        correct=answer is not None and answer == rollout.reference,
        components=components,
        reward=sum(components.values()),
    )
