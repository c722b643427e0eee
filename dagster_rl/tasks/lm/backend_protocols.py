"""What the language-model loop calls on its backends: a rollout backend generates a step's
requests in one call (`hf` in this process, `openai_server` against a server) and reports each
rollout as it lands, a trainer backend
runs one GRPO update (`in_process`, `torchrun`, `k8s`: `LMTrainer`). Imports nothing heavy: the
task's record names these types without importing torch."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from dagster_rl.core.records import TrialFailed
from dagster_rl.core.task import RolloutBackend, TrainerBackend, Weights
from dagster_rl.tasks.lm.experiment import LMExperiment
from dagster_rl.tasks.lm.records import LMRollout, RolloutRequest
from dagster_rl.tasks.lm.rewards import LMReward

if TYPE_CHECKING:
    from dagster_rl.tasks.lm.train.trainer import OldLogp, TrainMetrics

Checkpoint = dict[str, bytes]  # file name -> bytes: adapter, its config, optimizer state, version


class LMRolloutBackend(RolloutBackend, Protocol):
    def generate(
        self,
        exp: LMExperiment,
        requests: Sequence[RolloutRequest],
        behavior: Weights[Checkpoint],
        template: str,
        on_done: Callable[[LMRollout], None] | None = None,
    ) -> list[LMRollout | TrialFailed]:
        """One outcome per request, in order: its rollout, sampled with the `behavior` weights, or how
        it failed after its retries. `on_done(rollout)` is called (from any thread) with each rollout
        the moment it is complete and final, before `generate` returns, so that the loop judges it
        while the others still generate; never with a failed trial."""
        ...


class LMTrainerBackend(TrainerBackend, Protocol):
    def train(
        self,
        exp: LMExperiment,
        previous: Checkpoint,
        rollouts: list[LMRollout],
        rewards: list[LMReward],
        reference: Checkpoint | None = None,
        old_logp: OldLogp = "sampler",
        behavior: Checkpoint | None = None,
    ) -> tuple[Checkpoint, TrainMetrics]:
        """One update from `previous`; `reference`: the KL term's reference adapter (None: the base);
        `old_logp`: the ratio's old policy (`dagster_rl.tasks.lm.train.trainer.train_step`);
        `behavior`: the weights that sampled stale rollouts, for `grpo.mismatch` (None: not needed)."""
        ...
