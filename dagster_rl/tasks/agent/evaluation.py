"""Held-out evaluation of an agent: greedy episodes on worlds no step trains on.

`success`: the fraction of episodes the environment judged successful (for `secret_search`: the
right digest answered within the turn budget); `mean_turns`: the actions an episode took, on
average over all of them; `mean_reward`: the rubric's;
`tool_call_share` (environments that run programs): the fraction of episodes that ran one.

An episode whose environment failed (its process died, its sandbox could not be made, it outlived
its trial's timeout) is played again, from its first turn, up to `max_retries` times: greedy
decoding makes the same episode again. One that fails every attempt fails the evaluation
(`EvaluationFailed`, naming each trial and its error): nothing is stored, and a re-run of the step
evaluates again. A failure is never scored as the policy's.
"""

from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from pydantic import Field

from dagster_rl.base.errors import DagsterRLError
from dagster_rl.core.records import Record, TrialFailed
from dagster_rl.sandbox.placement import Sandboxes
from dagster_rl.tasks.agent.chat import ChatTurns
from dagster_rl.tasks.agent.environment import World, environment_of
from dagster_rl.tasks.agent.episode import stage
from dagster_rl.tasks.agent.experiment import AgentExperiment
from dagster_rl.tasks.agent.judge import judge
from dagster_rl.tasks.agent.records import AgentTrajectory, EpisodeRequest
from dagster_rl.tasks.agent.rollout_hf import run_with_retries
from dagster_rl.tasks.lm.model.policy import Policy


class AgentEvaluation(Record):
    weights_hash: str  # content hash of the evaluated weights; "" for a policy that is not stored
    n: int
    success: float
    mean_turns: float
    mean_reward: float
    end_reasons: dict[str, int]
    # environments that run programs: the share of episodes that ran one (absent otherwise)
    tool_call_share: float | None = Field(None, exclude_if=lambda share: share is None)


class EvaluationFailed(DagsterRLError):
    """Held-out episodes failed on every attempt: the evaluation is not stored."""


def evaluate(
    policy: Policy,
    exp: AgentExperiment,
    worlds: Sequence[World],
    sandbox_root: Path,
    sandboxes: Sandboxes | None,
    weights_hash: str = "",
    max_retries: int = 2,
) -> AgentEvaluation:
    """Greedy episodes of the policy on `worlds` (the held-out ones: `exp.heldout_worlds()`)."""
    greedy = exp.turn_sampling.model_copy(update={"temperature": 0.0})
    requests = [
        EpisodeRequest(trial_id=w.id, step=-1, prompt=i, sample=0, world_id=w.id, world_seed=w.seed, seed=0)
        for i, w in enumerate(worlds)
    ]
    episodes = stage(exp, ChatTurns.of(policy.tokenizer), sandbox_root, sandboxes)
    outcomes = run_with_retries(policy, requests, episodes, greedy, max_retries)
    failed = [o for o in outcomes if isinstance(o, TrialFailed)]
    if failed:
        errors = "; ".join(f"{f.trial_id}: {f.error}" for f in failed)
        raise EvaluationFailed(
            f"{len(failed)} of {len(requests)} held-out episodes failed on each of {max_retries + 1} attempts, so the "
            f"evaluation is not stored (a re-run of the step evaluates again): {errors}"
        )
    played = [o for o in outcomes if isinstance(o, AgentTrajectory)]
    rewards = [judge(t, exp.rubric, exp.task.episode.max_turns) for t in played]
    n = len(played)
    return AgentEvaluation(
        weights_hash=weights_hash,
        n=n,
        success=sum(r.correct for r in rewards) / n,
        mean_turns=sum(r.turns for r in rewards) / n,
        mean_reward=sum(r.reward for r in rewards) / n,
        end_reasons=dict(sorted(Counter(t.end_reason for t in played).items())),
        tool_call_share=(
            sum(any(turn.calls for turn in t.turns) for t in played) / n
            if environment_of(exp.task.environment.name).runs_programs
            else None
        ),
    )
