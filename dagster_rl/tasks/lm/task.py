"""The language-model task, registered: GRPO over a LoRA adapter on prompts with verifiable answers.

Its loop and backends import torch, so they are imported when a run builds them, not when the
code location loads its experiments.
"""

from dagster_rl.core.task import (
    CheckSpec,
    Command,
    RolloutEnv,
    StepAssetSpec,
    Task,
    TrainerEnv,
    WarmupResult,
    WarmupSpec,
    register,
)
from dagster_rl.store.artifact_store import ArtifactStore
from dagster_rl.tasks.lm.backend_protocols import LMRolloutBackend, LMTrainerBackend
from dagster_rl.tasks.lm.experiment import LMExperiment
from dagster_rl.tasks.lm.grading import LMGrading
from dagster_rl.tasks.lm.rewards import score_rollout


def _loop():
    from dagster_rl.tasks.lm.loop import LMLoop

    return LMLoop()


def _warmup(exp: LMExperiment, store: ArtifactStore) -> WarmupResult:
    from dagster_rl.tasks.lm.loop import LMLoop

    return LMLoop().warmup(exp, store)


def _hf(exp: LMExperiment, env: RolloutEnv) -> LMRolloutBackend:
    from dagster_rl.tasks.lm.backends import HFRollouts

    return HFRollouts(limits=env.limits)


def _openai_server(exp: LMExperiment, env: RolloutEnv) -> LMRolloutBackend:
    from dagster_rl.tasks.lm.rollout.openai_client import server_rollouts

    return server_rollouts(exp, env)


def _in_process(exp: LMExperiment, env: TrainerEnv) -> LMTrainerBackend:
    from dagster_rl.tasks.lm.backends import LMTrainer

    return LMTrainer(limits=env.limits)


def _torchrun(exp: LMExperiment, env: TrainerEnv) -> LMTrainerBackend:
    from dagster_rl.tasks.lm.backends import LMTrainer, subprocess_launch, subprocess_start

    return LMTrainer(
        limits=env.limits,
        launch=env.launch or subprocess_launch,
        start=env.start or subprocess_start,
        nproc_per_node=exp.trainer.nproc_per_node,
        threads_per_process=exp.trainer.threads_per_process,
    )


def _k8s(exp: LMExperiment, env: TrainerEnv) -> LMTrainerBackend:
    from dagster_rl.tasks.lm.backends import LMTrainer

    if env.pods is None:
        raise ValueError(
            f"experiment {exp.name} trains with trainer backend k8s, but the trainer environment has no Kubernetes "
            "launcher: set TrainerEnvironment(k8s=PipesK8sJobLauncher(...)) (or DAGSTER_RL_K8S_IMAGE, see docs/kubernetes.md)"
        )
    return LMTrainer(
        limits=env.limits,
        nproc_per_node=exp.trainer.nproc_per_node,
        threads_per_process=exp.trainer.threads_per_process,
        workdir=env.pods.workdir,
        pods=env.pods,
    )


def _serve_arguments(parser):
    from dagster_rl.tasks.lm.serve.cli import add_arguments

    add_arguments(parser)


def _serve(args) -> None:
    from dagster_rl.tasks.lm.serve.app import main

    main(args)


SERVE = Command(
    help="serve a model (and LoRA adapters) over the subset of vLLM's OpenAI-compatible API the openai_server backend uses",
    add_arguments=_serve_arguments,
    run=_serve,
)

TASK = register(
    Task(
        kind="verifiable_prompts",
        experiment=LMExperiment,
        loop=_loop,
        score=score_rollout,
        rollout={"hf": _hf, "openai_server": _openai_server},
        trainer={"in_process": _in_process, "torchrun": _torchrun, "k8s": _k8s},
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
        commands={"serve": SERVE},
        checks=(
            CheckSpec(
                "on_policy",
                "Where the rollouts' behavior policy is the trained policy, the trainer's log-probability of every sampled "
                "token equals the sampler's within the dtype's tolerance (float32: max and mean 1e-3; bfloat16: max 1.0, mean "
                "0.02); lagged steps report the drift. "
                "A failure moves the step's rollouts aside and names the likely causes.",
            ),
        ),
        status_columns={"heldout_acc": "accuracy"},  # of the step's `evaluation`, and of the warm-up
    )
)
