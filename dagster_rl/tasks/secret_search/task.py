"""The secret_search task, registered: an agent searches sandboxed worlds for a secret's digest."""

from dagster_rl.core.task import RolloutEnv, Task, TrainerEnv, register
from dagster_rl.tasks.secret_search.backends import (
    SandboxRollouts,
    SecretSearchRolloutBackend,
    SecretSearchTrainerBackend,
    TabularTrainer,
)
from dagster_rl.tasks.secret_search.experiment import SecretSearchExperiment
from dagster_rl.tasks.secret_search.grading import SecretSearchGrading
from dagster_rl.tasks.secret_search.judge import score
from dagster_rl.tasks.secret_search.loop import SecretSearchLoop


def _sandbox(exp: SecretSearchExperiment, env: RolloutEnv) -> SecretSearchRolloutBackend:
    return SandboxRollouts(env.scratch_dir / "dagster_rl_sandboxes", env.limits)


def _in_process(exp: SecretSearchExperiment, env: TrainerEnv) -> SecretSearchTrainerBackend:
    return TabularTrainer(env.limits)


TASK = register(
    Task(
        kind="secret_search",
        experiment=SecretSearchExperiment,
        loop=SecretSearchLoop,
        score=score,
        rollout={"sandbox": _sandbox},
        trainer={"in_process": _in_process},
        grading=SecretSearchGrading(),
        status_columns={"mean_turns": "mean_turns"},
    )
)
