"""The verifier and rubric of the language-model path: accuracy plus an optional format term.

reward = accuracy * [extracted answer == reference] + format * [the answer is given in form], where
the form is the rubric's `format_rule`: `ends_with_number` (after the last number only whitespace or
a period) or `gsm8k` (a `#### <number>` mark). The answer is extracted the GSM8K way (`#### <n>`,
else the last number: `prompts.extract_answer`).
"""

import re

from dagster_rl.core.records import Record
from dagster_rl.tasks.lm.data.prompts import extract_answer, has_answer_mark
from dagster_rl.tasks.lm.records import LMRollout
from dagster_rl.tasks.lm.settings import LMRubric

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


def in_form(completion: str, rubric: LMRubric) -> bool:
    """Whether the completion gives its answer in the form the rubric's `format_rule` asks for."""
    if rubric.format_rule == "gsm8k":
        return has_answer_mark(completion)
    return ENDS_WITH_NUMBER.search(completion) is not None


def score_text(completion: str, reference: str, rubric: LMRubric) -> tuple[str | None, dict[str, float]]:
    """(extracted answer, {component: weighted value})."""
    answer = extract_answer(completion)
    return answer, {
        "accuracy": rubric.accuracy * float(answer is not None and answer == reference),
        "format": rubric.format * float(in_form(completion, rubric)),
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
