"""The language-model task, registered: GRPO over a LoRA adapter on prompts with verifiable answers.

Its loop and backends import torch, so they are imported when a run builds them, not when the
code location loads its experiments.
"""

from dagster_rl.lm.experiment import LMExperiment
from dagster_rl.lm.grading import LMGrading
from dagster_rl.lm.rewards import score
from dagster_rl.store import ArtifactStore
from dagster_rl.task import RolloutEnv, StepAssetSpec, Task, TrainerEnv, WarmupResult, WarmupSpec, register


def _loop():
    from dagster_rl.lm.loop import LMLoop

    return LMLoop()


def _warmup(exp: LMExperiment, store: ArtifactStore) -> WarmupResult:
    from dagster_rl.lm.loop import LMLoop

    return LMLoop().warmup(exp, store)


def _hf(exp: LMExperiment, env: RolloutEnv):
    from dagster_rl.lm.backends import HFRollouts

    return HFRollouts(limits=env.limits)


def _in_process(exp: LMExperiment, env: TrainerEnv):
    from dagster_rl.lm.backends import LMTrainer

    return LMTrainer(limits=env.limits)


def _torchrun(exp: LMExperiment, env: TrainerEnv):
    from dagster_rl.lm.backends import LMTrainer, subprocess_launch

    return LMTrainer(
        limits=env.limits,
        launch=env.launch or subprocess_launch,
        nproc_per_node=exp.trainer.nproc_per_node,
        threads_per_process=exp.trainer.threads_per_process,
    )


TASK = register(
    Task(
        kind="verifiable_prompts",
        experiment=LMExperiment,
        loop=_loop,
        score=lambda exp, rollout: score(rollout, exp.rubric),
        rollout={"hf": _hf},
        trainer={"in_process": _in_process, "torchrun": _torchrun},
        grading=LMGrading(),
        warmup=WarmupSpec(
            "sft",
            "Supervised warm-up: the adapter fitted to worked answers of training prompts, which step 0 starts from; "
            "its held-out greedy accuracy beside the base's.",
            applies=lambda exp: exp.warmup is not None,
            run=_warmup,
        ),
        step_assets=(
            StepAssetSpec(
                "evaluation",
                "Greedy accuracy of the step's weights on the held-out prompts (base model's too), off the critical path.",
            ),
        ),
    )
)
