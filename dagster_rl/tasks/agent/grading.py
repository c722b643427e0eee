"""How the LLM judge grades an agent's episode: its prompt, and the reward for its grade.

The environment's verdict decides success (the rubric's `correctness`); the LLM grades the rubric's
other criterion, the episode's efficiency, with a score in [0, 1] that replaces the rule-based
turn count:

    reward = correctness * [success] + efficiency * [success] * grade

The prompt is the episode as the trajectory records it: the first observation, then each turn's
action and the environment's answer, and how it ended.
"""

from dagster_rl.tasks.agent.experiment import AgentExperiment
from dagster_rl.tasks.agent.judge import judge
from dagster_rl.tasks.agent.records import AgentReward, AgentTrajectory

SYSTEM_PROMPT = (
    "You grade an agent's episode in a text environment. The environment has decided whether it succeeded; "
    "you do not. Rubric (weights): success {correctness}, decided by the environment; efficiency {efficiency}: "
    "1 when every action moved straight to the goal, 0 when most actions were wasted. Grade only efficiency. "
    "Reply with one line: SCORE: <a number from 0 to 1>."
)


def transcript(trajectory: AgentTrajectory) -> str:
    """The episode as text: what the agent saw and did, turn by turn."""
    lines = [f"First observation:\n{trajectory.first_observation}", ""]
    for i, turn in enumerate(trajectory.turns):
        lines.append(f"Turn {i + 1} action: {turn.action}")
        if turn.observation:
            lines.append(f"Turn {i + 1} observation: {turn.observation}")
    lines.append(f"\nEnded: {trajectory.end_reason}; succeeded: {'yes' if trajectory.success else 'no'}")
    return "\n".join(lines)


class AgentGrading:
    prompt_version = "agent-judge-prompt-1"

    def messages(self, exp: AgentExperiment, trajectory: AgentTrajectory) -> list[dict[str, str]]:
        rubric = exp.rubric
        return [
            {"role": "system", "content": SYSTEM_PROMPT.format(correctness=rubric.correctness, efficiency=rubric.efficiency)},
            {"role": "user", "content": f"Episode to grade:\n{transcript(trajectory)}"},
        ]

    def reward(self, exp: AgentExperiment, trajectory: AgentTrajectory, grade: float) -> AgentReward:
        """The environment's success, plus the LLM's grade in [0, 1] scaled by the rubric's efficiency, on success."""
        verified = judge(trajectory, exp.rubric, exp.task.episode.max_turns)
        success = float(verified.correct)
        components = {"correctness": verified.components["correctness"], "llm": grade}
        return verified.model_copy(
            update={"components": components, "reward": components["correctness"] + exp.rubric.efficiency * success * grade}
        )
