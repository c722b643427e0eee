"""JSON over HTTP for the endpoints the loop calls (a rollout server, an LLM judge): one pooled
`httpx.Client` per endpoint, shared by the threads that call it (a step's trials, its judgements),
so many requests run at once over kept-alive connections; errors that name the endpoint."""

import json
from typing import Any

import httpx

from dagster_rl.base.errors import DagsterRLError


class EndpointError(DagsterRLError):
    """An HTTP endpoint was unreachable, too slow, or answered an error `status` (None: no answer)."""

    def __init__(self, message: str, status: int | None = None, body: str = ""):
        super().__init__(message)
        self.status, self.body = status, body


class JSONEndpoint:
    """`base_url` and the paths under it (an absolute URL is used as it is), JSON bodies, a Bearer
    key when one is set; `who` names the endpoint in errors. Thread-safe: one connection pool of up
    to `max_connections` for every caller. Close it when done (or use it as a context manager)."""

    def __init__(
        self, base_url: str, api_key: str | None = None, timeout_s: float = 60.0, who: str = "endpoint", max_connections: int = 64
    ):
        self.base_url, self.timeout_s, self.who = base_url.rstrip("/"), timeout_s, who
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # an idle connection is dropped after 2 s, before the server's own keep-alive timeout (uvicorn's, under
        # vLLM: 5 s) closes it under a request sent on it ("Server disconnected without sending a response")
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections, keepalive_expiry=2.0)
        # trust_env off: a proxy from the environment must not sit between the loop and its own servers
        self._client = httpx.Client(headers=headers, timeout=timeout_s, limits=limits, trust_env=False)

    def url(self, path: str) -> str:
        return path if path.startswith(("http://", "https://")) else self.base_url + path

    def call(self, method: str, path: str, body: Any | None = None, timeout_s: float | None = None) -> bytes:
        """The raw answer of `method path` with a JSON `body` (None: no body); `EndpointError` unless 2xx."""
        url, limit = self.url(path), timeout_s or self.timeout_s
        try:
            response = self._client.request(method, url, json=body, timeout=limit)
        except httpx.TimeoutException:
            raise EndpointError(f"{self.who} {url} did not answer within {limit} s") from None
        except httpx.HTTPError as e:  # connection refused or reset, protocol errors
            raise EndpointError(f"{self.who} {url} is unreachable: {e!r}") from None
        if response.status_code >= 400:
            detail = response.content[:500].decode(errors="replace")
            raise EndpointError(f"{self.who} {url} answered HTTP {response.status_code}: {detail}", response.status_code, detail)
        return response.content

    def call_json(self, method: str, path: str, body: Any | None = None, timeout_s: float | None = None) -> tuple[Any, bytes]:
        """(the parsed answer, the raw bytes); a reply that is not JSON parses to None."""
        raw = self.call(method, path, body, timeout_s)
        try:
            return json.loads(raw), raw
        except ValueError:
            return None, raw

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> "JSONEndpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
