"""The secret_search task, registered: an agent searches sandboxed worlds for a secret's digest."""

from dagster_rl.tasks.secret_search.backends import SandboxRollouts, TabularTrainer
from dagster_rl.tasks.secret_search.experiment import SecretSearchExperiment
from dagster_rl.tasks.secret_search.grading import SecretSearchGrading
from dagster_rl.tasks.secret_search.judge import score
from dagster_rl.tasks.secret_search.loop import SecretSearchLoop
from dagster_rl.core.task import Task, register

TASK = register(
    Task(
        kind="secret_search",
        experiment=SecretSearchExperiment,
        loop=SecretSearchLoop,
        score=score,
        rollout={"sandbox": lambda exp, env: SandboxRollouts(env.scratch_dir / "dagster_rl_sandboxes", env.limits)},
        trainer={"in_process": lambda exp, env: TabularTrainer(env.limits)},
        grading=SecretSearchGrading(),
        status_columns={"mean_turns": "mean_turns"},
    )
)
