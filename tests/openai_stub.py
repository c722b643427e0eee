"""A small OpenAI-compatible chat completions server on 127.0.0.1, for tests of the LLM judge.

    with OpenAIStub() as stub:           # serves http://127.0.0.1:<port>/v1/chat/completions
        client = OpenAIChatClient(stub.base_url)
        ...
        stub.count                       # chat completion requests answered
        stub.calls                       # their request bodies

It scores by a rule (default `rule_score`: a verified-looking answer found in few turns without
leftover files scores high) and answers `SCORE: <x>`. Failure modes, for the judge's error paths:
`fail_next(n, status)` answers the next n requests with an HTTP error, `delay_s` delays answers,
`reply_text` replaces the reply, `content` the message content with any JSON value (null included);
`received` counts requests as they arrive (answered or not), `received_at` their arrival times
(`time.monotonic()`). `crash_after_answer(n)` arms `after_answer`, a hook for the caller
(LLMJudge.after_call): the next n callers whose request was answered raise `CrashAfterJudgeCall`
right after the answer arrived, as a judging task that dies after paying for its judge call.
"""

import json
import re
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_TRAJECTORY = re.compile(r"Trajectory \(JSON\):\n(\{.*\})", re.DOTALL)
_UNSET = object()

STUB_MODEL = "stub-judge-1"  # the model name the tests' judges ask the stub for


def judge_on(stub: "OpenAIStub", model: str = STUB_MODEL, **settings: Any) -> Callable[[Any], Any]:
    """A lab's `judge` resource on the stub: a function of the lab's artifact store resource, as
    `open_lab` takes it, giving a `JudgeEnvironment(backend="openai")` with `settings`."""
    from resources import JudgeEnvironment

    return lambda store: JudgeEnvironment(artifact_store=store, backend="openai", base_url=stub.base_url, model=model, **settings)


class CrashAfterJudgeCall(RuntimeError):
    """Raised in the caller after the stub answered (armed by crash_after_answer)."""


def rule_score(body: dict[str, Any]) -> float:
    """Score the trajectory in the last user message: answered in few turns, tidy -> close to 1."""
    text = body["messages"][-1]["content"]
    match = _TRAJECTORY.search(text)
    if not match:
        return 0.5
    traj = json.loads(match.group(1))
    if traj.get("answer") is None:
        return 0.0
    tidy = 0.0 if traj.get("files_left") else 0.2
    return round(min(1.0, 0.8 / max(1, int(traj.get("turns", 1))) + tidy), 4)


class OpenAIStub:
    def __init__(self, rule: Callable[[dict[str, Any]], float] = rule_score, delay_s: float = 0.0):
        self.rule = rule
        self.delay_s = delay_s
        self.reply_text: str | None = None
        self.content: Any = _UNSET
        self.received = 0
        self.received_at: list[float] = []
        self.calls: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._fail_next: list[int] = []
        self._crashes_armed = 0
        self.crashes = 0
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    # ---- control ---------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/v1"

    @property
    def count(self) -> int:
        with self._lock:
            return len(self.calls)

    def fail_next(self, n: int = 1, status: int = 500) -> None:
        with self._lock:
            self._fail_next += [status] * n

    def crash_after_answer(self, n: int = 1) -> None:
        with self._lock:
            self._crashes_armed += n

    def after_answer(self, _call: Any = None) -> None:
        """Hook for the caller, run after a fresh answer: raises while crashes are armed."""
        with self._lock:
            if self._crashes_armed <= 0:
                return
            self._crashes_armed -= 1
            self.crashes += 1
        raise CrashAfterJudgeCall("simulated crash of the judging task after the judge answered")

    def start(self) -> "OpenAIStub":
        self._thread = threading.Thread(target=self._server.serve_forever, name="openai-stub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread:
            self._thread.join(5)

    def __enter__(self) -> "OpenAIStub":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ---- serving ---------------------------------------------------------------------------

    def _answer(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if path.rstrip("/") not in ("/v1/chat/completions", "/chat/completions"):
            return 404, {"error": {"message": f"no route {path}", "type": "invalid_request_error"}}
        if not isinstance(body.get("model"), str) or not isinstance(body.get("messages"), list):
            return 400, {"error": {"message": "model and messages are required", "type": "invalid_request_error"}}
        with self._lock:
            self.received += 1
            self.received_at.append(time.monotonic())
            status = self._fail_next.pop(0) if self._fail_next else None
        if status is not None:
            return status, {"error": {"message": "injected failure", "type": "server_error"}}
        if self.delay_s:
            time.sleep(self.delay_s)
        score = self.rule(body)
        content = self.reply_text if self.reply_text is not None else f"SCORE: {score}"
        if self.content is not _UNSET:
            content = self.content
        with self._lock:
            self.calls.append(body)
            n = len(self.calls)
        return 200, {
            "id": f"chatcmpl-stub-{n}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
        }

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # http.server's naming
                length = int(self.headers.get("Content-Length") or 0)
                try:
                    body = json.loads(self.rfile.read(length) or b"{}")
                except ValueError:
                    status, payload = 400, {"error": {"message": "body is not JSON", "type": "invalid_request_error"}}
                else:
                    status, payload = stub._answer(self.path, body)
                data = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the caller gave up (timeout)

            def log_message(self, *args: Any) -> None:
                pass

        return Handler
