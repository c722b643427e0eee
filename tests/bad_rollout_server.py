"""A rollout server that answers wrongly: a proxy on 127.0.0.1 in front of a real one (`dagster-rl
serve`) that forwards every request and passes each /v1/completions answer through `corrupt`.

    with CorruptingProxy(server.base_url, corrupt=extra_tokens) as bad:
        RolloutEnvironment(base_url=bad.base_url, ...)
        bad.seen                        # trials' completion requests forwarded (logprobs 0), by seed
        bad.corrupted                   # their answers changed, by seed

`corrupt(body, answer)` gets the request body and the real server's answer (parsed JSON) and returns
the answer to send (the same object changed, another one, or `None` to send it unchanged); it is
called for the trials' requests (`logprobs: 0`), not for the backend's probe of the server's
logprobs mode (`logprobs: 1`), which a bad answer would fail before any trial. Every
other route (health, models, adapters) passes through unchanged, so the backend serves and checks
its adapters on the real server; only the completions it is sent are wrong.
"""

import json
import threading
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

Corrupt = Callable[[dict[str, Any], dict[str, Any]], dict[str, Any] | None]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024


class CorruptingProxy:
    def __init__(self, upstream: str, corrupt: Corrupt):
        self.upstream, self.corrupt = upstream.rstrip("/"), corrupt
        self.root = self.upstream[: -len("/v1")] if self.upstream.endswith("/v1") else self.upstream
        self.seen: Counter[int] = Counter()
        self.corrupted: Counter[int] = Counter()
        self._lock = threading.Lock()
        self._http = httpx.Client(timeout=120, trust_env=False, limits=httpx.Limits(max_connections=64, keepalive_expiry=2.0))
        self._server = _Server(("127.0.0.1", 0), self._handler())
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/v1"

    def __enter__(self) -> "CorruptingProxy":
        self._thread = threading.Thread(target=self._server.serve_forever, name="corrupting-proxy", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._http.close()

    def _forward(self, method: str, path: str, raw: bytes) -> tuple[int, bytes, str]:
        response = self._http.request(method, self.root + path, content=raw or None, headers={"Content-Type": "application/json"})
        if method == "POST" and path.startswith("/v1/completions") and response.status_code == 200:
            body = json.loads(raw)
            answer = response.json()
            changed = self.corrupt(body, answer) if body.get("logprobs") == 0 else None
            if body.get("logprobs") == 0:  # a trial's (the backend's logprobs-mode probe asks logprobs 1)
                with self._lock:
                    self.seen[body.get("seed")] += 1
                    if changed is not None:
                        self.corrupted[body.get("seed")] += 1
            if changed is not None:
                # as a server would send them: Python's json writes NaN and Infinity bare, as vLLM's would
                return 200, json.dumps(changed).encode(), "application/json"
        return response.status_code, response.content, response.headers.get("content-type", "application/json")

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _relay(self, method: str) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, data, kind = proxy._forward(method, self.path, raw)
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # http.server's naming
                self._relay("GET")

            def do_POST(self) -> None:
                self._relay("POST")

            def log_message(self, *args: Any) -> None:
                pass

        return Handler


def logprobs_of(answer: dict[str, Any]) -> dict[str, Any]:
    return answer["choices"][0]["logprobs"]
