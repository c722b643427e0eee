"""`dagster-rl serve`: a small server over the project's own engine that speaks the subset of vLLM's
OpenAI-compatible API the `openai_server` rollout backend uses, with vLLM's field names and shapes:

    GET  /health, GET /v1/models
    POST /v1/completions            token-id (or text) prompts, seed, temperature, top_p, max_tokens,
                                    logprobs: k (the sampled token's and the top k), one stop token
                                    (stop_token_ids / ignore_eos), return_tokens_as_token_ids
    POST /v1/load_lora_adapter      {lora_name, lora_path, load_inplace}: a PEFT adapter folder
    POST /v1/unload_lora_adapter    {lora_name}

Completions sample exactly as the `hf` rollout backend does (`sampling.generate`: one seeded
generator per request, and the sampler's own log softmax(logits / temperature) of each sampled
token before top-p, as vLLM's `--logprobs-mode processed_logprobs` with top_p 1), so a rollout
generated through this server equals the `hf` engine's token for token (log-probs to float
rounding: the engine folds the adapter into the weights, the server applies it per layer). Concurrent requests
are batched (`Batcher`); adapters are PEFT adapters of one base model, switched per batch.

Every other field of vLLM's CompletionRequest that changes what is sampled (`NEUTRAL_ONLY`: top_k,
min_p, the penalties, min_tokens, stop strings, ...) is accepted at its neutral value only, and any
other value is a 400 naming the field: never silence. The server has no generation config: a field
left out is neutral, as on vLLM started with `--generation-config vllm`. Fields that only shape the
answer, and fields vLLM does not know, are ignored, as vLLM ignores unknown ones.

It cannot be wedged by what a client sends (issue 20):

- every field is type-checked: a wrong type, `max_tokens` < 1, a non-finite number is a 400 naming
  the field; prompt + max_tokens beyond the model's context (`max_position_embeddings`) is a 400
  naming both;
- adapters load only from the folders given with `--adapter-root` (repeatable; or
  `$DAGSTER_RL_ADAPTER_ROOTS`, which a rollout environment that starts the server sets), resolved,
  so a link out of them is outside: 403 otherwise; a load that fails (any name works: PEFT sees an
  internal one) leaves the model as it was, and unloading the last adapter returns it to its base;
- a client that goes away cancels its request (dropped while queued; a batch stops between two
  tokens once all of its requests are gone);
- it runs on uvicorn (one event loop accepts every connection; a listen backlog of
  `bounds.MAX_CONCURRENCY`, the most trials a rollout environment sends at once); `--max-batch` >= 1.

Limits: one choice per request (n = 1), no streaming, no echo, at most one stop token.
"""

import argparse
import asyncio
import json
import logging
import math
import os
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any

import torch
import uvicorn
from peft import PeftModel
from peft.tuners.tuners_utils import BaseTunerLayer

from dagster_rl.core import bounds
from dagster_rl.tasks.lm.model.build import building
from dagster_rl.tasks.lm.model.policy import ADAPTER, ADAPTER_CONFIG, load_base
from dagster_rl.tasks.lm.rollout.sampling import generate
from dagster_rl.tasks.lm.settings import SamplingSettings
from dagster_rl.tasks.lm.serve.cli import add_arguments, adapter_roots  # noqa: F401 - add_arguments: the command line, beside the server
from dagster_rl.inference.server_process import ADAPTER_ROOTS_ENV

log = logging.getLogger("dagster_rl.serve")


class APIError(Exception):
    """An error answered as vLLM answers it: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: HTTPStatus, message: str, err_type: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.err_type, self.param = status, message, err_type, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": int(self.status)}}


MAX_LOGPROBS = 20  # vLLM's default --max-logprobs

# vLLM's sampling fields this server does not implement: the values it accepts (the first one is
# vLLM's neutral default); any other value is a 400 naming the field.
NEUTRAL_ONLY: dict[str, tuple[Any, ...]] = {
    "n": (1, None),
    "best_of": (None, 1),
    "use_beam_search": (False, None),
    "echo": (False, None),
    "stream": (False, None),
    "suffix": (None,),
    "top_k": (0, None),
    "min_p": (0.0, None),
    "repetition_penalty": (1.0, None),
    "presence_penalty": (0.0, None),
    "frequency_penalty": (0.0, None),
    "length_penalty": (1.0, None),
    "min_tokens": (0, None),
    "stop": ([], None),
    "logit_bias": (None, {}),
    "allowed_token_ids": (None,),
    "bad_words": ([], None),
    "watermarking": (None, False),
    "truncate_prompt_tokens": (None,),
    "structured_outputs": (None,),
    "response_format": (None, {"type": "text"}),
    "repetition_detection": (None,),
    "thinking_token_budget": (None,),
    "logprob_token_ids": (None, []),
    "prompt_logprobs": (None,),
    "prompt_embeds": (None,),
    "vllm_xargs": (None, {}),
}


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


class BatchCancelled(Exception):
    """Every request of a running batch was cancelled (their clients went away): it stops generating."""


@dataclass(eq=False)
class _Pending:
    request: CompletionRequest
    future: Future = field(default_factory=Future)  # the result, or the error, of this request
    cancelled: bool = False  # its client went away


class Batcher:
    """Collects concurrent requests and runs them in batches, on one thread: each batch is the
    pending requests of one group (the oldest request's), at most `max_batch` of them, oldest first.

    A request whose client goes away (`cancel`) is dropped while it waits, and a running batch stops
    between two tokens once all of its requests are cancelled (`run_batch` gets `cancelled`, a
    function that says so). Every request submitted gets its result or an error: the loop catches
    every failure of a batch and hands it to that batch's requests."""

    def __init__(self, run_batch: Callable[[list[CompletionRequest], Callable[[], bool]], list[CompletionResult]], max_batch: int = 64):
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        self.run_batch, self.max_batch = run_batch, max_batch
        self._pending: list[_Pending] = []
        self._cv = threading.Condition()
        self._closed = False
        self.batches = 0  # batches run (tests, benches)
        self._thread = threading.Thread(target=self._loop, name="batcher", daemon=True)
        self._thread.start()

    def submit(self, request: CompletionRequest) -> _Pending:
        """Queue a request; its `future` holds the result (wait on it, or cancel it with `cancel`)."""
        item = _Pending(request)
        with self._cv:
            if self._closed:
                raise RuntimeError("the server is shutting down")
            self._pending.append(item)
            self._cv.notify()
        return item

    def complete(self, request: CompletionRequest, timeout_s: float | None = None) -> CompletionResult:
        """Submit and wait (a caller on a thread)."""
        return self.submit(request).future.result(timeout_s)

    def cancel(self, item: _Pending) -> None:
        """The request's client went away: drop it if it waits; a running batch of only such requests stops."""
        with self._cv:
            item.cancelled = True
            waiting = any(p is item for p in self._pending)
            if waiting:
                self._pending = [p for p in self._pending if p is not item]
        if waiting:
            item.future.cancel()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            dropped, self._pending = self._pending, []
            self._cv.notify_all()
        for item in dropped:
            item.future.set_exception(RuntimeError("the server is shutting down"))

    def _next_batch(self) -> list[_Pending] | None:
        with self._cv:
            while not self._pending and not self._closed:
                self._cv.wait()
            if self._closed:
                return None
            group = self._pending[0].request.group
            batch: list[_Pending] = []
            rest: list[_Pending] = []
            for p in self._pending:
                (batch if p.request.group == group and len(batch) < self.max_batch else rest).append(p)
            self._pending = rest
            return batch

    def _loop(self) -> None:
        while (batch := self._next_batch()) is not None:
            self.batches += 1
            try:
                results = self.run_batch([p.request for p in batch], lambda b=batch: all(p.cancelled for p in b))
                if len(results) != len(batch):
                    raise RuntimeError(f"a batch of {len(batch)} requests gave {len(results)} results")
                for item, result in zip(batch, results):
                    _settle(item.future, result=result)
            except BaseException as e:  # noqa: BLE001 - every request of the batch gets the error
                for item in batch:
                    _settle(item.future, error=e)


def _settle(future: Future, result: Any = None, error: BaseException | None = None) -> None:
    """Set a future's outcome unless it is already set (a request cancelled while it waited)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


class AdapterLoadError(APIError):
    """A load refused, or failed: the server holds what it held before."""


class Engine:
    """The base model, its tokenizer, and the LoRA adapters loaded by name.

    Adapters load only from folders under `adapter_roots` (resolved: a link out of them is outside).
    Each is a PEFT adapter under an internal name (`a<n>`), so any name a client gives is servable,
    and a load either completes or leaves the model as it was: a load that fails is undone, and
    unloading the last adapter returns the model to its base."""

    def __init__(self, model: str, served_name: str | None = None, dtype: str = "float32", adapter_roots: Sequence[str] = ()):
        self.model_arg, self.name = model, served_name or model
        base, self.tokenizer = load_base(model, dtype)
        self.base = base.eval()
        self.peft: PeftModel | None = None
        self.adapters: dict[str, str] = {}  # name -> path
        self._internal: dict[str, str] = {}  # name -> PEFT's adapter name
        self._loads = 0
        self.adapter_roots = tuple(dict.fromkeys(os.path.realpath(r) for r in adapter_roots if r))
        self.vocab = int(base.get_input_embeddings().num_embeddings)  # the ids the model has rows for
        self.max_model_len = int(getattr(base.config, "max_position_embeddings", 0) or 0) or None
        self.lock = threading.Lock()  # the model: one batch or one adapter change at a time

    # ---- adapters ----------------------------------------------------------------------------
    def check_adapter_folder(self, name: str, path: str) -> Path:
        """The adapter folder `path`, resolved, if this server may load it: under an allowed root,
        with its two files under that root too."""
        if not self.adapter_roots:
            raise AdapterLoadError(
                HTTPStatus.FORBIDDEN,
                f"Loading lora {name} failed: this server loads adapters only from the folders given with --adapter-root "
                f"(or ${ADAPTER_ROOTS_ENV}), and none was given: restart it with --adapter-root <folder>",
                "PermissionDeniedError",
                "lora_path",
            )
        folder = os.path.realpath(path)
        files = [os.path.realpath(os.path.join(folder, f)) for f in (ADAPTER_CONFIG, ADAPTER)]
        root = next((r for r in self.adapter_roots if _under(folder, r)), None)
        if root is None or not all(_under(f, root) for f in files):
            where = folder if root is None else next(f for f in files if not _under(f, root))
            raise AdapterLoadError(
                HTTPStatus.FORBIDDEN,
                f"Loading lora {name} failed: {path} is outside the folders this server loads adapters from "
                f"({', '.join(self.adapter_roots)}): it resolves to {where}",
                "PermissionDeniedError",
                "lora_path",
            )
        if not all(os.path.isfile(f) for f in files):
            raise AdapterLoadError(HTTPStatus.NOT_FOUND, f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError", "lora_path")
        return Path(folder)

    def load_adapter(self, name: str, path: str, inplace: bool = False) -> None:
        if not name or not path:
            raise APIError(HTTPStatus.BAD_REQUEST, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        folder = self.check_adapter_folder(name, path)
        with self.lock, building():  # PEFT builds the adapter's layers
            if name in self.adapters and not inplace:
                raise APIError(
                    HTTPStatus.BAD_REQUEST,
                    f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, set 'load_inplace' to True.",
                    "InvalidUserInput",
                )
            self._loads += 1
            internal = f"a{self._loads}"
            try:
                if self.peft is None:
                    self.peft = PeftModel.from_pretrained(self.base, str(folder), adapter_name=internal).eval()
                else:
                    self.peft.load_adapter(str(folder), adapter_name=internal)
                    self.peft.eval()
            except Exception as e:  # noqa: BLE001 - any failure of PEFT's load is undone, then reported
                self._undo(internal)
                raise AdapterLoadError(
                    HTTPStatus.BAD_REQUEST,
                    f"Loading lora {name} failed: {path} is not a LoRA adapter of {self.name} this server can load "
                    f"({type(e).__name__}: {str(e)[:300]}); nothing was loaded",
                    "BadRequestError",
                    "lora_path",
                ) from None
            if name in self._internal:  # load_inplace: the new weights replace the old ones
                self._delete(self._internal[name])
            self.adapters[name], self._internal[name] = path, internal
        log.info("Loaded new LoRA adapter: name '%s', path '%s'", name, path)

    def unload_adapter(self, name: str) -> None:
        if not name:
            raise APIError(HTTPStatus.BAD_REQUEST, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput")
        with self.lock:
            if name not in self.adapters:
                raise APIError(HTTPStatus.NOT_FOUND, f"The lora adapter '{name}' cannot be found.", "NotFoundError", "lora_name")
            del self.adapters[name]
            self._delete(self._internal.pop(name))
        log.info("Removed LoRA adapter: name '%s'", name)

    def _delete(self, internal: str) -> None:
        """Remove one PEFT adapter; the last one gone, the model is its base again (no LoRA layer left)."""
        assert self.peft is not None
        if not self._internal:
            self._to_base()
            return
        with warnings.catch_warnings():  # PEFT warns when the active adapter goes: the next batch sets its own
            warnings.filterwarnings("ignore", message="Adapter .* was active which is now deleted")
            self.peft.delete_adapter(internal)

    def _undo(self, internal: str) -> None:
        """Remove what a failed load of `internal` left: its adapter, or every LoRA layer when it was the first."""
        if self.peft is None or not self._internal:
            self._to_base()
            return
        try:
            if internal in self.peft.peft_config:
                self._delete(internal)
        except Exception:  # noqa: BLE001 - PEFT could not remove it: rebuild from the adapters' folders
            log.exception("could not remove the failed adapter; reloading the loaded ones")
            loaded = {n: (self.adapters[n], i) for n, i in self._internal.items()}
            self._to_base()
            for n, (path, i) in loaded.items():
                if self.peft is None:
                    self.peft = PeftModel.from_pretrained(self.base, path, adapter_name=i).eval()
                else:
                    self.peft.load_adapter(path, adapter_name=i)

    def _to_base(self) -> None:
        """The model without LoRA: every PEFT layer replaced by the layer it wraps, PEFT's record removed."""
        for module in list(self.base.modules()):
            for child_name, child in list(module.named_children()):
                if isinstance(child, BaseTunerLayer):
                    setattr(module, child_name, child.get_base_layer())
        if "peft_config" in vars(self.base):
            delattr(self.base, "peft_config")
        self.peft = None
        self.base.eval()

    def model_cards(self) -> list[dict[str, Any]]:
        created = int(time.time())
        base = {"id": self.name, "object": "model", "created": created, "owned_by": "dagster-rl", "root": self.model_arg,
                "parent": None, "max_model_len": self.max_model_len, "permission": []}  # fmt: skip
        loras = [
            {"id": n, "object": "model", "created": created, "owned_by": "dagster-rl", "root": p, "parent": self.name,
             "max_model_len": None, "permission": []}  # fmt: skip
            for n, p in list(self.adapters.items())
        ]
        return [base, *loras]

    def check_model(self, name: str) -> None:
        if name != self.name and name not in self.adapters:
            raise APIError(HTTPStatus.NOT_FOUND, f"The model `{name}` does not exist.", "NotFoundError", "model")

    # ---- generation --------------------------------------------------------------------------
    def run_batch(self, batch: list[CompletionRequest], cancelled: Callable[[], bool] = lambda: False) -> list[CompletionResult]:
        """Sample a batch of one group: the `hf` engine's sampler and log-probabilities; stops
        (`BatchCancelled`) between two tokens once `cancelled()` says every request went away."""
        first = batch[0]
        sampling = SamplingSettings(temperature=first.temperature, top_p=first.top_p, max_new_tokens=first.max_tokens)
        tok = self.tokenizer
        with self.lock, torch.inference_mode():
            if first.model not in self.adapters:  # the base model (or an adapter unloaded meanwhile)
                self.check_model(first.model)
            model = _Forward(self._select(first.model), cancelled, base_only=first.model not in self.adapters and self.peft is not None)
            top = max(r.logprobs or 0 for r in batch)
            gens = generate(model, [r.prompt_ids for r in batch], [r.seed for r in batch], sampling, first.stop_id, tok.pad_token_id, top)
        return [
            CompletionResult(list(g.completion_ids), list(g.logprobs), g.finish_reason, g.top and [t[: r.logprobs] for t in g.top])
            for g, r in zip(gens, batch)
        ]

    def _select(self, name: str) -> torch.nn.Module:
        if name in self.adapters:
            assert self.peft is not None
            self.peft.set_adapter(self._internal[name])
            return self.peft
        return self.base if self.peft is None else self.peft


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


class _Forward(torch.nn.Module):
    """The model a batch generates with: its forward stops the batch (`BatchCancelled`) once every
    request went away, and with `base_only` runs the PEFT model with its adapters disabled (the base's numbers)."""

    def __init__(self, model: torch.nn.Module, cancelled: Callable[[], bool], base_only: bool = False):
        super().__init__()
        self.model, self.cancelled, self.base_only = model, cancelled, base_only

    def forward(self, *args, **kwargs):
        if self.cancelled():
            raise BatchCancelled()
        if self.base_only:
            with self.model.disable_adapter():
                return self.model(*args, **kwargs)
        return self.model(*args, **kwargs)


def _same(value: Any, neutral: Any) -> bool:
    """`value` is `neutral` (JSON's true and false are not 1 and 0)."""
    return isinstance(value, bool) == isinstance(neutral, bool) and value == neutral


def _neutral_only(body: dict[str, Any]) -> None:
    """A 400 naming the first field this server does not implement, sent at another value than its neutral one."""
    for name, accepted in NEUTRAL_ONLY.items():
        if name in body and not any(_same(body[name], v) for v in accepted):
            raise APIError(
                HTTPStatus.BAD_REQUEST,
                f"this server does not implement {name} = {body[name]!r}: send {accepted[0]!r} or leave it out "
                "(dagster-rl serve samples the tempered distribution, cut to top_p, up to max_tokens and one stop token)",
                param=name,
            )


def _number(body: dict[str, Any], name: str, default: float, kind: type = float) -> Any:
    """A numeric field: a JSON number (an integer for `kind` int), finite; `default` when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise APIError(HTTPStatus.BAD_REQUEST, f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}", param=name)
    try:
        number = kind(value)
    except OverflowError:  # an integer beyond float64, as a float field
        number = math.inf
    if isinstance(number, float) and not math.isfinite(number):
        raise APIError(HTTPStatus.BAD_REQUEST, f"{name} must be finite, got {str(value)[:50]}", param=name)
    return number


def _flag(body: dict[str, Any], name: str) -> bool:
    """A boolean field: true, false, or absent / null (false)."""
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise APIError(HTTPStatus.BAD_REQUEST, f"{name} must be true or false, got {value!r}", param=name)
    return bool(value)


def _text(body: dict[str, Any], name: str, default: str = "") -> str:
    """A string field; `default` when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, str):
        raise APIError(HTTPStatus.BAD_REQUEST, f"{name} must be a string, got {value!r}", param=name)
    return value


def parse_completion_request(body: dict[str, Any], engine: Engine) -> CompletionRequest:
    """A vLLM /v1/completions body, for the subset this server serves; errors as vLLM words them,
    each a 400 naming its field (`param`)."""
    _neutral_only(body)
    model = _text(body, "model") or engine.name
    engine.check_model(model)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompt_ids = engine.tokenizer(prompt)["input_ids"]
    elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
        return parse_completion_request({**body, "prompt": prompt[0]}, engine)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompt_ids = list(prompt)
    else:
        raise APIError(HTTPStatus.BAD_REQUEST, "prompt must be a string, or one list of token ids", param="prompt")
    vocab = engine.vocab
    if not prompt_ids or any(not 0 <= t < vocab for t in prompt_ids):
        raise APIError(HTTPStatus.BAD_REQUEST, f"prompt token ids must be in [0, {vocab})", param="prompt")
    max_tokens, temperature = _number(body, "max_tokens", 16, int), _number(body, "temperature", 1.0)
    top_p, logprobs = _number(body, "top_p", 1.0), body.get("logprobs")
    if max_tokens < 1:
        raise APIError(HTTPStatus.BAD_REQUEST, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if temperature < 0:
        raise APIError(HTTPStatus.BAD_REQUEST, f"temperature must be >= 0, got {temperature}", param="temperature")
    if not 0 < top_p <= 1:
        raise APIError(HTTPStatus.BAD_REQUEST, f"top_p must be in (0, 1], got {top_p}", param="top_p")
    if engine.max_model_len is not None and len(prompt_ids) + max_tokens > engine.max_model_len:
        raise APIError(
            HTTPStatus.BAD_REQUEST,
            f"This model's maximum context length is {engine.max_model_len} tokens. However, you requested "
            f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, {max_tokens} in max_tokens): "
            "reduce the prompt or max_tokens.",
            param="max_tokens",
        )
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= MAX_LOGPROBS):
        raise APIError(
            HTTPStatus.BAD_REQUEST, f"Requested sample logprobs of {logprobs!r}, which is not in [0, max allowed: {MAX_LOGPROBS}]", param="logprobs"
        )
    seed = body.get("seed")
    if seed is None:
        seed = uuid.uuid4().int % 2**63  # vLLM samples unseeded requests at random too
    if not isinstance(seed, int) or isinstance(seed, bool) or not -(2**63) <= seed < 2**63:
        raise APIError(HTTPStatus.BAD_REQUEST, "seed must be an integer of 64 bits", param="seed")
    _flag(body, "return_tokens_as_token_ids")
    stop_id, stop_reason = _stop_token(body, engine.tokenizer.eos_token_id, vocab)
    return CompletionRequest(model, prompt_ids, max_tokens, temperature, top_p, seed, logprobs, stop_id, stop_reason)


def _stop_token(body: dict[str, Any], eos_id: int, vocab: int) -> tuple[int, int | None]:
    """The one token that ends a completion, and the stop_reason vLLM gives it: a `stop_token_ids`
    id is its own reason, the eos (unless `ignore_eos`) has none; -1: none ends it early."""
    ids = body.get("stop_token_ids")
    ids = [] if ids is None else ids
    if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in ids):
        raise APIError(HTTPStatus.BAD_REQUEST, f"stop_token_ids must be token ids in [0, {vocab})", param="stop_token_ids")
    ignore_eos = _flag(body, "ignore_eos")
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


def completion_response(req: CompletionRequest, result: CompletionResult, engine: Engine, as_token_ids: bool) -> dict[str, Any]:
    """vLLM's CompletionResponse for one prompt and one choice."""
    tok = engine.tokenizer

    def name(t: int) -> str:
        return f"token_id:{t}" if as_token_ids else tok.decode([t])

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
                for t, lp, top in zip(result.token_ids, result.logprobs, tops)
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


class App:
    """The server as an ASGI application (run by uvicorn: one event loop for every connection; the
    model runs on the batcher's thread, adapter changes and request parsing on worker threads).

    A completion waits for its batch while it also watches its connection: a client that goes away
    cancels its request (dropped from the queue, or its batch stopped once every request of it is
    gone), so nothing is generated for nobody."""

    def __init__(self, engine: Engine, max_batch: int = 64):
        self.engine, self.batcher = engine, Batcher(engine.run_batch, max_batch)
        self.cancelled = 0  # requests whose client went away before their answer (tests, logs)

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            self.batcher.close()
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        try:
            body = await _read_body(receive)
            if method == "GET" and path == "/health":
                status, payload = 200, ""
            elif method == "GET" and path == "/v1/models":
                status, payload = 200, {"object": "list", "data": self.engine.model_cards()}
            elif method == "POST" and path == "/v1/completions":
                answer = await self._complete(_json_object(body), receive)
                if answer is None:  # the client went away: nobody to answer
                    return
                status, payload = 200, answer
            elif method == "POST" and path == "/v1/load_lora_adapter":
                status, payload = await asyncio.to_thread(self._load, _json_object(body))
            elif method == "POST" and path == "/v1/unload_lora_adapter":
                status, payload = await asyncio.to_thread(self._unload, _json_object(body))
            else:
                raise APIError(HTTPStatus.NOT_FOUND, f"no route {method} {path}", "NotFoundError")
        except APIError as e:
            status, payload = e.status, e.body()
        except Exception as e:  # noqa: BLE001 - any other failure is the server's: a 500 that says what
            log.exception("request failed")
            status, payload = HTTPStatus.INTERNAL_SERVER_ERROR, APIError(HTTPStatus.INTERNAL_SERVER_ERROR, repr(e), "InternalServerError").body()
        await _send(send, int(status), payload)

    async def _complete(self, body: dict[str, Any], receive: Callable) -> dict[str, Any] | None:
        req = await asyncio.to_thread(parse_completion_request, body, self.engine)
        item = self.batcher.submit(req)
        answered = asyncio.wrap_future(item.future)
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({answered, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not answered.done():
                self.batcher.cancel(item)
                answered.cancel()
            gone.cancel()
        if answered.cancelled():
            self.cancelled += 1
            log.info("a client went away before its completion: its request was cancelled (%d so far)", self.cancelled)
            return None
        result = answered.result()  # BatchCancelled only reaches requests that were all cancelled
        return completion_response(req, result, self.engine, _flag(body, "return_tokens_as_token_ids"))

    def _load(self, body: dict[str, Any]) -> tuple[int, Any]:
        name = _text(body, "lora_name")
        self.engine.load_adapter(name, _text(body, "lora_path"), _flag(body, "load_inplace"))
        return 200, f"Success: LoRA adapter '{name}' added successfully."

    def _unload(self, body: dict[str, Any]) -> tuple[int, Any]:
        name = _text(body, "lora_name")
        self.engine.unload_adapter(name)
        return 200, f"Success: LoRA adapter '{name}' removed successfully."


MAX_BODY_BYTES = 64 * 2**20  # a request body: a prompt of 2^20 token ids is ~7 MiB of JSON


async def _read_body(receive: Callable) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise APIError(HTTPStatus.BAD_REQUEST, "the client went away while it sent its request")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise APIError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"the request body is larger than {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw or b"{}")
    except ValueError:
        raise APIError(HTTPStatus.BAD_REQUEST, "the request body is not JSON") from None
    if not isinstance(body, dict):
        raise APIError(HTTPStatus.BAD_REQUEST, "the request body must be a JSON object")
    return body


async def _disconnected(receive: Callable) -> None:
    """Returns when the client has gone away (after the request's body was read, uvicorn's receive
    waits until the connection closes or the response is complete)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _send(send: Callable, status: int, payload: Any) -> None:
    text = isinstance(payload, str)
    data = payload.encode() if text else json.dumps(payload).encode()
    kind = b"text/plain; charset=utf-8" if text else b"application/json"
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", kind), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


# The listen backlog: connections the kernel holds before the server accepts them. uvicorn accepts on
# its event loop as they come, so this only has to hold a burst: every trial a rollout environment may
# send at once (its max_concurrency, at most bounds.MAX_CONCURRENCY); the kernel caps it at
# net.core.somaxconn (4096 on Linux >= 5.4).
BACKLOG = bounds.MAX_CONCURRENCY


def server_config(app: App, host: str, port: int) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        backlog=BACKLOG,
        log_config=None,  # our logging (main): one line per request, as before
        timeout_keep_alive=5,  # as vLLM's uvicorn: http_json's client drops idle connections after 2 s
        timeout_graceful_shutdown=5,
        lifespan="on",
    )


def main(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = Engine(args.model, args.served_model_name, args.dtype, adapter_roots(args))
    app = App(engine, args.max_batch)
    log.info(
        "serving %s at http://%s:%d/v1 (batches of at most %d; adapters from %s)",
        engine.name, args.host, args.port, args.max_batch, ", ".join(engine.adapter_roots) or "nowhere: no --adapter-root",
    )  # fmt: skip
    uvicorn.Server(server_config(app, args.host, args.port)).run()
