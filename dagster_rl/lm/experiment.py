"""The language-model experiment: GRPO over a LoRA adapter on prompts with verifiable answers."""

from typing import Literal

from pydantic import Field, model_validator

from dagster_rl.experiment import Experiment, Strict
from dagster_rl.pods import PodResources
from dagster_rl.lm.settings import GRPOLMSettings, LMRubric, PolicySettings, SamplingSettings, WarmupSettings
from dagster_rl.lm.prompts import PromptSource, SyntheticPrompts


class VerifiablePromptsTask(Strict):
    kind: Literal["verifiable_prompts"] = "verifiable_prompts"
    source: PromptSource = SyntheticPrompts()
    eval_max_new_tokens: int | None = Field(None, ge=1, description="greedy evaluation length; default: sampling's")


class LMRolloutSettings(Strict):
    """How a step's rollouts are generated. `hf`: batched `transformers` generation in the driver's
    process. `openai_server`: a warm vLLM server (or `dagster-rl serve`) over its OpenAI-compatible
    API; where it is (URL, key, timeouts) is the rollout environment's setting, not the experiment's."""

    backend: Literal["hf", "openai_server"] = "hf"

    def cache_inputs(self) -> dict[str, str]:
        """What the engine adds to the rollouts' cache key: another engine samples other tokens from
        the same seeds (vLLM's sampler), so its rollouts are other artifacts. (`hf`: nothing, the
        keys of every run so far.)"""
        return {} if self.backend == "hf" else {"engine": self.backend}


class LMTrainerSettings(Strict):
    """Where the update runs. `torchrun`: `nproc_per_node` worker processes on this machine (gloo on
    the CPU, nccl with CUDA) through the same entrypoint the Kubernetes pods run. `k8s`: an Indexed
    Job of `nodes` pods of `nproc_per_node` processes each (`pods` says what each pod needs),
    restarted as a whole on any pod failure up to `max_restarts` times.

    `session: range` (torchrun, k8s): the workers start once per range of steps, with its first
    step that trains, and keep the model and optimizer state in memory between steps. `step`: every
    update is a launch of its own that loads everything afresh (a preemptible pool may prefer it).
    Both store the same bytes."""

    backend: Literal["in_process", "torchrun", "k8s"] = "in_process"
    session: Literal["range", "step"] = Field("range", description="torchrun, k8s: workers for a range of steps, or a launch per step")
    session_idle_timeout_s: int = Field(
        1800,
        ge=1,
        le=7 * 24 * 3600,
        description="a session's workers stop when no step came for this long (the next step starts new ones); on k8s "
        "this is what ends the pods of a driver that died",
    )
    nproc_per_node: int = Field(1, ge=1, description="processes per node (one per GPU)")
    threads_per_process: int = Field(1, ge=1, description="torch threads of each trainer process")
    nodes: int = Field(1, ge=1, description="k8s: pods of the Job")
    max_restarts: int = Field(0, ge=0, description="k8s: restarts of the whole set of pods after a pod fails (per step in a session)")
    active_deadline_s: int = Field(3600, ge=60, description="k8s: a step fails after this long (a session's Job: after n_steps times this)")
    pods: PodResources = Field(default_factory=PodResources, description="k8s: what each trainer pod needs")

    @model_validator(mode="after")
    def _nodes_need_k8s(self) -> "LMTrainerSettings":
        if self.nodes > 1 and self.backend != "k8s":
            raise ValueError(f"nodes: {self.nodes} needs backend: k8s (backend {self.backend} runs on one machine)")
        return self

    @property
    def world_size(self) -> int:
        return {"in_process": 1, "torchrun": self.nproc_per_node, "k8s": self.nodes * self.nproc_per_node}[self.backend]


class LMExperiment(Experiment):
    task: VerifiablePromptsTask
    policy: PolicySettings
    sampling: SamplingSettings = SamplingSettings()
    rubric: LMRubric = LMRubric()
    grpo: GRPOLMSettings = GRPOLMSettings()
    rollout: LMRolloutSettings = LMRolloutSettings()
    trainer: LMTrainerSettings = LMTrainerSettings()
    warmup: WarmupSettings | None = Field(None, description="supervised warm-up of the adapter before step 0 (`<exp>/sft`)")
    max_policy_lag: Literal[0, 1] = Field(
        0, description="1: generate step k+1 with the weights of step k-1 while step k trains (the clipped ratio corrects)"
    )
    generation_threads: int = Field(1, ge=1, description="torch threads of generation in the driver process")

    NOT_TRAINING = Experiment.NOT_TRAINING | {"generation_threads", "trainer", "rollout"}

    @model_validator(mode="after")
    def _reference_exists(self) -> "LMExperiment":
        if self.grpo.kl_reference == "sft" and self.warmup is None:
            raise ValueError("grpo.kl_reference: sft needs a supervised warm-up: add a `warmup` section, or use kl_reference: base")
        return self

    def training_inputs(self) -> dict:
        # the trainer's backend and threads do not change the numbers; its world size does (all-reduce order)
        return super().training_inputs() | {"world_size": self.world_size}

    def backends(self) -> dict[str, str]:
        return {"rollout": self.rollout.backend, "trainer": self.trainer.backend}

    @property
    def eval_max_new_tokens(self) -> int:
        return self.task.eval_max_new_tokens or self.sampling.max_new_tokens

    @property
    def world_size(self) -> int:
        return self.trainer.world_size
