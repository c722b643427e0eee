"""The subset of vLLM's OpenAI-compatible protocol `dagster-rl serve` speaks: the request bodies as
pydantic models (`CompletionBody`, `LoadAdapterBody`, `UnloadAdapterBody`), the request and
result a batch runs on (`CompletionRequest`, `CompletionResult`), and vLLM's CompletionResponse.

A request is checked in two steps: its model (types and ranges, each fault a 400 naming its
field, worded by `errors.from_validation`), then what depends on the model served
(`parse_completion_request`: the prompt's and stop tokens' ids, the context length, the model's name).
Every field of `vllm_client.NEUTRAL_SAMPLING` is accepted at its neutral values only; fields vLLM
does not know are ignored, as vLLM ignores them.
"""

import time
import uuid
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from dagster_rl.inference.vllm_client import NEUTRAL_SAMPLING
from dagster_rl.tasks.lm.serve.errors import APIError, from_validation

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    logprobs: int | None = None  # None: none asked; k: the sampled token's and the top k
    stop_id: int = -1  # the one token that ends a completion (included); -1: none
    stop_reason: int | None = None  # what the answer's stop_reason says when it stops there (vLLM: the id, or null for eos)
    as_token_ids: bool = False  # the answer names each token "token_id:<id>" (return_tokens_as_token_ids)

    @property
    def group(self) -> tuple:
        """Requests of one group run as one batch: same adapter, same sampling settings."""
        return (self.model, self.max_tokens, self.temperature, self.top_p, self.stop_id)


@dataclass(frozen=True)
class CompletionResult:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # stop (the stop token sampled, included) | length
    top: list[list[tuple[int, float]]] | None = None  # per token: the top k (id, log-prob), when asked


class ServedModel(Protocol):
    """What a request is checked against and answered with (`engine.Engine` is one)."""

    name: str  # the base model's id
    vocab: int  # token ids are in [0, vocab)
    max_model_len: int | None  # prompt + max_tokens at most; None: not known
    tokenizer: Any

    def check_model(self, name: str) -> None:
        """A 404 (`APIError`) unless `name` is the base model or a loaded adapter."""


class _Body(BaseModel):
    """A request body: JSON types as JSON has them (true is not 1, 1.5 is not an integer), null as
    absent, fields vLLM does not know ignored."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, frozen=True)


def _same(value: Any, neutral: Any) -> bool:
    """`value` is `neutral` (JSON's true and false are not 1 and 0)."""
    return isinstance(value, bool) == isinstance(neutral, bool) and value == neutral


def _fault(param: str, message: str) -> PydanticCustomError:
    """A validator's fault, named by its field (`param`), with its own message (in the context, not
    the template: pydantic would fill a "{...}" of a client's value in)."""
    return PydanticCustomError("request_field", "{message}", {"param": param, "message": message})


class CompletionBody(_Body):
    """POST /v1/completions: the fields this server reads (defaults as vLLM's, started with
    `--generation-config vllm`)."""

    model: str | None = None
    prompt: Any = Field(None, validate_default=True)  # a string, or one list of token ids (or a list of one of either)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # k: the sampled token's log-probability and the top k
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)  # 64 bits; none: a random one, as vLLM
    return_tokens_as_token_ids: bool | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def neutral_only(cls, body: Any) -> Any:
        """A 400 naming the first field of `NEUTRAL_SAMPLING` sent at another value than a neutral one."""
        for name, neutral in NEUTRAL_SAMPLING.items():
            if isinstance(body, dict) and name in body and not any(_same(body[name], v) for v in neutral.accepted):
                raise _fault(
                    name,
                    f"this server does not implement {name} = {body[name]!r}: send {neutral.value!r} or leave it out "
                    "(dagster-rl serve samples the tempered distribution, cut to top_p, up to max_tokens and one stop token)",
                )
        return body

    @field_validator("model")
    @classmethod
    def served(cls, model: str | None, info: ValidationInfo) -> str | None:
        """With the engine as the context: a 404 (`APIError`, which pydantic passes on as it is) unless it serves `model`."""
        engine = (info.context or {}).get("engine")
        if engine is not None:
            engine.check_model(model or engine.name)
        return model

    @field_validator("prompt", mode="before")
    @classmethod
    def one_prompt(cls, prompt: Any) -> str | list[int]:
        while isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        raise _fault("prompt", "prompt must be a string, or one list of token ids")


B = TypeVar("B", bound=BaseModel)


class LoadAdapterBody(_Body):
    """POST /v1/load_lora_adapter."""

    lora_name: str | None = None
    lora_path: str | None = None
    load_inplace: bool | None = None


class UnloadAdapterBody(_Body):
    """POST /v1/unload_lora_adapter."""

    lora_name: str | None = None


def validated(model: type[B], body: dict[str, Any], context: dict[str, Any] | None = None) -> B:
    """`body` as a `model` (validated with `context`), or the `APIError` (a 400 naming the field) of its first fault."""
    try:
        return model.model_validate(body, context=context)
    except ValidationError as e:
        raise from_validation(e) from None


def parse_completion_request(body: dict[str, Any], engine: ServedModel) -> CompletionRequest:
    """A vLLM /v1/completions body, for the subset this server serves; errors as vLLM words them,
    each a 400 naming its field (`param`)."""
    fields = validated(CompletionBody, body, {"engine": engine})
    model = fields.model or engine.name
    prompt = fields.prompt
    prompt_ids: list[int] = engine.tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else prompt
    vocab = engine.vocab
    if not prompt_ids or any(not 0 <= t < vocab for t in prompt_ids):
        raise APIError(HTTPStatus.BAD_REQUEST, f"prompt token ids must be in [0, {vocab})", param="prompt")
    max_tokens = 16 if fields.max_tokens is None else fields.max_tokens
    if engine.max_model_len is not None and len(prompt_ids) + max_tokens > engine.max_model_len:
        raise APIError(
            HTTPStatus.BAD_REQUEST,
            f"This model's maximum context length is {engine.max_model_len} tokens. However, you requested "
            f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, {max_tokens} in max_tokens): "
            "reduce the prompt or max_tokens.",
            param="max_tokens",
        )
    seed = uuid.uuid4().int % 2**63 if fields.seed is None else fields.seed  # vLLM samples unseeded requests at random too
    stop_id, stop_reason = _stop_token(fields, engine.tokenizer.eos_token_id, vocab)
    temperature = 1.0 if fields.temperature is None else fields.temperature
    top_p = 1.0 if fields.top_p is None else fields.top_p
    as_token_ids = bool(fields.return_tokens_as_token_ids)
    return CompletionRequest(
        model, prompt_ids, max_tokens, temperature, top_p, seed, fields.logprobs, stop_id, stop_reason, as_token_ids
    )


def _stop_token(fields: CompletionBody, eos_id: int, vocab: int) -> tuple[int, int | None]:
    """The one token that ends a completion, and the stop_reason vLLM gives it: a `stop_token_ids`
    id is its own reason, the eos (unless `ignore_eos`) has none; -1: none ends it early."""
    ids = fields.stop_token_ids or []
    if any(not 0 <= t < vocab for t in ids):
        raise APIError(HTTPStatus.BAD_REQUEST, f"stop_token_ids must be token ids in [0, {vocab})", param="stop_token_ids")
    ignore_eos = bool(fields.ignore_eos)
    stops = dict.fromkeys([*([] if ignore_eos else [eos_id]), *ids])
    if len(stops) > 1:
        raise APIError(
            HTTPStatus.BAD_REQUEST,
            f"this server stops on one token; the request stops on {list(stops)} (stop_token_ids, and the eos {eos_id} "
            "unless ignore_eos): send ignore_eos: true with one stop token id",
            param="stop_token_ids",
        )
    if not stops:
        return -1, None
    stop = next(iter(stops))
    return stop, (None if stop == eos_id and not ignore_eos else stop)


def completion_response(req: CompletionRequest, result: CompletionResult, engine: ServedModel) -> dict[str, Any]:
    """vLLM's CompletionResponse for one prompt and one choice."""
    tok = engine.tokenizer

    def name(t: int) -> str:
        return f"token_id:{t}" if req.as_token_ids else str(tok.decode([t]))

    logprobs = None
    if req.logprobs is not None:
        tokens = [name(t) for t in result.token_ids]
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        tops = result.top or [[] for _ in tokens]
        logprobs = {
            "text_offset": offsets,
            "token_logprobs": [max(v, -9999.0) for v in result.logprobs],
            "tokens": tokens,
            # as vLLM: the sampled token first, then the top k (a token listed once)
            "top_logprobs": [
                {name(i): max(v, -9999.0) for i, v in [(t, lp), *[(i, v) for i, v in top if i != t]]}
                for t, lp, top in zip(result.token_ids, result.logprobs, tops, strict=True)
            ],
        }
    stopped = result.finish_reason == "stop"
    n_prompt, n_completion = len(req.prompt_ids), len(result.token_ids)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": [
            {
                "index": 0,
                "text": tok.decode(result.token_ids, skip_special_tokens=True),
                "logprobs": logprobs,
                "finish_reason": result.finish_reason,
                "stop_reason": req.stop_reason if stopped else None,
                "prompt_logprobs": None,
            }
        ],
        "usage": {"prompt_tokens": n_prompt, "total_tokens": n_prompt + n_completion, "completion_tokens": n_completion},
    }
