"""What every task's loop shares when it computes a step: trials stored one by one, judging, keys.

A step's rollouts and rewards are *trial sets*: one outcome per planned trial. `trial_set` stores
them so that a failure is never cached as a result: a set in which every trial succeeded is stored
under its key (what a clean computation uses, and finds again as a cache hit); a set with failed
trials is stored as a partial artifact of that key, which the step goes on with (its content
differs, so its downstream keys differ too) and which a re-run resumes: it attempts only the
trials that failed. When they now succeed the set is complete, its content is the clean one, and
everything downstream of it is computed again.
"""

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from dagster_rl.base.errors import CorruptArtifactError
from dagster_rl.base.hashing import cache_key, canonical_json
from dagster_rl.base.retries import AttemptsExhausted
from dagster_rl.core.checks import require_enough_trials
from dagster_rl.core.records import Rewards, Rollouts, TrialFailed
from dagster_rl.core.task import JudgeBackend, Warn
from dagster_rl.store.artifact_store import DATA, ArtifactRef, ArtifactStore

X = TypeVar("X")
V = TypeVar("V", bound=Rollouts | Rewards)  # a trial set
RW = TypeVar("RW", bound=Rewards)  # a task's rewards record
Outcome = Any  # a task's trajectory or reward (it has a `trial_id`), or a TrialFailed


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def by_trial(items: Iterable[X]) -> list[X]:
    """Canonical order: completion order differs between attempts; sorted inputs hash the same."""
    return sorted(items, key=lambda x: x.trial_id)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Stored(Generic[V]):
    """A step's trial set as `trial_set` found or made it."""

    value: V
    ref: ArtifactRef
    hit: bool  # found complete under its key: nothing run
    attempted: list[str] = field(default_factory=list)  # trials run now
    failed: list[str] = field(default_factory=list)  # trials that failed now, after their retries
    recovered: list[str] = field(default_factory=list)  # trials an earlier attempt failed that succeeded now
    errors: dict[str, str] = field(default_factory=dict)  # trial id -> why it failed now (its last attempt's error)

    @property
    def cache(self) -> str:
        return "hit" if self.hit else "miss"


def trial_set(
    store: ArtifactStore,
    kind: str,
    key: str,
    record: type[V],
    planned: Sequence[str],
    run: Callable[[list[str]], list[Outcome]],
    make: Callable[[list[Any], list[str]], V],
    warn: Warn,
) -> Stored[V]:
    """The trial set stored under (kind, key), or made now, trial by trial.

    `run(trial_ids)` runs those trials (only the ones no earlier attempt of this set stored) and
    returns one outcome per trial; `make(results, failed_ids)` builds the record from the results,
    sorted by trial id, old and new. Complete: stored under `key`. Not: stored as a partial of `key`.
    """
    if store.exists(kind, key):
        try:
            return Stored(store.get_model(kind, key, record), store.ref(kind, key), hit=True)
        except CorruptArtifactError as e:
            warn(f"{e} Computing it again now.")
    before = _latest_partial(store, kind, key, record, warn)
    done = {o.trial_id: o for o in before.outcomes()} if before is not None else {}
    pending = [t for t in planned if t not in done]
    outcomes = run(pending) if pending else []
    failed = sorted(o.trial_id for o in outcomes if isinstance(o, TrialFailed))
    for o in outcomes:
        if isinstance(o, TrialFailed):
            warn(f"trial {o.trial_id} failed after its retries, skipped (a re-run of the step attempts it again): {o.error}")
    results = [o for o in outcomes if not isinstance(o, TrialFailed)]
    value = make(by_trial([*done.values(), *results]), failed)
    recovered = sorted(o.trial_id for o in results) if before is not None else []
    if failed:
        ref = store.put_partial(kind, key, {DATA: canonical_json(value)}, failed)
    else:
        value, ref, _ = store.get_or_put(kind, key, record, lambda: value)
    errors = {o.trial_id: o.error for o in outcomes if isinstance(o, TrialFailed)}
    return Stored(value, ref, hit=False, attempted=pending, failed=failed, recovered=recovered, errors=errors)


def _latest_partial(store: ArtifactStore, kind: str, key: str, record: type[V], warn: Warn) -> V | None:
    partial = store.partial(kind, key)
    if partial is None:
        return None
    try:
        return store.get_model(kind, partial, record)
    except CorruptArtifactError as e:
        warn(f"{e} Its trials are run again.")
        return None


def judge_all(
    exp: Any,
    trajectories: list,
    judge: JudgeBackend,
    done: Callable[[int], None] = lambda n: None,
    clock: "JudgeClock | None" = None,
) -> list[Outcome]:
    """Judge every trajectory concurrently, `judge.limits.max_concurrency` at a time: one outcome
    each, its reward or a TrialFailed when its judging still failed after its retries. `done(1)`
    is called as each judgement ends (progress); `clock` records when each ran."""
    clock = clock or JudgeClock()
    with ThreadPoolExecutor(judge.limits.max_concurrency, "judge") as pool:
        return collect_judgements({pool.submit(clock.judge, judge, exp, t): t.trial_id for t in trajectories}, done)


def collect_judgements(judging: dict[Future, str], done: Callable[[int], None] = lambda n: None) -> list[Outcome]:
    """The outcomes of judgements (future -> trial id) as they finish."""
    outcomes = []
    for fut in as_completed(judging):
        try:
            outcomes.append(fut.result())
        except AttemptsExhausted as e:
            outcomes.append(TrialFailed(trial_id=judging[fut], error=f"judging failed after its retries: {e}"))
        done(1)
    return outcomes


Span = tuple[float, float]  # (start, end), time.monotonic() seconds


@dataclass
class JudgeClock:
    """When a step's judgements ran, beside when its trials generated: `judge_s`, the wall time
    during which at least one judgement ran, and `hidden_s`, the part of it spent while the trials
    still generated (hidden behind generation, off the step's critical path)."""

    judging: list[Span] = field(default_factory=list)
    generating: list[Span] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def judge(self, judge: JudgeBackend, exp: Any, trajectory: Any) -> Any:
        """`judge.judge(exp, trajectory)`, timed."""
        t0 = time.monotonic()
        try:
            return judge.judge(exp, trajectory)
        finally:
            with self._lock:
                self.judging.append((t0, time.monotonic()))

    @property
    def judge_s(self) -> float:
        return sum(b - a for a, b in _union(self.judging))

    @property
    def hidden_s(self) -> float:
        generating = _union(self.generating)
        return sum(max(0.0, min(b, d) - max(a, c)) for a, b in _union(self.judging) for c, d in generating)


def _union(spans: list[Span]) -> list[Span]:
    """Overlapping spans merged: disjoint, in order."""
    merged: list[Span] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


class Judged:
    """Judgements made while generating, reused for the rewards when their trajectory is the one
    stored (a rollouts artifact adopted from another writer may hold other trajectories); `clock`:
    when the step's judgements ran, those made for the rewards after generating included."""

    def __init__(self) -> None:
        self._by_trial: dict[str, tuple[Any, Outcome]] = {}
        self.clock = JudgeClock()

    def add(self, trajectory: Any, outcome: Outcome) -> None:
        self._by_trial[trajectory.trial_id] = (trajectory, outcome)

    def judge(
        self, exp: Any, trajectories: list, judge: JudgeBackend, done: Callable[[int], None] = lambda n: None
    ) -> list[Outcome]:
        """One outcome per trajectory: the judgement made while generating, else judged now."""
        known = [self._by_trial.get(t.trial_id) for t in trajectories]
        reused = [k[1] for t, k in zip(trajectories, known, strict=True) if k is not None and k[0] == t]
        fresh = [t for t, k in zip(trajectories, known, strict=True) if k is None or k[0] != t]
        return reused + judge_all(exp, fresh, judge, done, self.clock)


Landed = Callable[[Any], None]  # called with each trajectory as it lands


def judge_as_they_land(
    exp: Any,
    judge: JudgeBackend,
    judged: Judged,
    generate: Callable[[Landed], list[Outcome]],
    landed: Landed = lambda t: None,
    generated: Callable[[], None] = lambda: None,
    done: Callable[[int], None] = lambda n: None,
) -> list[Outcome]:
    """`generate(on_done)`'s outcomes, each trajectory judged the moment it lands: `generate` calls
    `on_done(trajectory)` as each one is complete (from any thread), which hands it to the judge at
    once, `judge.limits.max_concurrency` at a time, while the others still generate. Returns when
    every judgement has ended; the judgements (a reward, or a TrialFailed when judging still failed
    after its retries) go into `judged`, their times and generation's into `judged.clock`.
    Progress: `landed(trajectory)` as each lands, `generated()` when generation has ended, `done(1)`
    as each judgement ends."""
    clock, judging, by_trial = judged.clock, dict[Future, str](), dict[str, Any]()
    with ThreadPoolExecutor(judge.limits.max_concurrency, "judge") as pool:

        def on_done(trajectory: Any) -> None:
            by_trial[trajectory.trial_id] = trajectory
            judging[pool.submit(clock.judge, judge, exp, trajectory)] = trajectory.trial_id
            landed(trajectory)

        t0 = time.monotonic()
        try:
            outcomes = generate(on_done)
        finally:
            clock.generating.append((t0, time.monotonic()))
        generated()
        for outcome in collect_judgements(judging, done):
            judged.add(by_trial[outcome.trial_id], outcome)
    return outcomes


def step_rewards(
    store: ArtifactStore,
    exp: Any,
    key: str,
    rollouts: Stored[Rollouts],
    judged: Judged,
    judge: JudgeBackend,
    warn: Warn,
    record: type[RW],
    done: Callable[[int], None] = lambda n: None,
) -> Stored[RW]:
    """A step's rewards: a trial set over the rollouts' trajectories (judged while generating, or
    now), stored under `key`. Fails the step, once what succeeded is stored, when too few trials
    are usable."""
    trajectories = {t.trial_id: t for t in rollouts.value.trajectories}

    def make(rewards: list, failed: list[str]) -> RW:
        return record(
            step=rollouts.value.step,
            rollouts_key=rollouts.ref.key,
            rollouts_hash=rollouts.ref.content_hash,
            rubric=exp.rubric.model_dump(),
            rewards=rewards,
            skipped=sorted(set(rollouts.value.skipped) | set(failed)),
        )

    rewards = trial_set(
        store,
        "rewards",
        key,
        record,
        sorted(trajectories),
        lambda pending: judged.judge(exp, [trajectories[t] for t in pending], judge, done),
        make,
        warn,
    )
    usable, planned = len(rewards.value.rewards), rollouts.value.n_trials_planned
    require_enough_trials(exp, rollouts.value.step, usable, planned, rewards.value.skipped, {**rollouts.errors, **rewards.errors})
    return rewards


def rollouts_key(code_version: str, exp: Any, step: int, behavior: ArtifactRef, **inputs: Any) -> str:
    """The key of a step's rollouts: what every task's trials depend on (the task's settings, the
    experiment seed, the step, the trial counts, the behavior weights: their key, which the rollouts
    record, and their content), and the task's own `inputs`."""
    return cache_key(
        "rollouts",
        code_version,
        task=exp.task,
        seed=exp.seed,
        step=step,
        prompts_per_step=exp.prompts_per_step,
        n_samples=exp.n_samples,
        behavior=_named(behavior),
        **inputs,
    )


def rewards_key(code_version: str, judge: JudgeBackend, rollouts: ArtifactRef, **inputs: Any) -> str:
    """The key of a step's rewards: the rollouts they judge (their key, which the rewards record, and
    their content hash) and the task's own `inputs`. A judge other than the task's own rubric (an LLM
    judge) names itself in it, by its `cache_version` (prompt version and model); the rubric judge adds nothing."""
    extra = {"judge": judge.cache_version} if judge.cache_version else {}
    return cache_key("rewards", code_version, rollouts=_named(rollouts), **inputs, **extra)


def weights_key(code_version: str, exp: Any, previous: ArtifactRef, rewards: ArtifactRef, **inputs: Any) -> str:
    """The key of a step's trained weights: the weights and rewards they are trained from (the keys
    their `TrainedFrom` record names, and their content hashes), the task's own `inputs` (its
    update's settings), and the experiment's cache family, which the weights record too
    (`TrainedFrom.experiment`): the same bytes under the same key, shared by a fork and its parent."""
    return cache_key("weights", code_version, prev=_named(previous), rewards=_named(rewards), experiment=exp.family, **inputs)


def _named(ref: ArtifactRef) -> dict[str, str]:
    """An input artifact as a key holds it: the key an artifact records of it, and its content."""
    return {"key": ref.key, "content_hash": ref.content_hash}


def trained_from(exp: Any, step: int, previous: Any, rewards: ArtifactRef) -> dict[str, Any]:
    """The `TrainedFrom` fields every task's trained weights store: step, experiment (its cache
    family), and the weights (`previous`, a `Weights`) and rewards they were trained from."""
    return {
        "step": step,
        "experiment": exp.family,
        "prev_weights_key": previous.ref.key,
        "prev_weights_hash": previous.ref.content_hash,
        "rewards_key": rewards.key,
        "rewards_hash": rewards.content_hash,
    }


def recovered(*sets: Stored) -> list[str]:
    """Trials that an earlier attempt of the step failed and that succeeded now, in any of its sets."""
    return sorted({t for s in sets for t in s.recovered})
