"""The language-model experiment: GRPO over a LoRA adapter on prompts with verifiable answers."""

from typing import Literal

from pydantic import Field, model_validator

from dagster_rl.experiment import Experiment, Strict
from dagster_rl.lm.settings import GRPOLMSettings, LMRubric, PolicySettings, SamplingSettings, WarmupSettings
from dagster_rl.lm.prompts import PromptSource, SyntheticPrompts


class VerifiablePromptsTask(Strict):
    kind: Literal["verifiable_prompts"] = "verifiable_prompts"
    source: PromptSource = SyntheticPrompts()
    eval_max_new_tokens: int | None = Field(None, ge=1, description="greedy evaluation length; default: sampling's")


class LMTrainerSettings(Strict):
    """Where the update runs. `torchrun`: `nproc_per_node` worker processes on this machine (gloo on
    the CPU, nccl with CUDA) through the same entrypoint the Kubernetes pods run."""

    backend: Literal["in_process", "torchrun"] = "in_process"
    nproc_per_node: int = Field(1, ge=1)
    threads_per_process: int = Field(1, ge=1, description="torch threads of each trainer process")


class LMExperiment(Experiment):
    task: VerifiablePromptsTask
    policy: PolicySettings
    sampling: SamplingSettings = SamplingSettings()
    rubric: LMRubric = LMRubric()
    grpo: GRPOLMSettings = GRPOLMSettings()
    trainer: LMTrainerSettings = LMTrainerSettings()
    warmup: WarmupSettings | None = Field(None, description="supervised warm-up of the adapter before step 0 (`<exp>/sft`)")
    max_policy_lag: Literal[0, 1] = Field(
        0, description="1: generate step k+1 with the weights of step k-1 while step k trains (the clipped ratio corrects)"
    )
    generation_threads: int = Field(1, ge=1, description="torch threads of generation in the driver process")

    NOT_TRAINING = Experiment.NOT_TRAINING | {"generation_threads", "trainer"}

    @model_validator(mode="after")
    def _reference_exists(self) -> "LMExperiment":
        if self.grpo.kl_reference == "sft" and self.warmup is None:
            raise ValueError("grpo.kl_reference: sft needs a supervised warm-up: add a `warmup` section, or use kl_reference: base")
        return self

    def training_inputs(self) -> dict:
        # the trainer's backend and threads do not change the numbers; its world size does (all-reduce order)
        return super().training_inputs() | {"world_size": self.world_size}

    def backends(self) -> dict[str, str]:
        return {"rollout": "hf", "trainer": self.trainer.backend}

    @property
    def eval_max_new_tokens(self) -> int:
        return self.task.eval_max_new_tokens or self.sampling.max_new_tokens

    @property
    def world_size(self) -> int:
        return self.trainer.nproc_per_node if self.trainer.backend == "torchrun" else 1
