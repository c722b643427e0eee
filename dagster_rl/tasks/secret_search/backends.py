"""The secret_search task's backends: what its loop calls on them (`SecretSearchRolloutBackend`,
`SecretSearchTrainerBackend`), and the ones it ships: trials in a sandbox, and the tabular update,
in-process.

Each holds its environment's limits (retries, timeout, concurrency). The Dagster resources in
`resources/` build them through the task's record (`secret_search.task`); a plain Python loop can
build them directly.
"""

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from dagster_rl.base import counters
from dagster_rl.base.errors import SandboxError
from dagster_rl.base.faults import maybe_fail
from dagster_rl.base.retries import Limits, with_retries
from dagster_rl.core.task import RolloutBackend, TrainerBackend
from dagster_rl.tasks.secret_search.agent import run_agent
from dagster_rl.tasks.secret_search.experiment import SecretSearchExperiment
from dagster_rl.tasks.secret_search.records import Reward, TabularWeights, Trajectory, TrialSpec
from dagster_rl.tasks.secret_search.update import update


class SecretSearchRolloutBackend(RolloutBackend, Protocol):
    def run(self, exp: SecretSearchExperiment, spec: TrialSpec, weights: TabularWeights, world: dict[str, bytes]) -> Trajectory:
        """One trial: the agent with the behavior `weights` in a private copy of `world`, after its retries."""
        ...


class SecretSearchTrainerBackend(TrainerBackend, Protocol):
    def train(
        self, exp: SecretSearchExperiment, weights: TabularWeights, rewards: list[Reward]
    ) -> tuple[TabularWeights, dict[str, float]]:
        """The update of `weights` on a step's rewards, and its numbers (groups, groups_with_signal,
        samples_used, grad_norm)."""
        ...


@dataclass(frozen=True)
class SandboxRollouts:
    """One trial per call: the agent in a private copy of its world, under `sandbox_root`."""

    sandbox_root: Path
    limits: Limits = Limits()

    def __post_init__(self) -> None:
        check_sandbox_root(self.sandbox_root)

    def run(self, exp: SecretSearchExperiment, spec: TrialSpec, weights: TabularWeights, world: dict[str, bytes]) -> Trajectory:
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


def check_sandbox_root(root: Path) -> None:
    """Make `root` if it is missing and try a sandbox in it; a `SandboxError` naming the path and the
    setting when trials could not write there (a file, a read-only filesystem, no permission)."""
    what = f"the sandbox folder {root} (the rollout environment's sandbox_root, or the system temp dir)"
    try:
        root.mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=".probe-", dir=root))
    except FileExistsError:
        raise SandboxError(
            f"{what} is a file, not a folder: set sandbox_root to a folder trials may write in (empty: the system temp dir)"
        ) from None
    except OSError as e:
        raise SandboxError(
            f"{what} cannot hold sandboxes: {e.strerror or e} ({e.filename or root}). Set sandbox_root to a folder trials "
            "may write in (empty: the system temp dir)"
        ) from None


@dataclass(frozen=True)
class TabularTrainer:
    """The GRPO update of the document priors (`update`), in this process."""

    limits: Limits = Limits(max_retries=0, timeout_s=600.0, max_concurrency=1)

    def train(
        self, exp: SecretSearchExperiment, weights: TabularWeights, rewards: list[Reward]
    ) -> tuple[TabularWeights, dict[str, float]]:
        def attempt(n: int) -> tuple[TabularWeights, dict[str, float]]:
            counters.bump("train_calls")
            return update(weights, rewards, exp.grpo)

        return with_retries("training", attempt, self.limits.max_retries, self.limits.timeout_s)
