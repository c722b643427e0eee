"""Settings of the language-model path: LoRA adapter, sampling, GRPO update, supervised warm-up."""

import math
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from dagster_rl.base import bounds
from dagster_rl.base.plugins import check_reference
from dagster_rl.base.strict import Strict
from dagster_rl.core.experiment import ADVANTAGE_EPS, EXPERIMENTS_FOLDER

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
                f"than {bounds.MAX_LORA_SCALE:g} (usually 1 or 2; see dagster_rl.base.bounds); lower alpha or raise rank"
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


class DecoupledObjective(Strict):
    """AReaL's decoupled PPO objective (`use_decoupled_loss`): the ratio is clipped around the proximal
    policy, the weights this step trains from (the previous step's), whose log-probs the trainer
    computes in its own forward, and each token's term is weighted by the behavior-to-proximal
    importance weight exp(proximal - behavior), masked (0) where it exceeds `cap` (AReaL's
    `behav_imp_weight_cap`, its default mode `token_mask`). The behavior log-probs are the
    trainer's recomputation when `mismatch` is set, else the sampler's. With one optimizer step per
    batch (this trainer) the ratio is 1 in value, so the clip never binds: the update is the
    weighted policy gradient (docs/async-rl.md)."""

    cap: float = Field(
        5.0,
        gt=1.0,
        le=bounds.MAX_IMPORTANCE_CAP,
        description="tokens whose behavior-to-proximal weight exp(proximal - behavior) exceeds it are masked (AReaL's "
        "behav_imp_weight_cap)",
    )


class MismatchCorrection(Strict):
    """The sampler-trainer mismatch correction: the importance weight exp(behavior - sampler) of each
    token (`token`) or of each completion, the product over its tokens (`sequence`), between the
    trainer's log-probs of the behavior weights and the log-probs the sampler recorded, truncated at
    `cap` (`truncate`: TIS) or set to 0 above it (`mask`: MIS), multiplies each token's policy term.
    At lag 0 the behavior weights are the trained ones, so the trainer's own log-probs are the
    behavior's; at a lag the trainer recomputes them with the behavior weights (one more forward).
    TRL's `vllm_importance_sampling_mode` (token/sequence x truncate/mask) and cap, verl's
    `rollout_correction`, SkyRL's `off_policy_correction`, slime's `--use-tis --tis-clip`."""

    level: Literal["token", "sequence"] = Field(
        "token", description="one weight per token, or one per completion (the product of its tokens' weights)"
    )
    action: Literal["truncate", "mask"] = Field(
        "truncate", description="truncate: a weight above the cap counts as the cap (TIS); mask: as 0 (MIS)"
    )
    cap: float = Field(
        2.0,
        gt=1.0,
        le=bounds.MAX_IMPORTANCE_CAP,
        description="the importance weight's cap (slime --tis-clip 2, SkyRL token 2 and sequence 5, TRL 3)",
    )


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
    decoupled: DecoupledObjective | None = Field(
        None,
        description="AReaL's decoupled objective: clip around the weights this step trains from, weight each token by "
        "the behavior-to-proximal importance weight, masked above its cap; None: the ratio's old policy is the behavior's",
    )
    mismatch: MismatchCorrection | None = Field(
        None,
        description="truncate (TIS) or mask (MIS) the sampler-trainer importance weight, per token or per completion, "
        "at every lag; None: no such weight",
    )

    def cache_inputs(self) -> dict:
        """What a key holds of these settings: every field, the corrections only when set (a run
        without them keeps the keys it had before they existed)."""
        return self.model_dump(mode="json", exclude_none=True)


ANSWER_RULE = (
    "how a right answer is decided (a reasoning_gym source decides with its dataset's own score_answer instead): "
    "`number`: the completion's number (after its last `#### `, else its last number) equals the reference's; "
    "`math_verify`: math-verify's parse and verify (LaTeX, fractions, `\\boxed{}`), bounded in a worker process"
)


class RubricTerms(Strict):
    """The built-in terms of every rubric: accuracy and format."""

    name: str = Field("accuracy", description="the rubric's name, recorded with the rewards")
    accuracy: float = Field(1.0, ge=0.0, le=bounds.MAX_REWARD_WEIGHT, description="reward of a right answer")
    format: float = Field(0.0, ge=0.0, le=bounds.MAX_REWARD_WEIGHT, description="reward of an answer in the expected form")
    format_rule: Literal["ends_with_number", "gsm8k"] = Field(
        "ends_with_number", description="the expected form: nothing but a period after the last number, or a `#### <n>` line"
    )
    answer_rule: Literal["number", "math_verify"] = Field(
        "number", exclude_if=lambda rule: rule == "number", description=ANSWER_RULE
    )  # `number`, the rule of every run before it existed, is in no dump: their keys stay


class LMRubric(RubricTerms):
    """reward = accuracy * [the answer is right] + format * [the answer is given in the expected form].

    The form (`format_rule`): `ends_with_number` (nothing but a period after the last number) or
    `gsm8k` (a `#### <number>` mark, GSM8K's final-answer line). Whether the answer is right: the
    `answer_rule`, or the source's own scorer (reasoning_gym's `score_answer`, partial credit
    included)."""

    # the default: `kind` may be left out, and is in no dump (the keys of every run so far stay)
    kind: Literal["builtin"] = Field("builtin", exclude=True, description="the built-in rubric (the default)")

    @property
    def max_reward(self) -> float:
        return self.accuracy + self.format

    @property
    def min_reward(self) -> float:
        return 0.0

    @property
    def functions(self) -> tuple["RewardFunction", ...]:
        return ()


class RewardFunction(Strict):
    """A reward function of the user's, TRL's signature: `f(prompts, completions, completion_ids,
    **columns) -> list[float | None]`, called for one completion at a time (lists of one) in a worker
    process. None: no opinion on that completion (it adds nothing to its reward)."""

    function: str = Field(
        description="`file.py:name` (a file in the experiments folder) or `package.module:name` (on the Python path)"
    )
    weight: float = Field(
        1.0,
        ge=-bounds.MAX_REWARD_WEIGHT,
        le=bounds.MAX_REWARD_WEIGHT,
        description="its value times this is its term of the reward; 0: computed and reported, not rewarded",
    )
    name: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="its name in the rewards and the step's metadata (`reward_<name>`); default: the function's name",
    )
    timeout_s: float = Field(
        10.0,
        gt=0.0,
        le=3600.0,
        exclude=True,  # a time limit: what it computes is the same whatever the limit (in no key)
        description="a call that runs longer fails the trial's judgement (its worker process is killed). In no key",
    )
    _folder: Path | None = PrivateAttr(None)  # the experiments folder, for a `file.py` reference

    @model_validator(mode="after")
    def _resolvable(self, info: ValidationInfo) -> "RewardFunction":
        target, _ = check_reference(self.function, callable_=True)
        folder = (info.context or {}).get(EXPERIMENTS_FOLDER)
        self._folder = Path(folder) if folder is not None else None
        if target.endswith(".py"):
            if self._folder is None:
                raise ValueError(
                    f"{self.function!r} names a file in the experiments folder, and this experiment was not read from one: "
                    "write `package.module:name`, or put the experiment file in the folder beside the function's file"
                )
            if not (self._folder / target).is_file():
                raise ValueError(f"{self.function!r}: no file {target} in the experiments folder {self._folder}")
        return self

    @property
    def label(self) -> str:
        """Its name in the rewards' components and the step's metrics."""
        return self.name or self.function.rsplit(":", 1)[1]

    @property
    def folder(self) -> Path | None:
        return self._folder


RESERVED_LABELS = ("accuracy", "format", "llm")  # the built-in terms' names in a reward's components


class FunctionsRubric(RubricTerms):
    """The built-in terms (accuracy, format), plus the user's reward functions, each times its weight:
    reward = accuracy * right + format * in_form + sum(weight_i * f_i), a function's None adding
    nothing (TRL's nansum). A function that raises, returns a value that is not one finite number
    (or None) per completion, or outlives its `timeout_s` fails the trial's judgement, naming the
    function, the trial and the error: never scored 0, never cached."""

    kind: Literal["functions"] = Field("functions", description="the built-in terms plus reward functions of your own")
    functions: tuple[RewardFunction, ...] = Field(max_length=64, description="the reward functions, each with its weight")

    @field_validator("functions")
    @classmethod
    def _some(cls, functions: tuple[RewardFunction, ...]) -> tuple[RewardFunction, ...]:
        if not functions:
            raise ValueError("name at least one reward function (`- function: file.py:name`), or use the built-in rubric")
        return functions

    @model_validator(mode="after")
    def _distinct_names(self) -> "FunctionsRubric":
        labels = [f.label for f in self.functions]
        clash = sorted({n for n in labels if labels.count(n) > 1 or n in RESERVED_LABELS})
        if clash:
            raise ValueError(
                f"reward functions named {clash}: each needs a name of its own, none of {', '.join(RESERVED_LABELS)} "
                "(the built-in terms): give it one with `name:`"
            )
        return self

    @property
    def max_reward(self) -> float:
        return math.inf  # a function's values have no bound but being finite

    @property
    def min_reward(self) -> float:
        return -math.inf


def _rubric_kind(raw: Any) -> Any:
    """A rubric section without `kind` is the built-in one (every file before there were two)."""
    if isinstance(raw, dict) and "kind" not in raw:
        return {**raw, "kind": "builtin"}
    return raw


Rubric = Annotated[LMRubric | FunctionsRubric, Field(discriminator="kind"), BeforeValidator(_rubric_kind)]
AnyRubric = LMRubric | FunctionsRubric


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
