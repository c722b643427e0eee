"""The settings of a secret_search experiment: its worlds, rubric and tabular GRPO update."""

from typing import Literal

from pydantic import Field, model_validator

from dagster_rl.base import bounds
from dagster_rl.base.strict import Strict
from dagster_rl.core.experiment import ADVANTAGE_EPS, Experiment

MAX_DOCS_PER_STEP = 100_000  # documents of the worlds a step uses: written once, read by every trial


class SecretSearchTask(Strict):
    """The agentic sandbox world: find the document holding the digest of the world's secret."""

    kind: Literal["secret_search"] = Field("secret_search", description="the task kind: selects the experiment class")
    n_worlds: int = Field(3, ge=1, le=1000, description="sandbox worlds; prompt p plays world p mod n_worlds")
    n_docs: int = Field(8, ge=2, le=1000, description="documents per world, one of them holding the digest")
    max_turns: int = Field(4, ge=1, le=bounds.MAX_TURNS, description="documents an agent may open in an episode")
    scratch_rate: float = Field(0.3, ge=0.0, le=1.0, description="chance an agent leaves a scratch file")


class Rubric(Strict):
    """How the judge scores a trajectory on top of the verifier: reward = verified + score."""

    name: str = Field("default", description="the rubric's name, recorded with the rewards (lineage shows it)")
    correctness: float = Field(1.0, ge=0.0, le=bounds.MAX_REWARD_WEIGHT, description="weight of a verified answer")
    efficiency: float = Field(
        0.5,
        ge=0.0,
        le=bounds.MAX_REWARD_WEIGHT,
        description="weight of (max_turns - turns + 1) / max_turns, for a verified answer",
    )
    tidiness: float = Field(0.2, ge=0.0, le=bounds.MAX_REWARD_WEIGHT, description="weight of leaving no scratch file behind")

    @property
    def weight_total(self) -> float:
        """The most the rubric's score can add to the verifier's 1."""
        return self.correctness + self.efficiency + self.tidiness

    @property
    def max_reward(self) -> float:
        return 1.0 + self.weight_total


class GRPOSettings(Strict):
    learning_rate: float = Field(
        1.0, gt=0.0, le=bounds.MAX_TABULAR_LEARNING_RATE, description="step size of the update of each world's document logits"
    )
    advantage_eps: float = Field(1e-4, gt=0.0, le=bounds.MAX_EPS, description=ADVANTAGE_EPS)


class SecretSearchExperiment(Experiment):
    """The agentic loop: sandboxed episodes, verifier + rubric judge, tabular document priors."""

    task: SecretSearchTask = Field(description="the worlds the agents search")
    rubric: Rubric = Field(Rubric(), description="the judge's score on top of the verifier's")
    grpo: GRPOSettings = Field(GRPOSettings(), description="the tabular GRPO update of the document priors")

    @model_validator(mode="after")
    def _bounded_worlds(self) -> "SecretSearchExperiment":
        used = min(self.task.n_worlds, self.prompts_per_step)  # prompt p plays world p mod n_worlds
        if used * self.task.n_docs > MAX_DOCS_PER_STEP:
            raise ValueError(
                f"a step uses {used} worlds of {self.task.n_docs} documents = {used * self.task.n_docs} documents, more than "
                f"{MAX_DOCS_PER_STEP}; use fewer documents per world or fewer prompts per step"
            )
        return self

    def backends(self) -> dict[str, str]:
        return {"rollout": "sandbox", "trainer": "in_process"}
