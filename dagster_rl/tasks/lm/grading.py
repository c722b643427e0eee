"""How the LLM judge grades a language model's completion: its prompt, and the reward for its grade.

The verifier decides correctness (the extracted answer against the reference: the rubric's
`accuracy`); the LLM grades the rubric's other criterion, the form of the answer (`format`: the
reasoning shown and the final answer given as the rubric's `format_rule` asks), with a score in
[0, 1] that replaces the rule-based format check:

    reward = accuracy * [answer == reference] + format * grade

The question is looked up by the rollout's prompt id in its experiment's prompt set, so the
rollouts store nothing for the judge that they did not store before. A rubric's reward functions
(`kind: functions`) add their terms as they do without the LLM judge.
"""

from dagster_rl.tasks.lm.data.prompts import items_by_id
from dagster_rl.tasks.lm.experiment import LMExperiment
from dagster_rl.tasks.lm.records import LMRollout
from dagster_rl.tasks.lm.rewards import LMReward, score_rollout

FORMS = {
    "ends_with_number": "the answer ends with the final number, nothing after it but a period",
    "gsm8k": "the answer shows its reasoning step by step and ends with a line '#### <final number>'",
}
SYSTEM_PROMPT = (
    "You grade a language model's answer to a question whose correct final answer is known. "
    "Rubric (weights): accuracy {accuracy}, decided by a verifier, not by you; format {format}: {form}. "
    "Grade only the format criterion: 1 when the answer meets it fully, 0 when not at all. "
    "Reply with one line: SCORE: <a number from 0 to 1>."
)


class LMGrading:
    prompt_version = "lm-judge-prompt-1"

    def messages(self, exp: LMExperiment, rollout: LMRollout) -> list[dict[str, str]]:
        item = items_by_id(exp.task.source, exp.seed).get(rollout.prompt_id)
        if item is None:
            raise ValueError(
                f"rollout {rollout.trial_id} answers prompt {rollout.prompt_id}, which is not in experiment {exp.name}'s "
                "prompt set; the rollouts were made with another task.source"
            )
        rubric = exp.rubric
        return [
            {
                "role": "system",
                "content": SYSTEM_PROMPT.format(accuracy=rubric.accuracy, format=rubric.format, form=FORMS[rubric.format_rule]),
            },
            {
                "role": "user",
                "content": f"Question:\n{item.question}\n\nCorrect final answer: {rollout.reference}\n\nAnswer to grade:\n{rollout.completion_text}",
            },
        ]

    def reward(self, exp: LMExperiment, rollout: LMRollout, grade: float) -> LMReward:
        """The verifier's accuracy, plus the LLM's grade in [0, 1] scaled by the rubric's format weight, plus
        the reward functions' terms."""
        verified = score_rollout(exp, rollout)
        functions = {k: v for k, v in verified.components.items() if k not in ("accuracy", "format")}
        components = {"accuracy": verified.components["accuracy"], "llm": grade, **functions}
        reward = components["accuracy"] + exp.rubric.format * grade + sum(functions.values())
        return verified.model_copy(update={"components": components, "reward": reward})
