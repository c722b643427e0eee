"""The judge environment's `openai` backend: an LLM over an OpenAI-compatible chat endpoint, every
call journaled.

`LLMJudge.judge(exp, trajectory)` has the shape of `RubricJudge.judge`: the task's deterministic
verifier decides whether the answer is right, and the LLM grades the trajectory against the rubric
with a score in [0, 1], scaled by the rubric's weights. The task says how, in its `grading`
(`dagster_rl.core.task.LLMGrading`): the prompt, and the reward for a grade. The call is
`POST {base_url}/chat/completions` with `model` and `messages`; the reply must be text holding one
score, `SCORE: <number in [0, 1]>` (or a JSON object with a numeric "score" field). A reply that is
not a chat completion, holds no score or two different ones, or a score outside [0, 1] (NaN and
infinities included) fails the attempt, names the endpoint, and is never journaled: the attempt is
retried, and a judgement that fails every attempt skips its trial.

Each call waits at most `min(request_timeout_s, timeout_s)`, so a judgement that gets no answer
fails after (max_retries + 1) such waits, and its error says so. When every attempt of a judgement
got no answer at all (a timeout, a refused connection), the endpoint is taken as down for that long
again (`_Outage`): judgements asked meanwhile fail at once, naming it, instead of each waiting out
its own timeouts. A step whose judge never answers thus fails after one judgement's worst case
(3 x 30 s with the judge environment's defaults), not after one per wave of `max_concurrency`.

Each attempt first asks the journal (dagster_rl.judges.journal) for its request (the question:
model, messages, sampling settings): a judgement already paid for is replayed. Seeded fault injection (`judge_flake_rate`) fires
*after* the journaled call, which is the failure the journal exists for.
"""

import json
import math
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dagster_rl.base import counters
from dagster_rl.base.errors import DagsterRLError
from dagster_rl.base.faults import maybe_fail
from dagster_rl.base.hashing import content_hash
from dagster_rl.base.retries import AttemptsExhausted, Limits, with_retries
from dagster_rl.core.task import LLMGrading
from dagster_rl.inference.http_json import EndpointError, JSONEndpoint
from dagster_rl.judges.journal import JudgeCall, JudgeJournal, trajectory_hash

_SCORE = re.compile(r"score\s*[:=]\s*([-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)", re.IGNORECASE)


class LLMJudgeError(DagsterRLError):
    """The judge endpoint could not be reached, answered with an error, or its reply had no score."""


class JudgeNoAnswer(LLMJudgeError):
    """The judge endpoint gave no answer at all: it did not answer in time, or refused the connection."""


def rubric_hash(rubric: Any, prompt_version: str) -> str:
    """What the judge is asked, as a hash: the rubric and the prompt's version."""
    return content_hash({"rubric": rubric, "prompt": prompt_version})


def parse_score(reply: Any, who: str = "the judge") -> float:
    """The score in a reply: `SCORE: x` (every such line agreeing) or a JSON object {"score": x};
    must be a finite number in [0, 1]. `who` names the endpoint in errors."""
    if not isinstance(reply, str):
        raise LLMJudgeError(f"{who} answered a message whose content is not text: {str(reply)[:300]!r}")
    found = list(dict.fromkeys(float(m.group(1)) for m in _SCORE.finditer(reply)))
    if len(found) > 1:
        raise LLMJudgeError(
            f"{who} answered {len(found)} different scores ({', '.join(map(str, found[:5]))}), not one: {reply[:300]!r}"
        )
    value: Any = found[0] if found else None
    if value is None:
        try:
            parsed = json.loads(reply)
            value = parsed.get("score") if isinstance(parsed, dict) else None
        except ValueError:
            value = None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise LLMJudgeError(f"{who} answered no score (expected 'SCORE: <0..1>'): {reply[:300]!r}")
    if not math.isfinite(value) or not 0.0 <= float(value) <= 1.0:
        raise LLMJudgeError(f"{who} answered the score {value}, outside [0, 1]: {reply[:300]!r}")
    return float(value)


class OpenAIChatClient:
    """POST {base_url}/chat/completions; base_url is e.g. http://127.0.0.1:8000/v1. One pooled HTTP
    client: the judge's concurrent calls share its connections."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 30.0):
        self.base_url, self.timeout_s = base_url, timeout_s
        self.http = JSONEndpoint(base_url, api_key, timeout_s, "judge endpoint")

    @property
    def url(self) -> str:
        return self.http.url("/chat/completions")

    def complete(self, body: dict[str, Any], timeout_s: float | None = None) -> str:
        """The reply's message content, as text; `JudgeNoAnswer` when no answer came."""
        try:
            payload, raw = self.http.call_json("POST", "/chat/completions", body, timeout_s)
        except EndpointError as e:
            raise (JudgeNoAnswer if e.status is None else LLMJudgeError)(str(e)) from None
        try:
            content = payload["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            content = None
        if not isinstance(content, str):
            raise LLMJudgeError(
                f"judge endpoint {self.url} answered something that is not a chat completion with text: {raw[:300]!r}"
            )
        return content


@dataclass
class _Outage:
    """The judge endpoint answered none of a judgement's attempts: judgements asked before `until`
    fail at once, with `reason`, instead of each waiting out its own timeouts and retries."""

    until: float = 0.0
    reason: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def current(self) -> str:
        with self.lock:
            return self.reason if time.monotonic() < self.until else ""

    def start(self, for_s: float, reason: str) -> None:
        with self.lock:
            self.until, self.reason = time.monotonic() + for_s, reason


@dataclass(frozen=True)
class LLMJudge:
    """A judge backend (the interface of RubricJudge) over an OpenAI-compatible endpoint."""

    client: OpenAIChatClient
    model: str
    journal: JudgeJournal
    grading: LLMGrading
    limits: Limits = Limits()
    temperature: float = 0.0
    max_tokens: int = 16
    # Called with each fresh (not replayed) journaled call, before fault injection; tests use it to
    # crash the caller right after the judge answered.
    after_call: Callable[[JudgeCall], None] | None = field(default=None, compare=False)
    _outage: _Outage = field(default_factory=_Outage, compare=False, repr=False)

    @property
    def cache_version(self) -> str:
        """Part of the rewards' cache key: another prompt or judge model scores differently."""
        return f"llm-judge/{self.grading.prompt_version}/{self.model}"

    @property
    def call_timeout_s(self) -> float:
        """How long one call waits for its answer: the endpoint's request timeout, within the attempt's."""
        return min(self.client.timeout_s, self.limits.timeout_s)

    def request(self, exp: Any, traj: Any) -> dict[str, Any]:
        """The body of the request that grades `traj`: the question, and the journal's key."""
        return {
            "model": self.model,
            "messages": self.grading.messages(exp, traj),
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }

    def judge(self, exp: Any, traj: Any) -> Any:
        t_hash, r_hash = trajectory_hash(traj), rubric_hash(exp.rubric, self.grading.prompt_version)
        attempts, wait = self.limits.max_retries + 1, self.call_timeout_s
        what = f"judging {traj.trial_id} ({attempts} attempt(s) of at most {wait:g} s: the judge environment's max_retries and request_timeout_s)"
        down = self._outage.current()
        if down:
            raise AttemptsExhausted(what, [JudgeNoAnswer(f"not sent: {down}")])

        def attempt(n: int) -> Any:
            counters.bump("judge_calls")
            body = self.request(exp, traj)

            def ask() -> tuple[str, float]:
                counters.bump("llm_judge_requests")
                reply = self.client.complete(body, wait)
                return reply, parse_score(reply, f"judge endpoint {self.client.url} (model {self.model})")

            call, replayed = self.journal.replay_or_call(t_hash, r_hash, body, ask)
            if replayed:
                counters.bump("judge_journal_replays")
            elif self.after_call is not None:
                self.after_call(call)
            maybe_fail(exp.faults.judge_flake_rate, n, exp.seed, "judge", traj.trial_id)
            return self.grading.reward(exp, traj, call.score)

        try:
            return with_retries(what, attempt, self.limits.max_retries, self.limits.timeout_s)
        except AttemptsExhausted as e:
            if all(isinstance(x, JudgeNoAnswer) for x in e.errors):
                self._outage.start(
                    attempts * wait,
                    f"judge endpoint {self.client.url} answered none of the {attempts} attempt(s) of judging {traj.trial_id} "
                    f"({e.errors[-1]}); it is taken as down for {attempts * wait:g} s",
                )
            raise
