"""The language-model agent's experiment: a LoRA policy acting in a text environment over several turns.

It is a language-model experiment (`dagster_rl.tasks.lm.experiment.LMExperiment`: the policy, the GRPO
update, the trainer, the checks) whose prompts are episodes: `task.environment` names the
environment and holds its settings, `task.episode` the budgets of an episode, and the rubric scores
success and efficiency. A step plays `prompts_per_step` fresh training worlds (`t<step>.<p>`),
`n_samples` trials each (a world's trials are a GRPO group); the held-out evaluation plays
`task.n_eval` other worlds (`e<i>`) greedily.
"""

from typing import Any, Literal

from pydantic import Field, SerializeAsAny, field_validator, model_validator

from dagster_rl.base import bounds
from dagster_rl.base.hashing import seed_of
from dagster_rl.base.strict import Strict
from dagster_rl.tasks.agent.environment import EnvironmentSettings, World, environment_of
from dagster_rl.tasks.agent.judge import AgentRubric
from dagster_rl.tasks.agent.text_world import SecretSearchTextSettings
from dagster_rl.tasks.agent.textarena_settings import TextArenaSettings
from dagster_rl.tasks.lm.experiment import LMExperiment, engine_cache_inputs
from dagster_rl.tasks.lm.settings import SamplingSettings

MAX_OBSERVATION_TOKENS = 4096


class EpisodeSettings(Strict):
    """The budgets of one episode."""

    max_turns: int = Field(
        4, ge=1, le=bounds.MAX_TURNS, description="actions an episode may take; past them it ends as turn_budget"
    )
    max_turn_tokens: int = Field(
        16,
        ge=1,
        le=bounds.MAX_NEW_TOKENS,
        description="tokens one action may sample; an action it cuts goes to the environment as sampled",
    )
    trial_timeout_s: float = Field(
        600.0,
        gt=0.0,
        le=bounds.MAX_DEADLINE_S,
        description="a trial running longer (its turns' generation and its environment's answers) fails: retried, never cached; "
        "an environment's call that outlives it is stopped (the environment runs in a process of its own)",
    )
    max_observation_tokens: int = Field(
        MAX_OBSERVATION_TOKENS,
        ge=1,
        le=bounds.MAX_NEW_TOKENS,
        # at its default the settings (and every key holding them) read as they did before the field
        exclude_if=lambda n: n == MAX_OBSERVATION_TOKENS,
        description="tokens one observation may hold; an environment that answers more fails its trial (naming the "
        "environment and the size), before the observation is tokenized whole",
    )


class TextAgentTask(Strict):
    kind: Literal["text_agent"] = Field("text_agent", description="the task kind: selects the experiment class")
    environment: SerializeAsAny[SecretSearchTextSettings | TextArenaSettings | EnvironmentSettings] = Field(
        description="the text environment: `name` (secret_search, python_tool, textarena, or a registered plugin's) and "
        "its settings, which that environment's settings class validates"
    )
    episode: EpisodeSettings = Field(EpisodeSettings(), description="turn budget, per-turn token budget, per-trial timeout")
    n_eval: int = Field(64, ge=1, le=bounds.MAX_HELDOUT_PROMPTS, description="held-out worlds of the greedy evaluation")

    @field_validator("environment", mode="before")
    @classmethod
    def _the_environment_settings(cls, value: Any) -> Any:
        """Validated by the named environment's own settings class."""
        if isinstance(value, dict):
            name = value.get("name")
            if not isinstance(name, str):
                raise ValueError("task.environment needs a `name`: the registered text environment, e.g. secret_search")
            return environment_of(name).settings.model_validate(value)
        return value


class AgentSampling(Strict):
    temperature: float = Field(1.0, ge=0.0, le=bounds.MAX_TEMPERATURE, description="0: greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling; 1: the whole vocabulary")


class AgentRolloutSettings(Strict):
    """How a step's episodes are played. `hf`: in the driver's process, the live trials of a step
    advancing one turn together. `openai_server`: each turn of each episode one completion request
    (token ids in, token ids and their log-probs out) to a warm vLLM server (or `dagster-rl serve`),
    `max_concurrency` episodes at a time; where the server is (URL, key, timeouts) is the rollout
    environment's setting, not the experiment's. The engine is in the rollouts' cache key. As for a
    language-model experiment, `openai_server` needs sampling.top_p 1 and an adapter vLLM can serve
    (no lm_head, no embed_tokens in policy.lora.target_modules): both are refused at load."""

    backend: Literal["hf", "openai_server"] = Field(
        "hf", description="hf: batched by turn in the driver's process; openai_server: a vLLM (or dagster-rl serve) server"
    )

    def cache_inputs(self) -> dict[str, str]:
        return engine_cache_inputs(self.backend)


class AgentWarmupSettings(Strict):
    """Supervised fine-tuning of the adapter on demonstrations before step 0 (the `<exp>/sft` asset)."""

    demos: int = Field(512, ge=1, le=1_000_000, description="demonstrations, each on a world of its own")
    steps: int = Field(200, ge=1, le=1_000_000, description="optimizer steps")
    batch_size: int = Field(16, ge=1, le=65_536, description="demonstrations per step")
    learning_rate: float = Field(3e-3, gt=0.0, le=bounds.MAX_LEARNING_RATE, description="AdamW's, on the adapter")
    max_grad_norm: float = Field(
        1.0, gt=0.0, le=bounds.MAX_GRAD_NORM, description="the gradient's global norm is clipped to this"
    )
    max_turns: int | None = Field(
        None,
        ge=1,
        le=bounds.MAX_TURNS,
        description="the demonstrations' turn budget (a demonstration that does not succeed within it is drawn again); "
        "None: the episodes' (task.episode.max_turns). Larger: demonstrations longer than an episode may be",
    )


class AgentExperiment(LMExperiment):
    """A language-model experiment (its policy, update, trainer and checks) whose task, sampling,
    rubric, rollout and warm-up are the agent's own."""

    # the `type: ignore[assignment]`s: pydantic validates each of these fields by this class's type; the
    # sections the inherited loop and trainers read (policy, grpo, trainer, checks) are the language model's

    task: TextAgentTask = Field(description="the environment, the episode's budgets and the held-out worlds")  # type: ignore[assignment]
    sampling: AgentSampling = Field(  # type: ignore[assignment]
        AgentSampling(), description="how actions are sampled (task.episode.max_turn_tokens bounds each)"
    )
    rubric: AgentRubric = Field(AgentRubric(), description="the reward: success, and fewer turns")  # type: ignore[assignment]
    rollout: AgentRolloutSettings = Field(AgentRolloutSettings(), description="where episodes are played")  # type: ignore[assignment]
    warmup: AgentWarmupSettings | None = Field(  # type: ignore[assignment]
        None, description="supervised warm-up on the environment's demonstrations (`<exp>/sft`)"
    )

    @model_validator(mode="after")
    def _tokens_fit_the_driver(self) -> "AgentExperiment":
        """Sizes multiply: the tokens a step samples, and an evaluation's, live whole in the driver."""
        per_trial = self.task.episode.max_turns * self.task.episode.max_turn_tokens
        for what, trials in (("a step", self.n_trials_planned), ("an evaluation", self.task.n_eval)):
            if trials * per_trial > bounds.MAX_TOKENS_PER_STEP:
                raise ValueError(
                    f"{what} plays {trials} trials of up to max_turns x max_turn_tokens = {per_trial} sampled tokens: "
                    f"{trials * per_trial} tokens, more than {bounds.MAX_TOKENS_PER_STEP} (see dagster_rl.base.bounds): fewer "
                    "trials, turns or tokens"
                )
        return self

    @model_validator(mode="after")
    def _demonstrations_exist(self) -> "AgentExperiment":
        spec = environment_of(self.task.environment.name)
        if self.warmup is not None and spec.demonstrate is None:
            raise ValueError(
                f"environment {spec.name} gives no demonstrations: a warmup section has nothing to imitate; remove it"
            )
        if self.warmup is not None and self.demo_turns < spec.min_turns:
            raise ValueError(
                f"the warm-up's demonstrations may take {self.demo_turns} turn(s), but a successful episode of {spec.name} takes at "
                f"least {spec.min_turns}: raise warmup.max_turns (or task.episode.max_turns) to {spec.min_turns} or more"
            )
        return self

    @property
    def demo_turns(self) -> int:
        """The demonstrations' turn budget: the warm-up's own, else the episodes'."""
        return (self.warmup.max_turns if self.warmup is not None else None) or self.task.episode.max_turns

    @property
    def turn_sampling(self) -> SamplingSettings:
        """One action's sampling: the per-turn token budget as its max_new_tokens."""
        return SamplingSettings(
            temperature=self.sampling.temperature, top_p=self.sampling.top_p, max_new_tokens=self.task.episode.max_turn_tokens
        )

    def world(self, world_id: str) -> World:
        return World(world_id, seed_of(self.seed, "world", world_id))

    def training_world(self, step: int, prompt: int) -> World:
        return self.world(f"t{step}.{prompt}")

    def heldout_worlds(self) -> list[World]:
        return [self.world(f"e{i}") for i in range(self.task.n_eval)]
