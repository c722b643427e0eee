"""The agent's rollout backend `hf`: a step's episodes played in the driver's process, batched by turn.

The trainer backends are the language-model task's (`dagster_rl.tasks.lm.backends.LMTrainer`, in
process, under torchrun or on pods): they read a trajectory's mask as they read a completion.
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dagster_rl.base import counters
from dagster_rl.base.faults import flaky_trials
from dagster_rl.base.retries import Limits
from dagster_rl.core.task import Weights
from dagster_rl.sandbox.placement import Sandboxes
from dagster_rl.tasks.agent.chat import ChatTurns
from dagster_rl.tasks.agent.episode import stage
from dagster_rl.tasks.agent.experiment import AgentExperiment
from dagster_rl.tasks.agent.records import AgentTrajectory, EpisodeRequest
from dagster_rl.tasks.agent.rollout_hf import Outcome, TrialTimes, run_with_retries
from dagster_rl.tasks.lm.backends import PolicyCache


@dataclass
class AgentHFRollouts:
    """Episodes of a step's requests with the behavior adapter, each trial in a sandbox under
    `sandbox_root`. A failed trial (its environment raised, or it outlived its timeout) is played
    again, from its first turn, up to `limits.max_retries` times."""

    sandbox_root: Path
    limits: Limits = Limits()
    policies: PolicyCache = field(default_factory=PolicyCache)
    sandboxes: Sandboxes | None = None  # where the environments' programs run (the sandbox tier)

    def generate(
        self,
        exp: AgentExperiment,
        requests: Sequence[EpisodeRequest],
        behavior: Weights[dict[str, bytes]],
        on_done: Callable[[AgentTrajectory], None] | None = None,
        times: dict[str, TrialTimes] | None = None,
    ) -> list[Outcome]:
        """One outcome per request, in their order: its trajectory, or how it failed after its retries.
        `on_done(trajectory)` as each trajectory ends; `times[trial]`: where each trial's time went."""
        with self.policies.use(exp, behavior.payload) as policy:
            episodes = stage(exp, ChatTurns.of(policy.tokenizer), self.sandbox_root, self.sandboxes)

            def attempt(pending: list[EpisodeRequest], n: int) -> tuple[list[EpisodeRequest], Mapping[str, BaseException]]:
                counters.bump("trials_executed", len(pending))
                return flaky_trials(pending, exp.faults.flaky_trial_rate, n, exp.seed)

            return run_with_retries(
                policy, requests, episodes, exp.turn_sampling, self.limits.max_retries, on_done, times, attempt
            )
