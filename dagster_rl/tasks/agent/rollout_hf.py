"""Multi-turn rollouts on `transformers`, batched by turn: every live trial advances one turn together.

Each turn is one call of the single-turn sampler (`dagster_rl.tasks.lm.rollout.sampling.generate_cached`: a
KV-cache decode of a left-padded batch, one seeded generator per row, each sampled token's log-prob
recorded from the logits it was drawn from) over the live trials' sequences, with each trial's seed
for that turn and the per-turn token budget. The batch keeps its KV cache from one turn to the next
(`TurnBatch`), so a turn computes only what the sequences gained since the last one (its last sampled
token, the observation), not their whole length again. A trial that ends leaves the batch (and
its rows of the cache); the others go on.
What a row samples depends on its seed and its logits alone, not on its batch, so a retried trial
replays its turns wherever the logits agree.

The environments then answer the turn's actions all at once, each trial's in its own process
(`agent.episode`): a trial whose environment blocks waits alone until its own time limit, and the
programs the environments run go to the sandbox tier together. A trial whose environment fails (or
that outlives its timeout) becomes a `TrialFailed` and leaves the batch, the others go on.
`on_done(trajectory)` is called as each trajectory ends (the hook where a judge can take it while
the others still generate); `times[trial_id]` receives each trial's sandbox time.
"""

import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from dagster_rl.base import counters
from dagster_rl.base.retries import describe
from dagster_rl.core.records import TrialFailed
from dagster_rl.tasks.agent.episode import Episode, Stage
from dagster_rl.tasks.agent.records import AgentTrajectory, EpisodeRequest
from dagster_rl.tasks.lm.model.policy import Policy
from dagster_rl.tasks.lm.rollout.kv_cache import BatchKV, RowKV
from dagster_rl.tasks.lm.rollout.sampling import Generation, generate_cached
from dagster_rl.tasks.lm.settings import SamplingSettings

Outcome = AgentTrajectory | TrialFailed


@dataclass
class TrialTimes:
    """Where one trial's time went beside generation: its programs in the sandbox (per turn, each
    program's wall time), and its environment's answers (sandbox included)."""

    sandbox_s: float = 0.0
    environment_s: float = 0.0
    calls: list[list[float]] = field(default_factory=list)


def record_times(times: dict[str, TrialTimes] | None, episode: Episode, environment_s: float) -> None:
    if times is not None:
        times[episode.request.trial_id] = TrialTimes(episode.sandbox_seconds, environment_s, episode.call_seconds)


def start_episodes(requests: Sequence[EpisodeRequest], stage: Stage, fail: Callable[[EpisodeRequest, BaseException], None]):
    """An episode per request, made together (each environment's process starts in its own thread)."""

    def start(r: EpisodeRequest) -> Episode | None:
        try:
            return Episode(r, stage)
        except Exception as e:
            fail(r, e)
            return None

    if not requests:
        return []
    with ThreadPoolExecutor(min(len(requests), 64), "episode-start") as pool:
        return [e for e in pool.map(start, requests) if e is not None]


def run_episodes(
    policy: Policy,
    requests: Sequence[EpisodeRequest],
    stage: Stage,
    sampling: SamplingSettings,
    on_done: Callable[[AgentTrajectory], None] | None = None,
    batch_size: int = 256,
    times: dict[str, TrialTimes] | None = None,
) -> list[Outcome]:
    """One outcome per request, in the order of `requests`: its trajectory, or how it failed.
    `sampling.max_new_tokens` is the per-turn token budget; temperature 0 is greedy (evaluation)."""
    outcomes: dict[str, Outcome] = {}
    environment_s: dict[str, float] = {}

    def fail(request: EpisodeRequest, error: BaseException) -> None:
        outcomes[request.trial_id] = TrialFailed(trial_id=request.trial_id, error=f"the environment failed: {describe(error)}")

    live = start_episodes(requests, stage, fail)
    policy.mode(training=False)
    tok = policy.tokenizer

    def answer(episode: Episode, g) -> AgentTrajectory | None:
        """The environment's answer to the trial's action: its trajectory when the episode ended."""
        t0 = time.monotonic()
        try:
            episode.advance(g.completion_ids, g.logprobs, g.finish_reason)
            if not episode.live:
                return episode.trajectory(sampling.temperature, sampling.top_p, policy.version)
        except Exception as e:
            fail(episode.request, e)
            counters.bump("programs_of_failed_trials", episode.programs)  # they run again when the trial is retried
        finally:
            environment_s[episode.request.trial_id] = environment_s.get(episode.request.trial_id, 0.0) + time.monotonic() - t0
        return None

    # batches formed once; each keeps its KV cache from turn to turn, and its finished trials leave it
    batches = [TurnBatch(live[start : start + batch_size]) for start in range(0, len(live), batch_size)]
    try:
        with policy.merged() as model, ThreadPoolExecutor(min(max(len(live), 1), batch_size), "environment") as pool:
            while batches:
                for batch in batches:
                    gens = batch.generate(model, sampling, tok.eos_token_id, tok.pad_token_id)
                    for trajectory in pool.map(answer, batch.episodes, gens):
                        if trajectory is not None:
                            outcomes[trajectory.trial_id] = trajectory
                            if on_done is not None:
                                on_done(trajectory)
                for batch in batches:
                    for episode in batch.keep(lambda e: e.live and e.request.trial_id not in outcomes):
                        record_times(times, episode, environment_s.get(episode.request.trial_id, 0.0))
                        episode.close()
                batches = [b for b in batches if b.episodes]
    finally:
        for batch in batches:
            for episode in batch.episodes:
                episode.close()
    return [outcomes[r.trial_id] for r in requests]


Attempt = Callable[[list[EpisodeRequest], int], tuple[list[EpisodeRequest], Mapping[str, BaseException]]]


def run_with_retries(
    policy: Policy,
    requests: Sequence[EpisodeRequest],
    stage: Stage,
    sampling: SamplingSettings,
    max_retries: int,
    on_done: Callable[[AgentTrajectory], None] | None = None,
    times: dict[str, TrialTimes] | None = None,
    attempt: Attempt | None = None,
) -> list[Outcome]:
    """`run_episodes`, with each failed trial played again from its first turn, up to `max_retries`
    times: one outcome per request, in their order, its trajectory or how its last attempt failed.
    `attempt(pending, n)`, when given, is called before attempt n: the trials it plays, and the
    failures it injects instead of playing the others (`faults.flaky_trial_rate`)."""
    done: dict[str, Outcome] = {}
    pending = list(requests)
    for n in range(max_retries + 1):
        if not pending:
            break
        healthy, injected = attempt(pending, n) if attempt is not None else (pending, {})
        done.update((t, TrialFailed(trial_id=t, error=repr(e))) for t, e in injected.items())
        done.update((o.trial_id, o) for o in run_episodes(policy, healthy, stage, sampling, on_done, times=times))
        pending = [r for r in pending if isinstance(done[r.trial_id], TrialFailed)]
    return [done[r.trial_id] for r in requests]


class TurnBatch:
    """Live episodes that advance one turn together, and the KV cache of each, as its last turn left
    it (`sampling.generate_cached`): a turn computes only each sequence's new tokens (the last sampled
    token, the observation), not the whole sequence again."""

    def __init__(self, episodes: list[Episode]):
        self.episodes = episodes
        self.kv: list[RowKV] | None = None

    def generate(self, model: torch.nn.Module, sampling: SamplingSettings, eos_id: int, pad_id: int) -> list[Generation]:
        past = BatchKV.stack(self.kv) if self.kv is not None else None
        gens, self.kv = generate_cached(
            model,
            [e.ids for e in self.episodes],
            [e.turn_seed for e in self.episodes],
            sampling,
            eos_id,
            pad_id,
            past=past,
            keep=True,
        )
        return gens

    def keep(self, live: Callable[[Episode], bool]) -> list[Episode]:
        """Keep the episodes `live` says go on (and their caches); returns the others."""
        kept = [i for i, e in enumerate(self.episodes) if live(e)]
        gone = [e for e in self.episodes if not live(e)]
        self.kv = [self.kv[i] for i in kept] if self.kv is not None else None
        self.episodes = [self.episodes[i] for i in kept]
        return gone
