"""A client of vLLM's OpenAI-compatible server (`python -m vllm.entrypoints.openai.api_server
--enable-lora`, runtime LoRA updating on; the version the tests run: `VLLM_VERSION`), and of
`dagster-rl serve`, which speaks the same subset:

    GET  /v1/models                 the base model and the loaded adapters (id, root = path, parent)
    POST /v1/completions            a token-id prompt, `seed`, every sampling field (`ServerSampling`),
                                    `logprobs` and `return_tokens_as_token_ids: true`: the completion
                                    comes back as "token_id:<id>" strings with the sampled token's
                                    log-probability
    POST /v1/load_lora_adapter      {lora_name, lora_path}: 200 and a text body, or an error object
    POST /v1/unload_lora_adapter    {lora_name}
    GET  /health                    200 once the server can serve (at the server's root, not /v1)

Requests go through one pooled HTTP client (`http_json.JSONEndpoint`): the rollout backend's
threads send a step's trials at once.

**Every request states every sampling field.** vLLM fills each field a request leaves out from the
model folder's `generation_config.json` (Qwen2.5-Instruct: top_k 20, top_p 0.8, temperature 0.7,
repetition_penalty 1.05) unless the server was started with `--generation-config vllm`, and it
stops on the generation config's `eos_token_id` list unless told otherwise. The trainer scores
log softmax(logits / temperature) of each token and nothing else, so a request fixes everything
else at the value that leaves that distribution alone (`NEUTRAL_SAMPLING`), and stops exactly
where this project's sampler stops (`stop_token_ids`, with `ignore_eos` so that no other id does).
"""

import math
import re
from dataclasses import dataclass
from typing import Any

from dagster_rl.base.errors import DagsterRLError
from dagster_rl.inference.http_json import EndpointError, JSONEndpoint

VLLM_VERSION = "0.32.0"  # the version the tests run (Makefile), the `vllm` extra and deploy/k8s/vllm.yaml's image
TOKEN_ID = re.compile(r"^token_id:(-?\d+)$")
# log-probabilities are <= 0; a correct server's log softmax of its most likely token can round above 0 by
# float32 rounding (vLLM and serve compute it as x - max - log(sum exp(x - max)), exactly <= 0 on the CPU)
LOGPROB_SLACK = 1e-5


@dataclass(frozen=True)
class Neutral:
    """A sampling field at its neutral value: `value`, what every request sends (when `sent`), and
    `same`, other values that mean the same to vLLM. `dagster-rl serve` implements none of these
    fields: it accepts `value` and `same` and refuses any other value."""

    value: Any
    same: tuple[Any, ...] = ()
    sent: bool = (
        True  # False: requests leave it out (a field unknown to vLLM 0.32, or one that only a text prompt or beam search reads)
    )

    @property
    def accepted(self) -> tuple[Any, ...]:
        return (self.value, *self.same)


# The fields of vLLM's CompletionRequest that change which tokens are sampled, or their
# log-probabilities, other than the ones the experiment sets (temperature, top_p, max_tokens, the
# stop tokens, seed), at their neutral values: what no distribution the trainer scores depends on.
# The one table: the client sends it, `dagster-rl serve` refuses every other value of it;
# tests/test_vllm_real.py checks it against the installed vLLM's CompletionRequest.
NEUTRAL_SAMPLING: dict[str, Neutral] = {
    "n": Neutral(1, (None,)),
    "best_of": Neutral(None, (1,), sent=False),  # older vLLMs' field: vLLM 0.32 does not know it
    "use_beam_search": Neutral(False, (None,)),
    "echo": Neutral(False, (None,)),
    "stream": Neutral(False, (None,)),
    "suffix": Neutral(None, sent=False),
    "top_k": Neutral(0, (None,)),  # 0: off (vLLM 0.32 refuses -1)
    "min_p": Neutral(0.0, (None,)),
    "repetition_penalty": Neutral(1.0, (None,)),
    "presence_penalty": Neutral(0.0, (None,)),
    "frequency_penalty": Neutral(0.0, (None,)),
    "length_penalty": Neutral(1.0, (None,), sent=False),  # beam search only
    "min_tokens": Neutral(0, (None,)),  # > 0 masks the stop tokens until then
    "stop": Neutral([], (None,)),  # no stop strings: a completion ends at a stop token or at max_tokens
    "logit_bias": Neutral(None, ({},)),
    "allowed_token_ids": Neutral(None),
    "bad_words": Neutral([], (None,)),
    "watermarking": Neutral(False, (None,)),  # vLLM: None means on, where the server has a watermark configured
    "truncate_prompt_tokens": Neutral(None),  # the whole prompt, never a cut one
    "structured_outputs": Neutral(None),
    "response_format": Neutral(None, ({"type": "text"},)),
    "repetition_detection": Neutral(None),
    "thinking_token_budget": Neutral(None),
    "logprob_token_ids": Neutral(None, ([],)),
    "prompt_logprobs": Neutral(None, sent=False),
    "prompt_embeds": Neutral(None, sent=False),
    "vllm_xargs": Neutral(None, ({},)),
}


def neutral_fields() -> dict[str, Any]:
    """What a request sends of `NEUTRAL_SAMPLING`."""
    return {name: field.value for name, field in NEUTRAL_SAMPLING.items() if field.sent}


class ServerReplyError(DagsterRLError):
    """The server answered something that is not what its API promises."""


@dataclass(frozen=True)
class ServerSampling:
    """What a completion is sampled with, as the trainer scores it: the tempered distribution
    (temperature 0: greedy), cut to its top-p nucleus, at most `max_tokens` tokens, ending at the
    first of `stop_token_ids` (included) and at no other token."""

    temperature: float
    top_p: float
    max_tokens: int
    stop_token_ids: tuple[int, ...]

    def fields(self) -> dict[str, Any]:
        """The request's sampling fields: every one of them, never the server's defaults."""
        return {
            **neutral_fields(),
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_tokens": self.max_tokens,
            "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": True,  # stop on stop_token_ids alone, not on the generation config's eos list too
        }


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # of each sampled token
    finish_reason: str
    text: str
    top_logprobs: list[dict[int, float]] | None = None  # with logprobs k >= 1: the top k (and the sampled) per position


def completion_body(model: str, prompt_ids: list[int], sampling: ServerSampling, seed: int, logprobs: int = 0) -> dict[str, Any]:
    """The /v1/completions request of one completion of a token-id prompt."""
    return {
        "model": model,
        "prompt": list(prompt_ids),
        "seed": seed,
        **sampling.fields(),
        "logprobs": logprobs,
        "return_tokens_as_token_ids": True,
    }


def token_id(token: Any, server: str = "rollout server") -> int:
    m = TOKEN_ID.match(str(token))
    if not m:
        raise ServerReplyError(
            f"{server} returned the token {str(token)[:100]!r}, not 'token_id:<id>': it ignores return_tokens_as_token_ids "
            "per request (an older vLLM: start it with --return-tokens-as-token-ids)"
        )
    return int(m.group(1))


def parse_completion(
    payload: Any, raw: bytes, sampling: ServerSampling, vocab: int | None, server: str = "rollout server"
) -> Completion:
    """A /v1/completions answer of one choice with logprobs (one was asked for: more is a broken
    rule), read as token ids and log-probabilities, and checked against what was asked
    (`check_completion`): everything the rollout backend takes from a server's reply is read here.
    `server` names the server in errors."""
    choices = payload.get("choices") if isinstance(payload, dict) else None
    if isinstance(choices, list) and len(choices) > 1:  # a request asks for one (n = 1): another is a sample nobody asked for
        raise ServerReplyError(
            f"{server} sent a completion that breaks the rule 'one choice per request (n = 1)': {len(choices)} choices"
        )
    try:
        choice = payload["choices"][0]
        lp = choice["logprobs"]
        tokens, logprobs = lp["tokens"], lp["token_logprobs"]
        finish, text = choice["finish_reason"], str(choice.get("text") or "")
        tops = lp.get("top_logprobs")
        if not isinstance(tokens, list) or not isinstance(logprobs, list):
            raise TypeError("tokens and token_logprobs are lists")
    except (KeyError, IndexError, TypeError):
        raise ServerReplyError(f"{server} answered a completion without logprobs: {raw[:300]!r}") from None
    ids = [token_id(t, server) for t in tokens]
    if len(ids) != len(logprobs) or any(not isinstance(v, (int, float)) or isinstance(v, bool) for v in logprobs):
        raise ServerReplyError(f"{server} returned {len(ids)} tokens with log-probabilities {str(logprobs)[:300]}")
    top = None
    if isinstance(tops, list) and tops and all(isinstance(d, dict) for d in tops):
        try:
            top = [{token_id(t, server): float(v) for t, v in d.items()} for d in tops]
        except (TypeError, ValueError):
            raise ServerReplyError(f"{server} returned top_logprobs that are not numbers: {str(tops)[:300]}") from None
    completion = Completion(ids, [float(v) for v in logprobs], str(finish), text, top)
    check_completion(completion, sampling, vocab, server)
    return completion


def check_completion(c: Completion, sampling: ServerSampling, vocab: int | None, server: str = "rollout server") -> None:
    """A `ServerReplyError` naming the rule a completion breaks, and the server, unless it is one the
    request could have produced:

    - tokens: at least 1 (a completion that stops at once holds its stop token) and at most `max_tokens`;
    - token ids: each in [0, vocab) (the model's vocabulary: `vocab`; None: not known, only >= 0);
    - log-probabilities: one per token, each finite and <= 0 (`LOGPROB_SLACK` for float rounding),
      and those of `top_logprobs` too;
    - finish_reason: "stop" exactly when the last token is one of the stop tokens asked for, "length"
      exactly when the completion holds `max_tokens` tokens and does not end at a stop token; no stop
      token before the last.

    These are the rules every reply of a correct server keeps, whatever it samples; a reply that
    breaks one is not a rollout (training on it would fail, or silently learn from numbers no
    policy produced)."""

    def broke(rule: str, detail: str) -> ServerReplyError:
        return ServerReplyError(f"{server} sent a completion that breaks the rule '{rule}': {detail}")

    ids, n = c.token_ids, len(c.token_ids)
    if not 1 <= n <= sampling.max_tokens:
        raise broke("1 <= tokens <= max_tokens", f"{n} tokens, max_tokens {sampling.max_tokens}")
    bound = f"[0, {vocab})" if vocab is not None else "[0, ...)"
    for i, t in enumerate(ids):
        if t < 0 or (vocab is not None and t >= vocab):
            raise broke("token ids in the vocabulary", f"token {t} at position {i} is not in {bound}")
    for i, v in enumerate(c.logprobs):
        if not math.isfinite(v) or v > LOGPROB_SLACK:
            raise broke("log-probabilities finite and <= 0", f"{v} at position {i} (token {ids[i]})")
    for i, d in enumerate(c.top_logprobs or []):
        for t, v in d.items():
            if t < 0 or (vocab is not None and t >= vocab) or not math.isfinite(v) or v > LOGPROB_SLACK:
                raise broke(
                    "top_logprobs: ids in the vocabulary, log-probabilities finite and <= 0", f"{{{t}: {v}}} at position {i}"
                )
    stops = set(sampling.stop_token_ids)
    early = next((i for i, t in enumerate(ids[:-1]) if t in stops), None)
    if early is not None:
        raise broke("nothing after a stop token", f"stop token {ids[early]} at position {early} of {n} tokens")
    ends_at_stop = ids[-1] in stops
    if c.finish_reason not in ("stop", "length"):
        raise broke("finish_reason 'stop' or 'length'", f"finish_reason {c.finish_reason!r}")
    if c.finish_reason == "stop" and not ends_at_stop:
        raise broke(
            "finish_reason 'stop' <=> the last token is a stop token",
            f"finish_reason 'stop', last token {ids[-1]}, stop tokens {sorted(stops)}",
        )
    if c.finish_reason == "length" and (ends_at_stop or n != sampling.max_tokens):
        detail = f"it ends at the stop token {ids[-1]}" if ends_at_stop else f"{n} tokens, max_tokens {sampling.max_tokens}"
        raise broke(
            "finish_reason 'length' <=> exactly max_tokens tokens, the last no stop token", f"finish_reason 'length', {detail}"
        )


class VLLMClient:
    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 60.0, max_connections: int = 64):
        self.base_url = base_url.rstrip("/")  # e.g. http://127.0.0.1:8000/v1
        self.http = JSONEndpoint(self.base_url, api_key, timeout_s, "rollout server", max_connections)

    @property
    def root(self) -> str:
        """The server's root (where /health is): base_url without its trailing /v1."""
        return self.base_url[: -len("/v1")] if self.base_url.endswith("/v1") else self.base_url

    def healthy(self, timeout_s: float = 2.0) -> bool:
        try:
            self.http.call("GET", self.root + "/health", timeout_s=timeout_s)
            return True
        except EndpointError:
            return False

    def models(self) -> list[dict[str, Any]]:
        payload, raw = self.http.call_json("GET", "/models")
        try:
            return [dict(card) for card in payload["data"]]
        except (KeyError, TypeError, ValueError):
            raise ServerReplyError(f"rollout server {self.base_url}/models answered no model list: {raw[:300]!r}") from None

    def load_adapter(self, name: str, path: str) -> None:
        self.http.call("POST", "/load_lora_adapter", {"lora_name": name, "lora_path": path})

    def unload_adapter(self, name: str) -> None:
        self.http.call("POST", "/unload_lora_adapter", {"lora_name": name})

    def complete(
        self,
        model: str,
        prompt_ids: list[int],
        sampling: ServerSampling,
        seed: int,
        logprobs: int = 0,
        timeout_s: float | None = None,
        *,
        vocab: int | None,
    ) -> Completion:
        """One completion of a token-id prompt, sampled with `seed`, as token ids and their
        log-probabilities; a `ServerReplyError` unless it keeps every rule of `check_completion`
        (`vocab`: the model's vocabulary size, which bounds its token ids; None where it is not known)."""
        payload, raw = self.http.call_json(
            "POST", "/completions", completion_body(model, prompt_ids, sampling, seed, logprobs), timeout_s
        )
        return parse_completion(payload, raw, sampling, vocab, f"rollout server {self.base_url} (model {model})")

    def close(self) -> None:
        self.http.close()
