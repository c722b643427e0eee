"""Settings of the language-model path: LoRA adapter, sampling, GRPO update."""

from typing import Literal

from pydantic import Field, field_validator

from dagster_rl.experiment import Strict

ATTENTION_AND_MLP = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRASettings(Strict):
    rank: int = Field(8, ge=1)
    alpha: float = Field(16.0, gt=0.0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="> 0 makes the on-policy ratio differ from 1")
    target_modules: tuple[str, ...] = ATTENTION_AND_MLP
    init_seed: int = Field(0, description="seeds LoRA A; B starts at 0 so the initial policy is the base")

    @field_validator("target_modules")
    @classmethod
    def _not_empty(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v:
            raise ValueError("name at least one module to adapt, e.g. q_proj, v_proj")
        return tuple(v)


class PolicySettings(Strict):
    base_model: str = Field(description="a local model folder or a hub id (read offline when HF_HUB_OFFLINE=1)")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    lora: LoRASettings = LoRASettings()


class SamplingSettings(Strict):
    temperature: float = Field(1.0, ge=0.0, description="0: greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(16, ge=1, le=32_768)


class GRPOLMSettings(Strict):
    clip_eps: float = Field(0.2, gt=0.0, lt=1.0)
    kl_beta: float = Field(0.04, ge=0.0)
    learning_rate: float = Field(1e-4, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = Field(1e-8, gt=0.0)
    max_grad_norm: float = Field(1.0, gt=0.0)
    advantage_eps: float = Field(1e-4, gt=0.0)


class LMRubric(Strict):
    name: str = "accuracy"
    accuracy: float = Field(1.0, ge=0.0)
    format: float = Field(0.0, ge=0.0)

    @property
    def max_reward(self) -> float:
        return self.accuracy + self.format
