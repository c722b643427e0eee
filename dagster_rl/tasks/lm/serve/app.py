"""`dagster-rl serve`: a small server over the project's own engine that speaks the subset of vLLM's
OpenAI-compatible API the `openai_server` rollout backend uses, with vLLM's field names and shapes:

    GET  /health, GET /v1/models
    POST /v1/completions            token-id (or text) prompts, seed, temperature, top_p, max_tokens,
                                    logprobs: k (the sampled token's and the top k), one stop token
                                    (stop_token_ids / ignore_eos), return_tokens_as_token_ids
    POST /v1/load_lora_adapter      {lora_name, lora_path, load_inplace}: a PEFT adapter folder
    POST /v1/unload_lora_adapter    {lora_name}

A Starlette application on uvicorn, as vLLM's own server: the request bodies are pydantic models
(`protocol`), and every error, a refused request's or the server's own, is answered in vLLM's format
by one exception handler (`error_response`).

Completions sample exactly as the `hf` rollout backend does (`sampling.generate`: one seeded
generator per request, and the sampler's own log softmax(logits / temperature) of each sampled
token before top-p, as vLLM's `--logprobs-mode processed_logprobs` with top_p 1), so a rollout
generated through this server equals the `hf` engine's token for token (log-probs to float
rounding: the engine folds the adapter into the weights, the server applies it per layer). Concurrent
requests are batched (`batcher.Batcher`); adapters are PEFT adapters of one base model, switched per
batch (`engine.Engine`).

Every other field of vLLM's CompletionRequest that changes what is sampled
(`vllm_client.NEUTRAL_SAMPLING`: top_k, min_p, the penalties, min_tokens, stop strings, ...) is
accepted at its neutral value only, and any other value is a 400 naming the field: never silence.
The server has no generation config: a field left out is neutral, as on vLLM started with
`--generation-config vllm`. Fields that only shape the answer, and fields vLLM does not know, are
ignored, as vLLM ignores unknown ones.

It cannot be wedged by what a client sends:

- every field is type-checked: a wrong type, `max_tokens` < 1, a non-finite number is a 400 naming
  the field; prompt + max_tokens beyond the model's context (`max_position_embeddings`) is a 400
  naming both; a body over `MAX_BODY_BYTES` is a 413, one nested deeper than Python's JSON reader goes
  (its recursion limit) a 400;
- adapters load only from the folders given with `--adapter-root` (repeatable; or
  `$DAGSTER_RL_ADAPTER_ROOTS`, which a rollout environment that starts the server sets), resolved,
  so a link out of them is outside: 403 otherwise; a load that fails (any name works: PEFT sees an
  internal one) leaves the model as it was, and unloading the last adapter returns it to its base;
- a client that goes away cancels its request (dropped while queued; a batch stops between two
  tokens once all of its requests are gone);
- one event loop accepts every connection (a listen backlog of `bounds.MAX_CONCURRENCY`, the most
  trials a rollout environment sends at once); `--max-batch` >= 1.

Limits: one choice per request (n = 1), no streaming, no echo, at most one stop token; an unknown
route, or a known one with another method, is a 404.
"""

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from http import HTTPStatus
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from dagster_rl.base import bounds
from dagster_rl.tasks.lm.serve.batcher import Batcher
from dagster_rl.tasks.lm.serve.cli import adapter_roots
from dagster_rl.tasks.lm.serve.engine import Engine
from dagster_rl.tasks.lm.serve.errors import APIError
from dagster_rl.tasks.lm.serve.protocol import (
    LoadAdapterBody,
    UnloadAdapterBody,
    completion_response,
    parse_completion_request,
    validated,
)

log = logging.getLogger("dagster_rl.serve")

MAX_BODY_BYTES = 64 * 2**20  # a request body: a prompt of 2^20 token ids is ~7 MiB of JSON


class JSON(Response):
    """A JSON answer, written by Python's json (the separators and the bare NaN vLLM's clients read)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return json.dumps(content).encode()


def api_error(exc: Exception, request: Request) -> APIError:
    """What any failure of a request is answered as: a refusal as it was raised, a route this
    server does not have as a 404, anything else as a 500 that says what."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, HTTPException) and exc.status_code in (HTTPStatus.NOT_FOUND, HTTPStatus.METHOD_NOT_ALLOWED):
        return APIError(HTTPStatus.NOT_FOUND, f"no route {request.method} {request.url.path}", "NotFoundError")
    if isinstance(exc, HTTPException):
        return APIError(HTTPStatus(exc.status_code), str(exc.detail))
    return APIError(HTTPStatus.INTERNAL_SERVER_ERROR, repr(exc), "InternalServerError")


async def error_response(request: Request, exc: Exception) -> Response:
    """The one exception handler: every error, in vLLM's format, with its status. (Starlette hands
    it any other exception last, then raises that on to uvicorn, which logs its traceback.)"""
    error = api_error(exc, request)
    return JSON(error.body(), status_code=int(error.status))


class App(Starlette):
    """The server as an ASGI application (run by uvicorn: one event loop for every connection; the
    model runs on the batcher's thread, adapter changes and request parsing on worker threads).

    A completion waits for its batch while it also watches its connection: a client that goes away
    cancels its request (dropped from the queue, or its batch stopped once every request of it is
    gone), so nothing is generated for nobody."""

    def __init__(self, engine: Engine, max_batch: int = 64):
        self.engine, self.batcher = engine, Batcher(engine.run_batch, max_batch)
        self.cancelled = 0  # requests whose client went away before their answer (tests, logs)
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/load_lora_adapter", self.load_lora_adapter, methods=["POST"]),
            Route("/v1/unload_lora_adapter", self.unload_lora_adapter, methods=["POST"]),
        ]
        super().__init__(
            routes=routes,
            exception_handlers=dict.fromkeys((APIError, HTTPException, Exception), error_response),
            lifespan=self._lifespan,
        )
        self.router.redirect_slashes = False  # a path is served as it is written, or is a 404

    @asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        yield
        self.batcher.close()

    async def health(self, request: Request) -> Response:
        await read_json(request, required=False)
        return PlainTextResponse("")

    async def models(self, request: Request) -> Response:
        await read_json(request, required=False)
        return JSON({"object": "list", "data": self.engine.model_cards()})

    async def completions(self, request: Request) -> Response:
        req = await asyncio.to_thread(parse_completion_request, await read_json(request), self.engine)
        item = self.batcher.submit(req)
        answered = asyncio.wrap_future(item.future)
        gone = asyncio.ensure_future(_disconnected(request))
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
            return Response(status_code=499)  # nobody to answer: uvicorn sends nothing on a closed connection
        result = answered.result()  # BatchCancelled only reaches requests that were all cancelled
        return JSON(completion_response(req, result, self.engine))

    async def load_lora_adapter(self, request: Request) -> Response:
        return PlainTextResponse(await asyncio.to_thread(self._load, await read_json(request)))

    async def unload_lora_adapter(self, request: Request) -> Response:
        return PlainTextResponse(await asyncio.to_thread(self._unload, await read_json(request)))

    def _load(self, body: dict[str, Any]) -> str:
        fields = validated(LoadAdapterBody, body)
        name = fields.lora_name or ""
        self.engine.load_adapter(name, fields.lora_path or "", bool(fields.load_inplace))
        return f"Success: LoRA adapter '{name}' added successfully."

    def _unload(self, body: dict[str, Any]) -> str:
        name = validated(UnloadAdapterBody, body).lora_name or ""
        self.engine.unload_adapter(name)
        return f"Success: LoRA adapter '{name}' removed successfully."


async def read_json(request: Request, required: bool = True) -> dict[str, Any]:
    """The request's body as a JSON object (an empty body: {}); read in full, at most `MAX_BODY_BYTES`
    (`required`: False reads and ignores it)."""
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise APIError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"the request body is larger than {MAX_BODY_BYTES} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(HTTPStatus.BAD_REQUEST, "the client went away while it sent its request") from None
    if not required:
        return {}
    try:
        body = json.loads(b"".join(chunks) or b"{}")
    except ValueError:
        raise APIError(HTTPStatus.BAD_REQUEST, "the request body is not JSON") from None
    except RecursionError:  # Python's reader recurses once per level, up to the interpreter's recursion limit
        raise APIError(
            HTTPStatus.BAD_REQUEST,
            f"the request body is JSON nested too deep (arrays or objects inside one another, beyond the "
            f"{sys.getrecursionlimit()} levels Python's JSON reader goes); a request of this API nests a few",
        ) from None
    if not isinstance(body, dict):
        raise APIError(HTTPStatus.BAD_REQUEST, "the request body must be a JSON object")
    return body


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away (after the request's body was read, uvicorn's receive
    waits until the connection closes or the response is complete)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


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
        log_config=None,  # our logging (main): one line per request
        timeout_keep_alive=5,  # as vLLM's uvicorn: http_json's client drops idle connections after 2 s
        timeout_graceful_shutdown=5,
        lifespan="on",
    )


def main(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = Engine(args.model, args.served_model_name, args.dtype, adapter_roots(args), args.prefix_cache_mib)
    app = App(engine, args.max_batch)
    log.info(
        "serving %s at http://%s:%d/v1 (batches of at most %d; adapters from %s)",
        engine.name, args.host, args.port, args.max_batch, ", ".join(engine.adapter_roots) or "nowhere: no --adapter-root",
    )  # fmt: skip
    uvicorn.Server(server_config(app, args.host, args.port)).run()
