"""A client of vLLM's OpenAI-compatible server (`vllm serve ... --enable-lora`, runtime LoRA updating
on), and of `dagster-rl serve`, which speaks the same subset:

    GET  /v1/models                 the base model and the loaded adapters (id, root = path, parent)
    POST /v1/completions            a token-id prompt, `seed`, `logprobs: 0` and
                                    `return_tokens_as_token_ids: true`: the completion comes back as
                                    "token_id:<id>" strings with the sampled token's log-probability
    POST /v1/load_lora_adapter      {lora_name, lora_path}: 200 and a text body, or an error object
    POST /v1/unload_lora_adapter    {lora_name}
    GET  /health                    200 once the server can serve (at the server's root, not /v1)
"""

import json
import re
from dataclasses import dataclass
from typing import Any

from dagster_rl.errors import DagsterRLError
from dagster_rl.http_json import EndpointError, request

TOKEN_ID = re.compile(r"^token_id:(-?\d+)$")


class ServerReplyError(DagsterRLError):
    """The server answered something that is not what its API promises."""


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # of each sampled token
    finish_reason: str
    text: str


@dataclass(frozen=True)
class VLLMClient:
    base_url: str  # e.g. http://127.0.0.1:8000/v1
    api_key: str | None = None
    timeout_s: float = 60.0

    @property
    def root(self) -> str:
        """The server's root (where /health is): base_url without its trailing /v1."""
        url = self.base_url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url

    def _call(self, method: str, path: str, body: Any | None = None, timeout_s: float | None = None) -> bytes:
        url = self.base_url.rstrip("/") + path
        return request(method, url, body, api_key=self.api_key, timeout_s=timeout_s or self.timeout_s, who="rollout server")

    def healthy(self, timeout_s: float = 2.0) -> bool:
        try:
            request("GET", self.root + "/health", None, api_key=self.api_key, timeout_s=timeout_s, who="rollout server")
            return True
        except EndpointError:
            return False

    def models(self) -> list[dict[str, Any]]:
        raw = self._call("GET", "/models")
        try:
            data = json.loads(raw)["data"]
            return [dict(card) for card in data]
        except (ValueError, KeyError, TypeError):
            raise ServerReplyError(f"rollout server {self.base_url}/models answered no model list: {raw[:300]!r}") from None

    def load_adapter(self, name: str, path: str) -> None:
        self._call("POST", "/load_lora_adapter", {"lora_name": name, "lora_path": path})

    def unload_adapter(self, name: str) -> None:
        self._call("POST", "/unload_lora_adapter", {"lora_name": name})

    def complete_tokens(
        self, model: str, prompt_ids: list[int], *, max_tokens: int, temperature: float, top_p: float, seed: int, timeout_s: float | None = None
    ) -> Completion:
        """One completion of a token-id prompt, sampled with `seed`, as token ids and their log-probabilities."""
        body = {
            "model": model,
            "prompt": list(prompt_ids),
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "seed": seed,
            "n": 1,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        }
        raw = self._call("POST", "/completions", body, timeout_s)
        try:
            choice = json.loads(raw)["choices"][0]
            lp = choice["logprobs"]
            tokens, logprobs = lp["tokens"], lp["token_logprobs"]
            finish, text = str(choice["finish_reason"]), str(choice.get("text") or "")
        except (ValueError, KeyError, IndexError, TypeError):
            raise ServerReplyError(f"rollout server answered a completion without logprobs: {raw[:300]!r}") from None
        ids = []
        for t in tokens:
            m = TOKEN_ID.match(str(t))
            if not m:
                raise ServerReplyError(
                    f"rollout server returned the token {t!r}, not 'token_id:<id>': it ignores return_tokens_as_token_ids "
                    "per request (an older vLLM: start it with --return-tokens-as-token-ids)"
                )
            ids.append(int(m.group(1)))
        if len(ids) != len(logprobs) or any(v is None for v in logprobs):
            raise ServerReplyError(f"rollout server returned {len(ids)} tokens with log-probabilities {logprobs!r}")
        return Completion(ids, [float(v) for v in logprobs], finish, text)
