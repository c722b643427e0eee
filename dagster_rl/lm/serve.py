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

Limits: one choice per request (n = 1), no streaming, no echo, at most one stop token.
"""

import argparse
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel

from dagster_rl.lm.policy import ADAPTER, ADAPTER_CONFIG, load_base
from dagster_rl.lm.sampling import generate
from dagster_rl.lm.settings import SamplingSettings

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


@dataclass
class _Pending:
    request: CompletionRequest
    done: threading.Event = field(default_factory=threading.Event)
    result: CompletionResult | None = None
    error: BaseException | None = None


class Batcher:
    """Collects concurrent requests and runs them in batches, on one thread: each batch is the
    pending requests of one group, at most `max_batch` of them."""

    def __init__(self, run_batch: Callable[[list[CompletionRequest]], list[CompletionResult]], max_batch: int = 64):
        self.run_batch, self.max_batch = run_batch, max_batch
        self._pending: list[_Pending] = []
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="batcher", daemon=True)
        self._thread.start()

    def submit(self, request: CompletionRequest) -> CompletionResult:
        item = _Pending(request)
        with self._cv:
            self._pending.append(item)
            self._cv.notify()
        item.done.wait()
        if item.error is not None:
            raise item.error
        assert item.result is not None
        return item.result

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._pending:
                    self._cv.wait()
                group = self._pending[0].request.group
                batch = [p for p in self._pending if p.request.group == group][: self.max_batch]
                self._pending = [p for p in self._pending if p not in batch]
            try:
                for item, result in zip(batch, self.run_batch([p.request for p in batch]), strict=True):
                    item.result = result
            except BaseException as e:  # noqa: BLE001 - every request of the batch gets the error
                for item in batch:
                    item.error = e
            for item in batch:
                item.done.set()


class Engine:
    """The base model, its tokenizer, and the LoRA adapters loaded by name."""

    def __init__(self, model: str, served_name: str | None = None, dtype: str = "float32"):
        self.model_arg, self.name = model, served_name or model
        base, self.tokenizer = load_base(model, dtype)
        self.base = base.eval()
        self.peft: PeftModel | None = None
        self.adapters: dict[str, str] = {}  # name -> path
        self.max_model_len = int(getattr(base.config, "max_position_embeddings", 0) or 0) or None
        self.lock = threading.Lock()  # the model: one batch or one adapter change at a time

    # ---- adapters ----------------------------------------------------------------------------
    def load_adapter(self, name: str, path: str, inplace: bool = False) -> None:
        if not name or not path:
            raise APIError(HTTPStatus.BAD_REQUEST, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        if name in self.adapters and not inplace:
            raise APIError(
                HTTPStatus.BAD_REQUEST,
                f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, set 'load_inplace' to True.",
                "InvalidUserInput",
            )
        folder = Path(path)
        if not (folder / ADAPTER_CONFIG).is_file() or not (folder / ADAPTER).is_file():
            raise APIError(HTTPStatus.NOT_FOUND, f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError")
        with self.lock:
            if name in self.adapters:
                self._delete(name)
            if self.peft is None:
                self.peft = PeftModel.from_pretrained(self.base, str(folder), adapter_name=name).eval()
            else:
                self.peft.load_adapter(str(folder), adapter_name=name)
                self.peft.eval()
            self.adapters[name] = path
        log.info("Loaded new LoRA adapter: name '%s', path '%s'", name, path)

    def unload_adapter(self, name: str) -> None:
        if not name:
            raise APIError(HTTPStatus.BAD_REQUEST, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput")
        if name not in self.adapters:
            raise APIError(HTTPStatus.NOT_FOUND, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        with self.lock:
            self._delete(name)
        log.info("Removed LoRA adapter: name '%s'", name)

    def _delete(self, name: str) -> None:
        assert self.peft is not None
        self.peft.delete_adapter(name)
        del self.adapters[name]

    def model_cards(self) -> list[dict[str, Any]]:
        created = int(time.time())
        base = {"id": self.name, "object": "model", "created": created, "owned_by": "dagster-rl", "root": self.model_arg,
                "parent": None, "max_model_len": self.max_model_len, "permission": []}  # fmt: skip
        loras = [
            {"id": n, "object": "model", "created": created, "owned_by": "dagster-rl", "root": p, "parent": self.name,
             "max_model_len": None, "permission": []}  # fmt: skip
            for n, p in self.adapters.items()
        ]
        return [base, *loras]

    def check_model(self, name: str) -> None:
        if name != self.name and name not in self.adapters:
            raise APIError(HTTPStatus.NOT_FOUND, f"The model `{name}` does not exist.", "NotFoundError", "model")

    # ---- generation --------------------------------------------------------------------------
    def run_batch(self, batch: list[CompletionRequest]) -> list[CompletionResult]:
        """Sample a batch of one group: the `hf` engine's sampler and log-probabilities."""
        first = batch[0]
        sampling = SamplingSettings(temperature=first.temperature, top_p=first.top_p, max_new_tokens=first.max_tokens)
        tok = self.tokenizer
        with self.lock, torch.inference_mode():
            if first.model not in self.adapters:  # the base model (or an adapter unloaded meanwhile)
                self.check_model(first.model)
            model = self._select(first.model)
            top = max(r.logprobs or 0 for r in batch)
            gens = generate(model, [r.prompt_ids for r in batch], [r.seed for r in batch], sampling, first.stop_id, tok.pad_token_id, top)
        return [
            CompletionResult(list(g.completion_ids), list(g.logprobs), g.finish_reason, g.top and [t[: r.logprobs] for t in g.top])
            for g, r in zip(gens, batch)
        ]

    def _select(self, name: str) -> torch.nn.Module:
        if name in self.adapters:
            assert self.peft is not None
            self.peft.set_adapter(name)
            return self.peft
        return self.base if self.peft is None else _BaseOnly(self.peft)


class _BaseOnly(torch.nn.Module):
    """The PEFT model with its adapters disabled: the base model's numbers."""

    def __init__(self, peft: PeftModel):
        super().__init__()
        self.peft = peft

    def forward(self, *args, **kwargs):
        with self.peft.disable_adapter():
            return self.peft(*args, **kwargs)


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
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise APIError(HTTPStatus.BAD_REQUEST, f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}", param=name)
    return kind(value)


def parse_completion_request(body: dict[str, Any], engine: Engine) -> CompletionRequest:
    """A vLLM /v1/completions body, for the subset this server serves; errors as vLLM words them."""
    _neutral_only(body)
    model = str(body.get("model") or engine.name)
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
    vocab = len(engine.tokenizer)
    if not prompt_ids or any(not 0 <= t < vocab for t in prompt_ids):
        raise APIError(HTTPStatus.BAD_REQUEST, f"prompt token ids must be in [0, {vocab})", param="prompt")
    max_tokens, temperature = _number(body, "max_tokens", 16, int), _number(body, "temperature", 1.0)
    top_p, logprobs = _number(body, "top_p", 1.0), body.get("logprobs")
    if max_tokens < 1 or temperature < 0 or not 0 < top_p <= 1:
        raise APIError(HTTPStatus.BAD_REQUEST, "need max_tokens >= 1, temperature >= 0, 0 < top_p <= 1")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= MAX_LOGPROBS):
        raise APIError(
            HTTPStatus.BAD_REQUEST, f"Requested sample logprobs of {logprobs!r}, which is not in [0, max allowed: {MAX_LOGPROBS}]", param="logprobs"
        )
    seed = body.get("seed")
    if seed is None:
        seed = uuid.uuid4().int % 2**63  # vLLM samples unseeded requests at random too
    if not isinstance(seed, int) or isinstance(seed, bool) or not -(2**63) <= seed < 2**63:
        raise APIError(HTTPStatus.BAD_REQUEST, "seed must be an integer of 64 bits", param="seed")
    stop_id, stop_reason = _stop_token(body, engine.tokenizer.eos_token_id, vocab)
    return CompletionRequest(model, prompt_ids, max_tokens, temperature, top_p, seed, logprobs, stop_id, stop_reason)


def _stop_token(body: dict[str, Any], eos_id: int, vocab: int) -> tuple[int, int | None]:
    """The one token that ends a completion, and the stop_reason vLLM gives it: a `stop_token_ids`
    id is its own reason, the eos (unless `ignore_eos`) has none; -1: none ends it early."""
    ids = body.get("stop_token_ids") or []
    if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in ids):
        raise APIError(HTTPStatus.BAD_REQUEST, f"stop_token_ids must be token ids in [0, {vocab})", param="stop_token_ids")
    stops = dict.fromkeys([*([] if body.get("ignore_eos") else [eos_id]), *ids])
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
    return stop, (None if stop == eos_id and not body.get("ignore_eos") else stop)


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


def make_server(engine: Engine, host: str, port: int, max_batch: int = 64) -> ThreadingHTTPServer:
    batcher = Batcher(engine.run_batch, max_batch)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:  # one line per request, in the server's log
            log.info("%s %s", self.address_string(), fmt % args)

        def _send(self, status: int, payload: Any) -> None:
            data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain; charset=utf-8" if isinstance(payload, str) else "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> dict[str, Any]:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                body = json.loads(raw or b"{}")
            except ValueError:
                raise APIError(HTTPStatus.BAD_REQUEST, "the request body is not JSON") from None
            if not isinstance(body, dict):
                raise APIError(HTTPStatus.BAD_REQUEST, "the request body must be a JSON object")
            return body

        def _handle(self, fn: Callable[[], tuple[int, Any]]) -> None:
            try:
                status, payload = fn()
            except APIError as e:
                status, payload = e.status, e.body()
            except Exception as e:  # noqa: BLE001 - any other failure is the server's: a 500 that says what
                log.exception("request failed")
                status, payload = HTTPStatus.INTERNAL_SERVER_ERROR, APIError(HTTPStatus.INTERNAL_SERVER_ERROR, repr(e), "InternalServerError").body()
            self._send(status, payload)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            routes = {"/health": lambda: (200, ""), "/v1/models": lambda: (200, {"object": "list", "data": engine.model_cards()})}
            route = routes.get(self.path.split("?")[0])
            self._handle(route or (lambda: (404, APIError(HTTPStatus.NOT_FOUND, f"no route {self.path}", "NotFoundError").body())))

        def do_POST(self) -> None:  # noqa: N802
            path = self.path.split("?")[0]
            if path == "/v1/completions":
                self._handle(self._complete)
            elif path == "/v1/load_lora_adapter":
                self._handle(self._load)
            elif path == "/v1/unload_lora_adapter":
                self._handle(self._unload)
            else:
                self._handle(lambda: (404, APIError(HTTPStatus.NOT_FOUND, f"no route {self.path}", "NotFoundError").body()))

        def _complete(self) -> tuple[int, Any]:
            body = self._body()
            req = parse_completion_request(body, engine)
            result = batcher.submit(req)
            return 200, completion_response(req, result, engine, bool(body.get("return_tokens_as_token_ids")))

        def _load(self) -> tuple[int, Any]:
            body = self._body()
            name = str(body.get("lora_name") or "")
            engine.load_adapter(name, str(body.get("lora_path") or ""), bool(body.get("load_inplace")))
            return 200, f"Success: LoRA adapter '{name}' added successfully."

        def _unload(self) -> tuple[int, Any]:
            name = str(self._body().get("lora_name") or "")
            engine.unload_adapter(name)
            return 200, f"Success: LoRA adapter '{name}' removed successfully."

    return _Server((host, port), Handler)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # the listen backlog: a step's trials connect at once; http.server's 5 resets the connections beyond it
    request_queue_size = 1024


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="a local model folder, a hub id (offline cache), or builtin:tiny-qwen2")
    parser.add_argument("--served-model-name", default=None, help="the base model's id in /v1/models (default: --model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--max-batch", type=int, default=64, help="requests generated together at most")


def main(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = Engine(args.model, args.served_model_name, args.dtype)
    server = make_server(engine, args.host, args.port, args.max_batch)
    log.info("serving %s at http://%s:%d/v1", engine.name, args.host, server.server_address[1])
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
