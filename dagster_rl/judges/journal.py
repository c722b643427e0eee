"""A journal of LLM-judge calls, so a retried judging task never pays for the same judgement twice.

An entry is keyed by the request itself (the judge model, the messages, the sampling settings: the
question, whatever of the experiment and the trajectory the task's prompt shows) and the content
hash of the trajectory it grades (one call per trial, as two trials that look alike to the judge
are still two judgements), and stored in the artifact store as soon as the judge's reply arrives,
before anything else can fail. A judging attempt asks the journal first: an entry found is
replayed (the same reply, the same score) and no request is sent. Another question (another
rubric, judge model, prompt, or anything the prompt shows) is another key, hence a new call.

What is journaled is bounded: a reply longer than `MAX_REPLY_CHARS` is stored cut to its first
`MAX_REPLY_CHARS` characters, with its full length and sha256 (the score is parsed from the whole
reply before it is cut), so a judge that answers megabytes cannot fill the store.

The one window left open is between the judge's reply and the journal write (a crash there loses
the reply, and the retry calls again); everything after the write replays.
"""

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from dagster_rl.base.errors import CorruptArtifactError
from dagster_rl.base.hashing import cache_key, content_hash, sha256_hex
from dagster_rl.store.artifact_store import ArtifactStore

KIND = "judge_calls"
JOURNAL_VERSION = "judge-journal-2"  # 2: keyed by the request and the trajectory, not by the trajectory, rubric and model
MAX_REPLY_CHARS = 4096


class JudgeCall(BaseModel):
    """One judge call as it happened: what was asked, what came back, the score parsed from it."""

    trajectory_hash: str
    rubric_hash: str
    model: str
    request: dict[str, Any]  # the request body sent (model, messages, sampling settings)
    reply: str  # the judge's message content, cut to MAX_REPLY_CHARS
    score: float = Field(ge=0.0, le=1.0, allow_inf_nan=False)  # what parse_score read from the whole reply
    recorded_at: str
    reply_chars: int | None = None  # the whole reply's length and sha256, when it was cut
    reply_sha256: str | None = None


def bounded_reply(reply: str) -> dict[str, Any]:
    """The journal's fields for a reply: itself, or its first MAX_REPLY_CHARS characters, its length and hash."""
    if len(reply) <= MAX_REPLY_CHARS:
        return {"reply": reply}
    return {"reply": reply[:MAX_REPLY_CHARS], "reply_chars": len(reply), "reply_sha256": sha256_hex(reply.encode())}


def journal_key(request: dict[str, Any], trajectory_hash: str) -> str:
    """The key of the entry of a request (the body sent: model, messages, sampling settings) about a trajectory."""
    return cache_key("judge_call", JOURNAL_VERSION, request=request, trajectory=trajectory_hash)


def trajectory_hash(trajectory: BaseModel | dict[str, Any]) -> str:
    return content_hash(trajectory)


class JudgeJournal:
    """Judge calls in an ArtifactStore under kind `judge_calls`; the first entry written for a key wins."""

    def __init__(self, store: ArtifactStore):
        self.store = store

    def lookup(self, request: dict[str, Any], trajectory_hash: str) -> JudgeCall | None:
        key = journal_key(request, trajectory_hash)
        if not self.store.exists(KIND, key):
            return None
        try:
            return self.store.get_model(KIND, key, JudgeCall)
        except ValidationError as e:  # an entry no judge call could have written (a score outside [0, 1]): never replayed
            raise CorruptArtifactError(
                f"artifact {KIND}/{key} is not a judge call ({e.error_count()} invalid field(s): {e.errors()[0]['loc']} "
                f"{e.errors()[0]['msg']}). {self.store.move_aside(KIND, key, reason='invalid') if self.store.quarantine else ''} "
                "The next attempt of the judgement asks the judge again."
            ) from None

    def record(self, call: JudgeCall) -> JudgeCall:
        """Store `call` unless an entry for its key exists; return the entry that is stored (a
        concurrent attempt that recorded its reply first wins, so every reader agrees: the store
        adopts the first `judge_calls` entry of a key)."""
        key = journal_key(call.request, call.trajectory_hash)
        self.store.put_model(KIND, key, call)
        return self.store.get_model(KIND, key, JudgeCall)

    def replay_or_call(
        self,
        trajectory_hash: str,
        rubric_hash: str,
        request: dict[str, Any],
        call: Callable[[], tuple[str, float]],
    ) -> tuple[JudgeCall, bool]:
        """The journaled entry of `request` (replayed=True), or call() -> (reply, score), recorded (replayed=False)."""
        found = self.lookup(request, trajectory_hash)
        if found is not None:
            return found, True
        reply, score = call()
        entry = JudgeCall(
            trajectory_hash=trajectory_hash,
            rubric_hash=rubric_hash,
            model=str(request.get("model", "")),
            request=request,
            **bounded_reply(reply),
            score=score,
            recorded_at=datetime.now(UTC).isoformat(),
        )
        return self.record(entry), False
