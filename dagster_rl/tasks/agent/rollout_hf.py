"""Multi-turn rollouts on `transformers`, batched by turn: every live trial advances one turn together.

Each turn is one call of the single-turn sampler (`dagster_rl.tasks.lm.rollout.sampling.generate`: a KV-cache
decode of a left-padded batch, one seeded generator per row, each sampled token's log-prob recorded
from the logits it was drawn from) over the live trials' whole sequences, with each trial's seed
for that turn and the per-turn token budget. A trial that ends leaves the batch; the others go on.
What a row samples depends on its seed and its logits alone, not on its batch, so a retried trial
replays its turns wherever the logits agree.

Each trial is an `agent.episode.Episode`; a trial whose environment fails (or that outlives its
timeout) becomes a `TrialFailed` and leaves the batch, the others go on. `on_done(trajectory)` is
called as each trajectory ends (the hook where a judge can take it while the others still generate).
"""

from collections.abc import Callable, Sequence
from pathlib import Path

from dagster_rl.core.records import TrialFailed
from dagster_rl.core.retries import describe
from dagster_rl.tasks.agent.chat import ChatTurns
from dagster_rl.tasks.agent.environment import EnvironmentSettings, environment_of
from dagster_rl.tasks.agent.episode import Episode
from dagster_rl.tasks.agent.records import AgentTrajectory, EpisodeRequest
from dagster_rl.tasks.lm.model.policy import Policy
from dagster_rl.tasks.lm.rollout.sampling import generate
from dagster_rl.tasks.lm.settings import SamplingSettings

Outcome = AgentTrajectory | TrialFailed


def run_episodes(
    policy: Policy,
    requests: Sequence[EpisodeRequest],
    environment: EnvironmentSettings,
    sampling: SamplingSettings,
    max_turns: int,
    timeout_s: float,
    sandbox_root: Path,
    on_done: Callable[[AgentTrajectory], None] | None = None,
    batch_size: int = 256,
) -> list[Outcome]:
    """One outcome per request, in the order of `requests`: its trajectory, or how it failed.
    `sampling.max_new_tokens` is the per-turn token budget; temperature 0 is greedy (evaluation)."""
    spec, chat = environment_of(environment.name), ChatTurns.of(policy.tokenizer)
    outcomes: dict[str, Outcome] = {}
    live: list[Episode] = []

    def fail(request: EpisodeRequest, error: BaseException) -> None:
        outcomes[request.trial_id] = TrialFailed(trial_id=request.trial_id, error=f"the environment failed: {describe(error)}")

    for r in requests:
        try:
            live.append(Episode(r, spec, environment, chat, max_turns, timeout_s, sandbox_root))
        except Exception as e:
            fail(r, e)
    policy.mode(training=False)
    tok = policy.tokenizer
    try:
        with policy.merged() as model:
            while live:
                for start in range(0, len(live), batch_size):
                    batch = live[start : start + batch_size]
                    gens = generate(
                        model, [e.ids for e in batch], [e.turn_seed for e in batch], sampling, tok.eos_token_id, tok.pad_token_id
                    )
                    for episode, g in zip(batch, gens, strict=True):
                        try:
                            episode.advance(g.completion_ids, g.logprobs, g.finish_reason)
                            if not episode.live:
                                trajectory = episode.trajectory(sampling.temperature, sampling.top_p, policy.version)
                                outcomes[trajectory.trial_id] = trajectory
                                if on_done is not None:
                                    on_done(trajectory)
                        except Exception as e:
                            fail(episode.request, e)
                still = []
                for episode in live:
                    if episode.live and episode.request.trial_id not in outcomes:
                        still.append(episode)
                    else:
                        episode.close()
                live = still
    finally:
        for episode in live:
            episode.close()
    return [outcomes[r.trial_id] for r in requests]
