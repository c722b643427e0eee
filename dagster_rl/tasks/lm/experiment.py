"""The language-model experiment: GRPO over a LoRA adapter on prompts with verifiable answers."""

from typing import Any, Literal

from pydantic import Field, PrivateAttr, model_validator

from dagster_rl.base import bounds
from dagster_rl.base.strict import Strict
from dagster_rl.core.experiment import Checks, Experiment
from dagster_rl.runtime.pods import PodResources
from dagster_rl.tasks.lm.data.gym import ReasoningGymPrompts
from dagster_rl.tasks.lm.data.prompts import SyntheticPrompts
from dagster_rl.tasks.lm.data.sources import PromptSource
from dagster_rl.tasks.lm.settings import (
    FunctionsRubric,
    GRPOLMSettings,
    LMRubric,
    PolicySettings,
    Rubric,
    RubricTerms,
    SamplingSettings,
    WarmupSettings,
)


class VerifiablePromptsTask(Strict):
    kind: Literal["verifiable_prompts"] = Field("verifiable_prompts", description="the task kind: selects the experiment class")
    source: PromptSource = Field(SyntheticPrompts(), description="the prompts and their answers; `kind` chooses which")
    eval_max_new_tokens: int | None = Field(
        None, ge=1, le=bounds.MAX_NEW_TOKENS, description="greedy evaluation length; default: sampling's"
    )


# The modules vLLM's LoRA cannot adapt in the models it serves (0.32: measured for lm_head, which
# load_lora_adapter refuses with HTTP 500; Qwen2 and Llama declare no embedding LoRA either).
VLLM_CANNOT_ADAPT = ("lm_head", "embed_tokens")
# What an `openai_server` request says beyond the experiment's sampling settings: 2, every sampling field.
SERVER_REQUEST_VERSION = "all-sampling-fields-2"


class LMRolloutSettings(Strict):
    """How a step's rollouts are generated. `hf`: batched `transformers` generation in the driver's
    process. `openai_server`: a warm vLLM server (or `dagster-rl serve`) over its OpenAI-compatible
    API; where it is (URL, key, timeouts) is the rollout environment's setting, not the experiment's."""

    backend: Literal["hf", "openai_server"] = Field(
        "hf", description="hf: in the driver's process; openai_server: a vLLM (or dagster-rl serve) server"
    )

    def cache_inputs(self) -> dict[str, str]:
        return engine_cache_inputs(self.backend)


def engine_cache_inputs(backend: str) -> dict[str, str]:
    """What a rollout engine adds to the rollouts' cache key: another engine samples other tokens from
    the same seeds (vLLM's sampler), so its rollouts are other artifacts; and what its requests
    state. (`hf`: nothing, the keys of every run so far.)"""
    return {} if backend == "hf" else {"engine": backend, "request": SERVER_REQUEST_VERSION}


# The on_policy check's bounds by policy.dtype, on the trainer's log-probs of an on-policy step's
# sampled tokens against the sampler's: (max |difference|, |mean difference|). float32 rounding is
# ~1e-6 (measured on vLLM's CPU build and this project's engines). bfloat16 forwards differ per token
# by up to 0.5-0.7 nats on a 0.5B model with nothing wrong (the max is a tail statistic), so the max
# bound only catches gross errors there; a sampler that samples another distribution (a top-k or
# top-p cut, a penalty, another temperature) shifts the mean, which rounding leaves near 0: docs/vllm.md,
# "Rollouts on a real vLLM", says what was measured.
ON_POLICY_TOLERANCE = {"float32": (1e-3, 1e-3), "bfloat16": (1.0, 0.02)}


class LMChecks(Checks):
    on_policy_tolerance: float | None = Field(
        None,
        gt=0.0,
        le=100.0,  # nats: a bound past ~100 checks nothing (float32 log-probs of a sampled token are > -104)
        description="the on_policy check's bound on max |logp_trainer - logp_sampler| over an on-policy step's sampled "
        "tokens; None: by policy.dtype (float32 1e-3, bfloat16 1.0)",
    )
    on_policy_mean_tolerance: float | None = Field(
        None,
        gt=0.0,
        le=100.0,
        description="its bound on |mean (logp_trainer - logp_sampler)|; None: by policy.dtype (float32 1e-3, bfloat16 0.02)",
    )


class LMTrainerSettings(Strict):
    """Where the update runs. `torchrun`: `nproc_per_node` worker processes on this machine (gloo on
    the CPU, nccl with CUDA) through the same entrypoint the Kubernetes pods run. `k8s`: an Indexed
    Job of `nodes` pods of `nproc_per_node` processes each (`pods` says what each pod needs),
    restarted as a whole on any pod failure up to `max_restarts` times.

    `session: range` (torchrun, k8s): the workers start once per range of steps, with its first
    step that trains, and keep the model and optimizer state in memory between steps. `step`: every
    update is a launch of its own that loads everything afresh (a preemptible pool may prefer it).
    Both store the same bytes."""

    backend: Literal["in_process", "torchrun", "k8s"] = Field(
        "in_process", description="in the driver's process, torchrun workers on this machine, or an Indexed Job of pods"
    )
    session: Literal["range", "step"] = Field(
        "range", description="torchrun, k8s: workers for a range of steps, or a launch per step"
    )
    session_idle_timeout_s: int = Field(
        1800,
        ge=1,
        le=bounds.MAX_DEADLINE_S,
        description="a session's workers stop when no step came for this long (the next step starts new ones); on k8s "
        "this is what ends the pods of a driver that died",
    )
    nproc_per_node: int = Field(1, ge=1, le=bounds.MAX_THREADS, description="processes per node (one per GPU)")
    threads_per_process: int = Field(1, ge=1, le=bounds.MAX_THREADS, description="torch threads of each trainer process")
    nodes: int = Field(1, ge=1, le=bounds.MAX_NODES, description="k8s: pods of the Job")
    max_restarts: int = Field(
        0,
        ge=0,
        le=bounds.MAX_RESTARTS,
        description="k8s: restarts of the whole set of pods after a pod fails (per step in a session)",
    )
    active_deadline_s: int = Field(
        3600,
        ge=60,
        le=bounds.MAX_DEADLINE_S,
        description="k8s: a step fails after this long (a session's Job: after n_steps times this)",
    )
    pods: PodResources = Field(default_factory=PodResources, description="k8s: what each trainer pod needs")

    @model_validator(mode="after")
    def _nodes_need_k8s(self) -> "LMTrainerSettings":
        if self.nodes > 1 and self.backend != "k8s":
            raise ValueError(f"nodes: {self.nodes} needs backend: k8s (backend {self.backend} runs on one machine)")
        threads = self.nproc_per_node * self.threads_per_process
        if threads > bounds.MAX_THREADS:
            raise ValueError(
                f"nproc_per_node x threads_per_process = {self.nproc_per_node} x {self.threads_per_process} = {threads} threads "
                f"on one node, more than the {bounds.MAX_THREADS} a node has (see dagster_rl.base.bounds)"
            )
        return self

    @property
    def world_size(self) -> int:
        return {"in_process": 1, "torchrun": self.nproc_per_node, "k8s": self.nodes * self.nproc_per_node}[self.backend]


class LMExperiment(Experiment):
    task: VerifiablePromptsTask = Field(description="the prompts, their held-out split and the evaluation's length")
    policy: PolicySettings = Field(description="the base model and the LoRA adapter that is trained")
    sampling: SamplingSettings = Field(SamplingSettings(), description="how rollouts are sampled")
    rubric: Rubric = Field(
        LMRubric(),
        description="the reward: accuracy, the answer's form and (`kind: functions`) reward functions of your own; "
        "`kind` left out: the built-in rubric",
    )
    grpo: GRPOLMSettings = Field(GRPOLMSettings(), description="the GRPO update: clipped ratio, KL, AdamW")
    rollout: LMRolloutSettings = Field(
        LMRolloutSettings(), description="where rollouts are generated; the engine is in the rollouts' cache key"
    )
    checks: LMChecks = Field(LMChecks(), description="thresholds of the blocking checks on each step, on_policy's included")
    trainer: LMTrainerSettings = Field(
        LMTrainerSettings(), description="where the update runs; only its world size is in a cache key"
    )
    warmup: WarmupSettings | None = Field(None, description="supervised warm-up of the adapter before step 0 (`<exp>/sft`)")
    max_policy_lag: int = Field(
        0,
        ge=0,
        le=bounds.MAX_POLICY_LAG,
        description="k: step n is sampled by the weights of step n-1-k (the initial ones for n <= k), so the sampler runs "
        "up to k steps ahead of the trainer; 0: on-policy. The loss corrects with the clipped ratio, and with "
        "`grpo.decoupled` and `grpo.mismatch` when set (docs/async-rl.md)",
    )
    generation_threads: int = Field(
        1, ge=1, le=bounds.MAX_THREADS, description="torch threads of generation in the driver process"
    )

    NOT_TRAINING = Experiment.NOT_TRAINING | {"generation_threads", "trainer", "rollout"}
    _scorer: Any = PrivateAttr(None)  # a step's scorer, made once (`rewards.pinned`): the key it names is what it scores

    @model_validator(mode="after")
    def _one_answer_check(self) -> "LMExperiment":
        source, rubric = getattr(self.task, "source", None), self.rubric  # (the agent's experiment has neither)
        if isinstance(source, ReasoningGymPrompts) and isinstance(rubric, RubricTerms) and rubric.answer_rule != "number":
            raise ValueError(
                f"rubric.answer_rule: {rubric.answer_rule} with a reasoning_gym source: its answers are scored by the "
                "dataset's own score_answer; leave answer_rule out"
            )
        return self

    @property
    def min_reward(self) -> float:
        """A rubric of reward functions has no bottom but finite numbers; the built-in one's is 0."""
        return self.rubric.min_reward if isinstance(self.rubric, FunctionsRubric) else 0.0

    @model_validator(mode="after")
    def _reference_exists(self) -> "LMExperiment":
        if self.grpo.kl_reference == "sft" and self.warmup is None:
            raise ValueError(
                "grpo.kl_reference: sft needs a supervised warm-up: add a `warmup` section, or use kl_reference: base"
            )
        return self

    @model_validator(mode="after")
    def _tokens_fit_the_driver(self) -> "LMExperiment":
        """Sizes multiply: the tokens a step samples, and an evaluation's, live whole in the driver."""
        held = self.max_policy_lag + 1  # the step that trains, and the steps generated ahead of it
        sampled = self.n_trials_planned * self.sampling.max_new_tokens * held
        if sampled > bounds.MAX_TOKENS_PER_STEP:
            raise ValueError(
                f"prompts_per_step x n_samples x sampling.max_new_tokens x (max_policy_lag + 1) = {self.prompts_per_step} x "
                f"{self.n_samples} x {self.sampling.max_new_tokens} x {held} = {sampled} tokens the driver may hold, more "
                f"than {bounds.MAX_TOKENS_PER_STEP} (a step's rollouts are held whole by the driver, "
                f"~{bounds.BYTES_PER_SAMPLED_TOKEN} bytes a token, and at a lag the steps generated ahead too; see "
                "dagster_rl.base.bounds): fewer trials, fewer tokens or a smaller lag"
            )
        evaluated = self.task.source.n_eval * self.eval_max_new_tokens
        if evaluated > bounds.MAX_TOKENS_PER_STEP:
            raise ValueError(
                f"task.source.n_eval x eval_max_new_tokens = {self.task.source.n_eval} x {self.eval_max_new_tokens} = "
                f"{evaluated} tokens an evaluation may generate, more than {bounds.MAX_TOKENS_PER_STEP} (see dagster_rl.base.bounds)"
            )
        return self

    @model_validator(mode="after")
    def _a_server_can_serve_it(self) -> "LMExperiment":
        """What a vLLM server would refuse, or sample where the trainer does not score, refused at load."""
        if self.rollout.backend != "openai_server":
            return self
        refused = [m for m in self.policy.lora.target_modules if m in VLLM_CANNOT_ADAPT]
        if refused:
            raise ValueError(
                f"policy.lora.target_modules names {refused}: rollout backend openai_server serves every weights version as "
                "a vLLM LoRA adapter, and vLLM cannot adapt those modules (its load_lora_adapter answers HTTP 500). Target "
                "the attention and MLP projections (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj), or "
                "generate with rollout backend hf"
            )
        if self.sampling.top_p < 1.0:
            raise ValueError(
                f"sampling.top_p is {self.sampling.top_p}: rollout backend openai_server needs top_p 1. The trainer scores "
                "log softmax(logits / temperature) over the whole vocabulary; vLLM reports that only with top_p 1 "
                "(--logprobs-mode processed_logprobs renormalizes over the top-p nucleus, raw_logprobs ignores the "
                "temperature), so the on_policy check would stop every step"
            )
        return self

    @property
    def on_policy_tolerance(self) -> tuple[float, float]:
        """(max |difference|, |mean difference|) the on_policy check allows."""
        max_abs, mean_abs = ON_POLICY_TOLERANCE[self.policy.dtype]
        return self.checks.on_policy_tolerance or max_abs, self.checks.on_policy_mean_tolerance or mean_abs

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
