"""The verifier and rubric of the language-model path: accuracy, an optional format term, and the
rubric's reward functions.

reward = accuracy * score + format * [the answer is given in form] + sum(weight_i * f_i), where

- score is the verifier's (`verifiers`): 1 for a right answer, 0 for a wrong one (the `number`
  rule: the answer extracted the GSM8K way, `#### <n>` else the last number, `prompts.extract_answer`;
  `math_verify`; a reasoning-gym dataset's `score_answer`, which may give partial credit);
- the form is the rubric's `format_rule`: `ends_with_number` (after the last number only whitespace
  or a period) or `gsm8k` (a `#### <number>` mark);
- f_i are the reward functions of a `functions` rubric (`reward_functions`), a None adding nothing.

A `Scorer` is what one step (or one evaluation) scores with: the rubric, the verifier and the
functions' sources as they were when it was made, so that the key it names and the scores it gives
agree even if a file is edited meanwhile.
"""

import re
from dataclasses import dataclass
from typing import Any, NamedTuple

from pydantic import Field

from dagster_rl.core.records import Record
from dagster_rl.runtime.function_workers import Callee, FunctionFailed, FunctionWorkers, workers_for
from dagster_rl.tasks.lm import reward_functions
from dagster_rl.tasks.lm.data.prompts import PromptItem, extract_answer, has_answer_mark, items_by_id
from dagster_rl.tasks.lm.records import LMRollout
from dagster_rl.tasks.lm.settings import AnyRubric, LMRubric, RubricTerms
from dagster_rl.tasks.lm.verifiers import VERIFY_TIMEOUT_S, Verifier, verifier_of

ENDS_WITH_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?[\s.]*$")


class LMReward(Record):
    trial_id: str
    step: int
    prompt: int
    answer: str | None
    reference: str
    correct: bool
    components: dict[str, float]  # each term's weighted value: accuracy, format, and each function with an opinion
    reward: float
    # each reward function's value as it returned it (None: no opinion); in no dump without functions (as before them)
    functions: dict[str, float | None] = Field(default_factory=dict, exclude_if=lambda functions: not functions)


def in_form(completion: str, rubric: RubricTerms) -> bool:
    """Whether the completion gives its answer in the form the rubric's `format_rule` asks for."""
    if rubric.format_rule == "gsm8k":
        return has_answer_mark(completion)
    return ENDS_WITH_NUMBER.search(completion) is not None


def score_text(completion: str, reference: str, rubric: RubricTerms) -> tuple[str | None, dict[str, float]]:
    """(extracted answer, {component: weighted value}) by the number rule."""
    answer = extract_answer(completion)
    return answer, {
        "accuracy": rubric.accuracy * float(answer is not None and answer == reference),
        "format": rubric.format * float(in_form(completion, rubric)),
    }


def score(rollout: LMRollout, rubric: LMRubric) -> LMReward:
    """A rollout's reward by the built-in rubric and the number rule (in memory: tests, benchmarks)."""
    answer, components = score_text(rollout.completion_text, rollout.reference, rubric)
    return _reward(rollout, answer, answer is not None and answer == rollout.reference, components, {})


def _reward(rollout: LMRollout, answer: str | None, correct: bool, components: dict[str, float], functions: dict) -> LMReward:
    return LMReward(
        trial_id=rollout.trial_id,
        step=rollout.step,
        prompt=rollout.prompt,
        answer=answer,
        reference=rollout.reference,
        correct=correct,
        components=components,
        reward=sum(components.values()),
        functions=functions,
    )


class Scored(NamedTuple):
    answer: str | None
    score: float  # the verifier's: 1.0 right
    components: dict[str, float]
    functions: dict[str, float | None]

    @property
    def correct(self) -> bool:
        return self.score >= 1.0

    @property
    def reward(self) -> float:
        return sum(self.components.values())


class VerifierError(RuntimeError):
    """The verifier gave no verdict for a trial (math-verify or a dataset's scorer raised, or ran past its deadline)."""


@dataclass(frozen=True)
class Scorer:
    """How completions are scored: a rubric, a verifier, and the rubric's functions as loaded now."""

    rubric: AnyRubric
    verifier: Verifier
    functions: tuple[Callee, ...]  # the rubric's functions, with their sources' hashes

    @property
    def callees(self) -> tuple[Callee, ...]:
        """What its worker processes load: the verifier's (if it runs in one), then the functions."""
        own = self.verifier.callee
        return ((own,) if own is not None else ()) + self.functions

    @property
    def needs_item(self) -> bool:
        """Whether a rollout's prompt item (its question, its columns) must be looked up to score it."""
        return bool(self.functions) or self.verifier.needs_item

    def key_inputs(self) -> dict[str, Any]:
        """What a key of what it scores holds beyond the rubric: {} for the built-in rubric and rule."""
        return {**self.verifier.key_inputs(), **reward_functions.key_inputs(self.functions)}

    def workers(self) -> FunctionWorkers | None:
        return workers_for(self.callees) if self.callees else None

    def without_functions(self) -> "Scorer":
        return Scorer(self.rubric, self.verifier, ())

    def score(self, trial_id: str, item: PromptItem | None, reference: str, completion: str, completion_ids: list[int]) -> Scored:
        """A completion's verdict, terms and function values. Raises `VerifierError` or
        `reward_functions.RewardFunctionError`: a failed judgement, never a score."""
        workers = self.workers()
        call = self.verifier.call(completion, item, reference)
        result = None
        if call is not None:
            assert workers is not None
            try:
                result = workers.call(0, call, VERIFY_TIMEOUT_S)
            except FunctionFailed as e:
                raise VerifierError(f"the {self.verifier.rule} verifier on trial {trial_id}: {e.detail}") from None
        verdict = self.verifier.verdict(completion, reference, result)
        components = {
            "accuracy": self.rubric.accuracy * verdict.score,
            "format": self.rubric.format * float(in_form(completion, self.rubric)),
        }
        values: dict[str, float | None] = {}
        offset = 0 if self.verifier.callee is None else 1
        for i, function in enumerate(self.rubric.functions if self.functions else ()):  # none: `without_functions`
            assert workers is not None and item is not None
            value = reward_functions.call(
                workers, offset + i, function, trial_id, item.question, completion, completion_ids, columns_of(item)
            )
            values[function.label] = value
            if value is not None:
                components[function.label] = function.weight * value
        return Scored(verdict.answer, verdict.score, components, values)


def columns_of(item: PromptItem) -> dict[str, Any]:
    """What reward functions get beside the prompt and completion: the reference as `answer`, and the
    row's columns (a data file's mapped columns, its answer as the file holds it; reasoning-gym's
    `question` and `metadata`)."""
    return {"answer": item.reference, **item.columns}


def scorer_of(exp: Any) -> Scorer:
    """The scorer of a language-model experiment: the one a step pinned on it (`pinned`), else made now
    (the functions' files read now)."""
    pinned = getattr(exp, "_scorer", None)
    if pinned is not None:
        return pinned
    rubric = exp.rubric
    return Scorer(rubric, verifier_of(exp.task.source, rubric.answer_rule), reward_functions.callees(rubric.functions))


def pinned(exp: Any) -> Any:
    """A copy of the experiment that scores with a scorer made now: what a step keys and scores with."""
    copy = exp.model_copy()
    copy._scorer = scorer_of(exp)
    return copy


def score_rollout(exp: Any, rollout: LMRollout) -> LMReward:
    """A rollout's reward by the experiment's scorer (the task's `score`, which the judge calls)."""
    scorer = scorer_of(exp)
    item = None
    if scorer.needs_item:
        item = items_by_id(exp.task.source, exp.seed).get(rollout.prompt_id)
        if item is None:
            raise ValueError(
                f"rollout {rollout.trial_id} answers prompt {rollout.prompt_id}, which is not in experiment {exp.name}'s "
                "prompt set; the rollouts were made with another task.source"
            )
    s = scorer.score(rollout.trial_id, item, rollout.reference, rollout.completion_text, rollout.completion_token_ids)
    return _reward(rollout, s.answer, s.correct, s.components, s.functions)
