"""How the LLM judge grades a secret_search trajectory: its prompt, and the reward for its grade."""

from dagster_rl.base.hashing import canonical_json
from dagster_rl.tasks.secret_search.experiment import SecretSearchExperiment
from dagster_rl.tasks.secret_search.judge import score
from dagster_rl.tasks.secret_search.records import Reward, Trajectory

SYSTEM_PROMPT = (
    "You grade the trajectory of an agent that searched a sandboxed folder of documents for the "
    "digest of a secret. Rubric (weights): correctness {correctness}, efficiency {efficiency}, "
    "tidiness {tidiness}. Correct answers found in few turns without leaving files behind score "
    "highest. Reply with one line: SCORE: <a number from 0 to 1>."
)


class SecretSearchGrading:
    prompt_version = "llm-judge-prompt-1"

    def messages(self, exp: SecretSearchExperiment, traj: Trajectory) -> list[dict[str, str]]:
        shown = traj.model_dump(mode="json", exclude={"seed", "behavior_version"})
        return [
            {"role": "system", "content": SYSTEM_PROMPT.format(**exp.rubric.model_dump())},
            {
                "role": "user",
                "content": f"Turn limit: {exp.task.max_turns}.\nTrajectory (JSON):\n{canonical_json(shown).decode()}",
            },
        ]

    def reward(self, exp: SecretSearchExperiment, traj: Trajectory, grade: float) -> Reward:
        """The verifier's verdict plus the LLM's grade in [0, 1], scaled by the rubric's weights."""
        verified = score(exp, traj)
        graded = exp.rubric.weight_total * grade
        return verified.model_copy(
            update={"components": {"llm": grade}, "score": graded, "reward": float(verified.verified) + graded}
        )
