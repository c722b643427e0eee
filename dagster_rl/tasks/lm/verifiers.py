"""How an answer is checked: the rubric's `answer_rule` (`number`, in this process; `math_verify`, in a
worker process), or the source's own scorer (reasoning-gym's `score_answer`, in a worker process).

Code of a library that parses what a model wrote (sympy under math-verify, a dataset's scorer) runs
where a hang can be stopped: `runtime.function_workers`, with `VERIFY_TIMEOUT_S` a call. The
number rule is a regular expression, in process, as it always was.
"""

from dataclasses import dataclass
from importlib.metadata import version
from typing import Any

from dagster_rl.runtime.function_workers import Callee
from dagster_rl.tasks.lm.data.gym import ReasoningGymPrompts, gym_version
from dagster_rl.tasks.lm.data.prompts import PromptItem, extract_answer

MATH_VERIFY = "dagster_rl.tasks.lm.verify_math:score"
GYM_SCORE = "dagster_rl.tasks.lm.data.gym_score:score"
VERIFY_TIMEOUT_S = 30.0  # a verification of one answer: sympy on a pathological expression can take forever


@dataclass(frozen=True)
class Verdict:
    answer: str | None  # what was read of the completion (None: nothing)
    score: float  # 1.0: right, 0.0: wrong; reasoning-gym's partial credit in between


@dataclass(frozen=True)
class Verifier:
    """The check of one experiment's answers."""

    rule: str  # "number", "math_verify" or "reasoning_gym"
    gym: ReasoningGymPrompts | None = None

    @property
    def callee(self) -> Callee | None:
        """What a worker process runs for it (None: it runs in this process)."""
        return {"number": None, "math_verify": Callee(MATH_VERIFY), "reasoning_gym": Callee(GYM_SCORE)}[self.rule]

    @property
    def needs_item(self) -> bool:
        """Whether it reads the prompt's item beyond its reference (reasoning-gym's entry)."""
        return self.gym is not None

    def key_inputs(self) -> dict[str, Any]:
        """What its verdicts depend on beyond the rubric and the prompts: the library's version, and a
        reasoning-gym dataset's scorer settings. {} for the number rule (the keys of every run before)."""
        if self.rule == "math_verify":
            return {"verifier": {"math_verify": version("math-verify")}}
        if self.gym is not None:
            g = self.gym
            return {"verifier": {"reasoning_gym": gym_version(), "dataset": g.dataset, "config": g.config, "extract": g.extract}}
        return {}

    def call(self, completion: str, item: PromptItem | None, reference: str) -> dict[str, Any] | None:
        """The keyword arguments of its worker call (None: judged in process by `verdict_here`)."""
        if self.rule == "math_verify":
            return {"completion": completion, "reference": reference}
        if self.gym is not None:
            assert item is not None
            entry = {
                "question": item.columns.get("question", item.question),
                "answer": reference,
                "metadata": item.columns.get("metadata", {}),
            }
            return {
                "dataset": self.gym.dataset,
                "config": self.gym.config,
                "answer": self.gym.answer_of(completion),
                "entry": entry,
            }
        return None

    def verdict(self, completion: str, reference: str, result: Any = None) -> Verdict:
        """The verdict from its worker's `result`, or (number rule) computed here."""
        if self.rule == "number":
            answer = extract_answer(completion)
            right = answer is not None and answer == (extract_answer(reference) or reference)
            return Verdict(answer, float(right))
        if self.rule == "math_verify":
            return Verdict(result["answer"], float(result["score"]))
        assert self.gym is not None
        score = float(result)
        if not 0.0 <= score <= 1.0:
            raise ValueError(f"reasoning-gym's {self.gym.dataset}.score_answer returned {score}, outside [0, 1]")
        return Verdict(self.gym.answer_of(completion), score)


def verifier_of(source: Any, answer_rule: str) -> Verifier:
    """The check an experiment's answers get: its source's own scorer when it has one, else the rubric's rule."""
    if isinstance(source, ReasoningGymPrompts):
        return Verifier("reasoning_gym", gym=source)
    return Verifier(answer_rule)
