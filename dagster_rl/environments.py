"""The in-process environments of the loop: rollout (sandbox agent), judge, trainer.

Each holds its own retries, timeout and concurrency. The Dagster resources in `resources/` build
these from their configuration; a plain Python loop can build them directly.
"""

from dataclasses import dataclass
from pathlib import Path

from dagster_rl import counters
from dagster_rl.experiment import SecretSearchExperiment as Experiment
from dagster_rl.faults import maybe_fail
from dagster_rl.records import Reward, TabularWeights, Trajectory, TrialSpec
from dagster_rl.retries import with_retries
from dagster_rl.secret_search.agent import run_agent
from dagster_rl.secret_search.judge import judge
from dagster_rl.secret_search.update import update


@dataclass(frozen=True)
class Limits:
    max_retries: int = 2
    timeout_s: float = 60.0
    max_concurrency: int = 8


@dataclass(frozen=True)
class SandboxRollouts:
    sandbox_root: Path
    limits: Limits = Limits()

    def run(self, exp: Experiment, spec: TrialSpec, weights: TabularWeights, world: dict[str, bytes]) -> Trajectory:
        def attempt(n: int) -> Trajectory:
            counters.bump("trials_executed")
            maybe_fail(exp.faults.flaky_trial_rate, n, exp.seed, "trial", spec.trial_id)
            return run_agent(
                spec,
                weights.doc_prior[spec.world_id],
                world,
                max_turns=exp.task.max_turns,
                scratch_rate=exp.task.scratch_rate,
                behavior_version=weights.version,
                sandbox_root=self.sandbox_root,
            )

        return with_retries(f"trial {spec.trial_id}", attempt, self.limits.max_retries, self.limits.timeout_s)


def score_trajectory(exp, traj):
    """The task's verifier + rubric: secret_search trajectories or language-model rollouts."""
    if exp.kind == "verifiable_prompts":
        from dagster_rl.lm.rewards import score

        return score(traj, exp.rubric)
    return judge(traj, exp.rubric, exp.task.max_turns)


@dataclass(frozen=True)
class RubricJudge:
    limits: Limits = Limits()

    def judge(self, exp, traj):
        def attempt(n: int) -> Reward:
            counters.bump("judge_calls")
            maybe_fail(exp.faults.judge_flake_rate, n, exp.seed, "judge", traj.trial_id)
            return score_trajectory(exp, traj)

        return with_retries(f"judging {traj.trial_id}", attempt, self.limits.max_retries, self.limits.timeout_s)


@dataclass(frozen=True)
class InProcessTrainer:
    limits: Limits = Limits(max_retries=0, timeout_s=600.0, max_concurrency=1)

    def train(self, exp: Experiment, weights: TabularWeights, rewards: list[Reward]) -> tuple[TabularWeights, dict[str, float]]:
        def attempt(n: int) -> tuple[TabularWeights, dict[str, float]]:
            counters.bump("train_calls")
            return update(weights, rewards, exp.grpo)

        return with_retries("training", attempt, self.limits.max_retries, self.limits.timeout_s)
