"""The language-model agent task, registered: GRPO over a LoRA policy that acts in a text environment.

Its loop and backends import torch, so they are imported when a run builds them, not when the
code location loads its experiments. Its trainer backends are the language-model task's.
"""

from dagster_rl.core.task import RolloutEnv, StepAssetSpec, Task, WarmupResult, WarmupSpec, register
from dagster_rl.store.artifact_store import ArtifactStore
from dagster_rl.tasks.agent.experiment import AgentExperiment
from dagster_rl.tasks.agent.grading import AgentGrading
from dagster_rl.tasks.agent.judge import judge
from dagster_rl.tasks.lm.task import TASK as LM_TASK


def _loop():
    from dagster_rl.tasks.agent.loop import AgentLoop

    return AgentLoop()


def _warmup(exp: AgentExperiment, store: ArtifactStore) -> WarmupResult:
    from dagster_rl.tasks.agent.loop import AgentLoop

    return AgentLoop().warmup(exp, store)


def _sandboxes(exp: AgentExperiment, env: RolloutEnv):
    """The sandbox tier's placement, checked before the first step when the environment runs programs
    (a `SandboxUnavailable` naming what to install); None when it runs none."""
    from dagster_rl.tasks.agent.loop import AgentLoop

    return AgentLoop(env.sandboxes).sandboxes_for(exp)


def _hf(exp: AgentExperiment, env: RolloutEnv):
    from dagster_rl.tasks.agent.backends import AgentHFRollouts

    return AgentHFRollouts(env.scratch_dir / "dagster_rl_sandboxes", limits=env.limits, sandboxes=_sandboxes(exp, env))


def _openai_server(exp: AgentExperiment, env: RolloutEnv):
    from dagster_rl.tasks.agent.rollout_server import AgentServerRollouts
    from dagster_rl.tasks.lm.rollout.openai_client import server_rollouts

    return AgentServerRollouts(server_rollouts(exp, env), env.scratch_dir / "dagster_rl_sandboxes", _sandboxes(exp, env))


TASK = register(
    Task(
        kind="text_agent",
        experiment=AgentExperiment,
        loop=_loop,
        score=lambda exp, trajectory: judge(trajectory, exp.rubric, exp.task.episode.max_turns),
        rollout={"hf": _hf, "openai_server": _openai_server},
        trainer=LM_TASK.trainer,
        warmup=WarmupSpec(
            "sft",
            "Supervised warm-up: the adapter fitted to the environment's demonstrations (valid, inefficient episodes), "
            "which step 0 starts from; its held-out greedy success and mean turns beside the base's.",
            applies=lambda exp: exp.warmup is not None,
            run=_warmup,
        ),
        step_assets=(
            StepAssetSpec(
                "evaluation",
                "Greedy episodes of the step's weights on held-out worlds: success and mean turns, beside the warm-up's "
                "(start_*) and the base model's; off the critical path.",
            ),
        ),
        checks=LM_TASK.checks,
        grading=AgentGrading(),
        status_columns={"mean_turns": "mean_turns", "heldout_success": "success"},
    )
)
