"""The per-step assets of an experiment's group, by name: the chain `rollouts -> rewards -> weights`,
then the task's own (a language model's held-out `evaluation`).

No Dagster import: `dagster-rl` reads these names without loading Dagster's definitions.
"""

from dagster_rl.core.experiment import Experiment
from dagster_rl.core.task import task_of

CHAIN = ("rollouts", "rewards", "weights")
CHAIN_DESCRIPTIONS = {
    "rollouts": "Trajectories of every trial of the step, generated with the previous step's weights.",
    "rewards": "Verifier + rubric reward of every trajectory of the step, sorted by trial id.",
    "weights": "The policy after the step's GRPO update: the step's checkpoint.",
}


def step_assets(exp: Experiment) -> dict[str, str]:
    """The per-step assets of an experiment's group, in order, with their descriptions: the chain,
    then the task's own (a language model's held-out `evaluation`)."""
    return CHAIN_DESCRIPTIONS | {spec.name: spec.description for spec in task_of(exp.kind).step_assets}
