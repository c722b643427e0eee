"""The agent's rollout backend `openai_server`: each episode's turns played as completion requests to
a warm vLLM server (or `dagster-rl serve`), over the language-model task's client
(`dagster_rl.tasks.lm.rollout.openai_client.ServerRollouts`: its tokenizer, the behavior weights served
as the adapter `<experiment>-v<version>`, the refusal of a server that reports raw log-probs, the
one table of sampling fields a request states).

Token in, token out: a turn's request is the episode's whole sequence as token ids (`Episode.ids`),
seeded with that turn's seed (`Episode.turn_seed`, as the `hf` backend draws it), at most
`task.episode.max_turn_tokens` tokens, the tokenizer's eos as the one stop token, `logprobs: 0`
and `return_tokens_as_token_ids`; the sampled ids and their log-probs go to `Episode.advance` as
the server returned them (checked by `vllm_client.check_completion`), never decoded and re-encoded.

Episodes run `limits.max_concurrency` at a time, each in its own sandbox under `sandbox_root`;
`on_done(trajectory)` as each ends. A trial that fails (its environment raised, a request failed, or
it outlived `task.episode.trial_timeout_s`) is played again from its first turn, up to
`limits.max_retries` times, and then is a `TrialFailed` (never cached).
"""

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from dagster_rl.base import counters
from dagster_rl.base.faults import maybe_fail
from dagster_rl.base.retries import AttemptsExhausted, describe, with_retries
from dagster_rl.core.records import TrialFailed
from dagster_rl.core.task import Weights
from dagster_rl.inference.http_json import EndpointError
from dagster_rl.inference.vllm_client import ServerSampling
from dagster_rl.sandbox.placement import Sandboxes
from dagster_rl.tasks.agent.chat import ChatTurns
from dagster_rl.tasks.agent.episode import Episode, stage
from dagster_rl.tasks.agent.experiment import AgentExperiment
from dagster_rl.tasks.agent.records import AgentTrajectory, EpisodeRequest
from dagster_rl.tasks.agent.rollout_hf import Outcome, TrialTimes, record_times
from dagster_rl.tasks.lm.backend_protocols import Checkpoint
from dagster_rl.tasks.lm.rollout.openai_client import ServerRollouts


@dataclass
class AgentServerRollouts:
    """Episodes of a step's requests on the rollout server of `server` (its endpoint, limits and
    client), each trial in a sandbox under `sandbox_root`."""

    server: ServerRollouts
    sandbox_root: Path
    sandboxes: Sandboxes | None = None  # where the environments' programs run (the sandbox tier)
    _on_done: threading.Lock = field(default_factory=threading.Lock)

    def generate(
        self,
        exp: AgentExperiment,
        requests: Sequence[EpisodeRequest],
        behavior: Weights[Checkpoint],
        on_done: Callable[[AgentTrajectory], None] | None = None,
        times: dict[str, TrialTimes] | None = None,
    ) -> list[Outcome]:
        """One outcome per request, in their order: its trajectory, or how it failed after its retries.
        `on_done(trajectory)` as each trajectory ends (one call at a time); `times[trial]`: where each
        trial's time went."""
        if not requests:
            return []
        server, limits = self.server, self.server.limits
        tok, vocab = server.tokenizer(exp.policy.base_model)
        chat = ChatTurns.of(tok)
        model = server.ready(exp, behavior)
        server.check_logprobs_mode(model, chat.prompt(exp.task.environment.name), vocab)
        s = exp.turn_sampling
        sampling = ServerSampling(s.temperature, s.top_p, s.max_new_tokens, stop_token_ids=(chat.eos_id,))
        episodes, episode = stage(exp, chat, self.sandbox_root, self.sandboxes), exp.task.episode

        def play(r: EpisodeRequest, attempt: int) -> AgentTrajectory:
            counters.bump("trials_executed")
            maybe_fail(exp.faults.flaky_trial_rate, attempt, exp.seed, "trial", r.trial_id)
            e = Episode(r, episodes)
            environment_s = 0.0
            try:
                while e.live:
                    try:
                        c = server.client.complete(
                            model,
                            e.ids,
                            sampling,
                            seed=e.turn_seed % 2**63,  # vLLM takes a signed 64-bit seed; the sampler uses seed mod 2^63 anyway
                            timeout_s=max(min(server.endpoint.request_timeout_s, e.seconds_left), 0.001),
                            vocab=vocab,
                        )
                    except EndpointError:
                        e.check_time()  # the trial's time ran out during the request: that is the failure
                        raise
                    t0 = time.monotonic()
                    e.advance(c.token_ids, c.logprobs, c.finish_reason)
                    environment_s += time.monotonic() - t0
                trajectory = e.trajectory(s.temperature, s.top_p, behavior.version)
                record_times(times, e, environment_s)
                return trajectory
            finally:
                e.close()

        def trial(r: EpisodeRequest) -> Outcome:
            try:
                trajectory = with_retries(
                    f"trial {r.trial_id}", lambda n: play(r, n), limits.max_retries, episode.trial_timeout_s
                )
            except AttemptsExhausted as e:
                return TrialFailed(trial_id=r.trial_id, error=describe(e.errors[-1]))
            if on_done is not None:
                with self._on_done:
                    on_done(trajectory)
            return trajectory

        with ThreadPoolExecutor(limits.max_concurrency, "episode") as pool:
            return list(pool.map(trial, requests))
