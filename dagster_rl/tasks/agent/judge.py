"""The agent's verifier and rubric: success, and fewer turns when it succeeds.

reward = correctness * [success] + efficiency * [success] * (max_turns - turns + 1) / max_turns

where success is the environment's verdict (for `secret_search`: the right digest answered within
the turn budget) and turns the actions the episode took. A failed episode scores 0, whatever its
length; among successes, one turn fewer is worth efficiency / max_turns more.
"""

from pydantic import Field

from dagster_rl.base import bounds
from dagster_rl.base.strict import Strict
from dagster_rl.tasks.agent.records import AgentReward, AgentTrajectory


class AgentRubric(Strict):
    name: str = Field("success_efficiency", description="the rubric's name, recorded with the rewards")
    correctness: float = Field(1.0, ge=0.0, le=bounds.MAX_REWARD_WEIGHT, description="reward of a successful episode")
    efficiency: float = Field(
        1.0,
        ge=0.0,
        le=bounds.MAX_REWARD_WEIGHT,
        description="weight of (max_turns - turns + 1) / max_turns, for a successful episode",
    )

    @property
    def max_reward(self) -> float:
        return self.correctness + self.efficiency


def judge(trajectory: AgentTrajectory, rubric: AgentRubric, max_turns: int) -> AgentReward:
    success, turns = trajectory.success, trajectory.n_turns
    components = {
        "correctness": rubric.correctness * float(success),
        "efficiency": rubric.efficiency * float(success) * (max_turns - turns + 1) / max_turns,
    }
    return AgentReward(
        trial_id=trajectory.trial_id,
        step=trajectory.step,
        prompt=trajectory.prompt,
        world_id=trajectory.world_id,
        correct=success,
        turns=turns,
        end_reason=trajectory.end_reason,
        components=components,
        reward=sum(components.values()),
    )
