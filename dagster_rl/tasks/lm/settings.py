"""Settings of the language-model path: LoRA adapter, sampling, GRPO update, supervised warm-up."""

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from dagster_rl.core import bounds
from dagster_rl.core.experiment import ADVANTAGE_EPS
from dagster_rl.core.strict import Strict

ATTENTION_AND_MLP = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
Beta = Annotated[float, Field(ge=0.0, lt=1.0)]  # an Adam moment's decay


class LoRASettings(Strict):
    rank: int = Field(8, ge=1, le=bounds.MAX_LORA_RANK, description="at most the model's hidden size (checked when it loads)")
    alpha: float = Field(16.0, gt=0.0, description="the adapter's output is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="> 0 makes the on-policy ratio differ from 1")
    target_modules: tuple[str, ...] = Field(ATTENTION_AND_MLP, description="names of the modules the adapter wraps")
    init_seed: int = Field(
        0, ge=bounds.SEED_MIN, le=bounds.SEED_MAX, description="seeds LoRA A; B starts at 0 so the initial policy is the base"
    )

    @field_validator("target_modules")
    @classmethod
    def _not_empty(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v:
            raise ValueError("name at least one module to adapt, e.g. q_proj, v_proj")
        return tuple(v)

    @model_validator(mode="after")
    def _bounded_scale(self) -> "LoRASettings":
        if self.alpha / self.rank > bounds.MAX_LORA_SCALE:
            raise ValueError(
                f"alpha / rank = {self.alpha:g} / {self.rank} = {self.alpha / self.rank:g} scales the adapter's output by more "
                f"than {bounds.MAX_LORA_SCALE:g} (usually 1 or 2; see dagster_rl.core.bounds); lower alpha or raise rank"
            )
        return self


class PolicySettings(Strict):
    base_model: str = Field(description="a local model folder or a hub id (read offline when HF_HUB_OFFLINE=1)")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="of the base model; the adapter and its optimizer stay float32"
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        exclude=True,  # where a policy runs is not part of what it computes: no key or hash holds it
        description="auto: cuda when this process sees a GPU, else cpu. Not in any cache key: a run resumed on "
        "another device reuses every stored step (numbers agree to float rounding across devices)",
    )
    lora: LoRASettings = Field(LoRASettings(), description="the adapter that is trained")


class SamplingSettings(Strict):
    temperature: float = Field(1.0, ge=0.0, le=bounds.MAX_TEMPERATURE, description="0: greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling; 1: the whole vocabulary (openai_server needs 1)")
    max_new_tokens: int = Field(16, ge=1, le=bounds.MAX_NEW_TOKENS, description="most tokens a completion samples")


class GRPOLMSettings(Strict):
    clip_eps: float = Field(0.2, gt=0.0, lt=1.0, description="the importance ratio is clipped to [1 - clip_eps, 1 + clip_eps]")
    kl_beta: float = Field(
        0.04,
        ge=0.0,
        le=bounds.MAX_KL_BETA,
        description="weight of the k3 KL to the reference; 0: no KL term, and no reference forward (the step reports no `kl`)",
    )
    kl_reference: Literal["base", "sft"] = Field(
        "base", description="the KL term's reference: the original base model, or the supervised warm-up (`warmup`)"
    )
    learning_rate: float = Field(1e-4, gt=0.0, le=bounds.MAX_LEARNING_RATE, description="AdamW's, on the adapter")
    weight_decay: float = Field(0.0, ge=0.0, le=bounds.MAX_WEIGHT_DECAY, description="AdamW's")
    betas: tuple[Beta, Beta] = Field((0.9, 0.999), description="AdamW's moment decays")
    adam_eps: float = Field(1e-8, gt=0.0, le=bounds.MAX_EPS, description="AdamW's eps")
    max_grad_norm: float = Field(
        1.0, gt=0.0, le=bounds.MAX_GRAD_NORM, description="the gradient's global norm is clipped to this"
    )
    advantage_eps: float = Field(1e-4, gt=0.0, le=bounds.MAX_EPS, description=ADVANTAGE_EPS)
    micro_batch_tokens: int = Field(
        1024,
        ge=1,
        le=bounds.MAX_MICRO_BATCH_TOKENS,
        description="padded tokens (rows x longest sequence) per forward and backward of the trainer: bounds its "
        "activation memory; each costs a fixed overhead (the Python of two forwards and a backward). On a GPU with "
        "memory to spare raise it (4096-16384)",
    )
    activation_checkpointing: bool = Field(
        False,
        description="recompute each layer's activations in the backward (TRL's default): a micro-batch keeps the "
        "inputs of its layers instead of all their activations, for about a third more compute",
    )


class LMRubric(Strict):
    """reward = accuracy * [the answer is right] + format * [the answer is given in the expected form].

    The form (`format_rule`): `ends_with_number` (nothing but a period after the last number) or
    `gsm8k` (a `#### <number>` mark, GSM8K's final-answer line)."""

    name: str = Field("accuracy", description="the rubric's name, recorded with the rewards")
    accuracy: float = Field(1.0, ge=0.0, le=bounds.MAX_REWARD_WEIGHT, description="reward of a right answer")
    format: float = Field(0.0, ge=0.0, le=bounds.MAX_REWARD_WEIGHT, description="reward of an answer in the expected form")
    format_rule: Literal["ends_with_number", "gsm8k"] = Field(
        "ends_with_number", description="the expected form: nothing but a period after the last number, or a `#### <n>` line"
    )

    @property
    def max_reward(self) -> float:
        return self.accuracy + self.format


class WarmupSettings(Strict):
    """Supervised fine-tuning of the adapter before step 0 (the `<exp>/sft` asset)."""

    demos: int = Field(64, ge=1, le=1_000_000, description="worked answers drawn from the training split")
    steps: int = Field(20, ge=1, le=1_000_000, description="optimizer steps (at most, with `target_accuracy`)")
    batch_size: int = Field(16, ge=1, le=65_536, description="demonstrations per step")
    learning_rate: float = Field(3e-3, gt=0.0, le=bounds.MAX_LEARNING_RATE, description="AdamW's, on the adapter")
    weight_decay: float = Field(0.0, ge=0.0, le=bounds.MAX_WEIGHT_DECAY, description="AdamW's")
    max_grad_norm: float = Field(
        1.0, gt=0.0, le=bounds.MAX_GRAD_NORM, description="the gradient's global norm is clipped to this"
    )
    target_accuracy: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="stop once greedy accuracy on `check_prompts` training prompts that are not demonstrations reaches "
        "this (checked every `check_every` steps): a start that leaves GRPO room to learn on every machine, where a "
        "fixed step count lands anywhere from a little to nearly all of the task depending on the CPU's rounding",
    )
    check_every: int = Field(10, ge=1, le=1_000_000, description="steps between two checks of `target_accuracy`")
    check_prompts: int = Field(100, ge=1, le=1_000_000, description="training prompts, never demonstrations, of each check")
