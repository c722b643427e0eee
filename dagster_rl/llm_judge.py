"""The judge environment's `openai` backend: an LLM over an OpenAI-compatible chat endpoint, every
call journaled.

`LLMJudge.judge(exp, trajectory)` has the shape of `RubricJudge.judge`: the task's deterministic
verifier decides whether the answer is right, and the LLM grades the trajectory against the rubric
with a score in [0, 1], scaled by the rubric's weights. The task says how, in its `grading`
(`dagster_rl.task.LLMGrading`): the prompt, and the reward for a grade. The call is
`POST {base_url}/chat/completions` with `model` and `messages`; the reply must contain
`SCORE: <number in [0, 1]>` (or a JSON object with a "score" field).

Each attempt first asks the journal (dagster_rl.judge_journal) for (trajectory hash, rubric hash,
model): a judgement already paid for is replayed. Seeded fault injection (`judge_flake_rate`) fires
*after* the journaled call, which is the failure the journal exists for.
"""

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dagster_rl import counters
from dagster_rl.errors import DagsterRLError
from dagster_rl.faults import maybe_fail
from dagster_rl.hashing import content_hash
from dagster_rl.http_json import EndpointError, JSONEndpoint
from dagster_rl.judge_journal import JudgeCall, JudgeJournal, trajectory_hash
from dagster_rl.retries import Limits, with_retries
from dagster_rl.task import LLMGrading

_SCORE = re.compile(r"score\s*[:=]\s*([-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)", re.IGNORECASE)


class LLMJudgeError(DagsterRLError):
    """The judge endpoint could not be reached, answered with an error, or its reply had no score."""


def rubric_hash(rubric: Any, prompt_version: str) -> str:
    """What the judge is asked, as a hash: the rubric and the prompt's version."""
    return content_hash({"rubric": rubric, "prompt": prompt_version})


def parse_score(reply: str) -> float:
    """The score in a reply: `SCORE: x` or a JSON object {"score": x}; must lie in [0, 1]."""
    match = _SCORE.search(reply)
    value: Any = float(match.group(1)) if match else None
    if value is None:
        try:
            parsed = json.loads(reply)
            value = parsed.get("score") if isinstance(parsed, dict) else None
        except ValueError:
            value = None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise LLMJudgeError(f"the judge's reply has no score (expected 'SCORE: <0..1>'): {reply[:300]!r}")
    if not 0.0 <= float(value) <= 1.0:
        raise LLMJudgeError(f"the judge's score {value} is outside [0, 1]: {reply[:300]!r}")
    return float(value)


class OpenAIChatClient:
    """POST {base_url}/chat/completions; base_url is e.g. http://127.0.0.1:8000/v1. One pooled HTTP
    client: the judge's concurrent calls share its connections."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 30.0):
        self.base_url, self.timeout_s = base_url, timeout_s
        self.http = JSONEndpoint(base_url, api_key, timeout_s, "judge endpoint")

    def complete(self, body: dict[str, Any]) -> str:
        try:
            payload, raw = self.http.call_json("POST", "/chat/completions", body)
        except EndpointError as e:
            raise LLMJudgeError(str(e)) from None
        try:
            return payload["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise LLMJudgeError(
                f"judge endpoint {self.http.url('/chat/completions')} answered something that is not a chat completion: {raw[:300]!r}"
            ) from None


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

    @property
    def cache_version(self) -> str:
        """Part of the rewards' cache key: another prompt or judge model scores differently."""
        return f"llm-judge/{self.grading.prompt_version}/{self.model}"

    def judge(self, exp: Any, traj: Any) -> Any:
        t_hash, r_hash = trajectory_hash(traj), rubric_hash(exp.rubric, self.grading.prompt_version)

        def ask() -> tuple[dict[str, Any], str, float]:
            body = {
                "model": self.model,
                "messages": self.grading.messages(exp, traj),
                "temperature": self.temperature,
                "max_tokens": self.max_tokens,
            }
            counters.bump("llm_judge_requests")
            reply = self.client.complete(body)
            return body, reply, parse_score(reply)

        def attempt(n: int) -> Any:
            counters.bump("judge_calls")
            call, replayed = self.journal.replay_or_call(t_hash, r_hash, self.model, ask)
            if replayed:
                counters.bump("judge_journal_replays")
            elif self.after_call is not None:
                self.after_call(call)
            maybe_fail(exp.faults.judge_flake_rate, n, exp.seed, "judge", traj.trial_id)
            return self.grading.reward(exp, traj, call.score)

        return with_retries(f"judging {traj.trial_id}", attempt, self.limits.max_retries, self.limits.timeout_s)
