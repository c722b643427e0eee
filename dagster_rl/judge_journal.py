"""A journal of LLM-judge calls, so a retried judging task never pays for the same judgement twice.

An entry is keyed by (trajectory content hash, rubric hash, judge model) and stored in the artifact
store as soon as the judge's reply arrives, before anything else can fail. A judging attempt asks
the journal first: an entry found is replayed (the same reply, the same score) and no request is
sent. A different rubric or judge model is a different key, hence a new call.

The one window left open is between the judge's reply and the journal write (a crash there loses
the reply, and the retry calls again); everything after the write replays.
"""

from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from pydantic import BaseModel

from dagster_rl.errors import ArtifactConflictError
from dagster_rl.hashing import cache_key, content_hash
from dagster_rl.store import ArtifactStore

KIND = "judge_calls"
JOURNAL_VERSION = "judge-journal-1"


class JudgeCall(BaseModel):
    """One judge call as it happened: what was asked, what came back, the score parsed from it."""

    trajectory_hash: str
    rubric_hash: str
    model: str
    request: dict[str, Any]  # the request body sent (model, messages, sampling settings)
    reply: str  # the judge's message content
    score: float
    recorded_at: str


def journal_key(trajectory_hash: str, rubric_hash: str, model: str) -> str:
    return cache_key("judge_call", JOURNAL_VERSION, trajectory=trajectory_hash, rubric=rubric_hash, model=model)


def trajectory_hash(trajectory: BaseModel | dict[str, Any]) -> str:
    return content_hash(trajectory)


class JudgeJournal:
    """Judge calls in an ArtifactStore under kind `judge_calls`; the first entry written for a key wins."""

    def __init__(self, store: ArtifactStore):
        self.store = store

    def lookup(self, trajectory_hash: str, rubric_hash: str, model: str) -> JudgeCall | None:
        key = journal_key(trajectory_hash, rubric_hash, model)
        if not self.store.exists(KIND, key):
            return None
        return self.store.get_model(KIND, key, JudgeCall)

    def record(self, call: JudgeCall) -> JudgeCall:
        """Store `call` unless an entry for its key exists; return the entry that is stored."""
        key = journal_key(call.trajectory_hash, call.rubric_hash, call.model)
        try:
            self.store.put_model(KIND, key, call)
        except ArtifactConflictError:
            pass  # a concurrent attempt recorded its reply first: keep that one, so every reader agrees
        return self.store.get_model(KIND, key, JudgeCall)

    def replay_or_call(
        self,
        trajectory_hash: str,
        rubric_hash: str,
        model: str,
        call: Callable[[], tuple[dict[str, Any], str, float]],
    ) -> tuple[JudgeCall, bool]:
        """The journaled entry (replayed=True), or call() -> (request, reply, score), recorded (replayed=False)."""
        found = self.lookup(trajectory_hash, rubric_hash, model)
        if found is not None:
            return found, True
        request, reply, score = call()
        entry = JudgeCall(
            trajectory_hash=trajectory_hash,
            rubric_hash=rubric_hash,
            model=model,
            request=request,
            reply=reply,
            score=score,
            recorded_at=datetime.now(timezone.utc).isoformat(),
        )
        return self.record(entry), False
