"""The language-model loop: generate, judge, train, evaluate, cached by content.

With `max_policy_lag: 1` generation of step k+1 (with the weights of step k-1) runs in a thread
while step k trains; the loss's clipped importance ratio against the recorded sampling
log-probabilities corrects for the stale behavior policy. Held-out evaluation of step k runs in
another thread and is awaited after step k+1 trains.

With a `warmup` section, step 0 starts from the supervised warm-up's adapter
(`dagster_rl.tasks.lm.weights`, the `<exp>/sft` asset), stored under a key of everything it depends on; with `grpo.kl_reference: sft`
the KL term's reference is that adapter, else the original base.

Every step reports its `on_policy` check: where the behavior policy is the trained policy, the
trainer's log-probability of each sampled token must equal the sampler's within the dtype's
tolerance. A step that fails it has its rollouts moved aside (and, pipelined, those of the step
generated a step ahead by the same sampler), so that a re-run after the fix samples them again.

A step's generation and judging are `step_generation`'s, its held-out evaluation
`step_evaluation`'s; this module pipelines them around the update it trains.
"""

import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from safetensors.torch import load as load_safetensors

from dagster_rl.core.checks import CheckOutcome, on_policy, step_checks, weights_finite
from dagster_rl.core.experiment import step_key
from dagster_rl.core.hashing import canonical_json
from dagster_rl.core.progress import Progress
from dagster_rl.core.records import STATS, TrainedFrom
from dagster_rl.core.steps import mean, trained_from, weights_key
from dagster_rl.core.task import StepAsset, StepResult, WarmupResult, Warn, Weights
from dagster_rl.store.artifact_store import ArtifactStore
from dagster_rl.tasks.lm.backend_protocols import Checkpoint
from dagster_rl.tasks.lm.code_versions import CODE_VERSIONS
from dagster_rl.tasks.lm.data.prompts import PromptSet, load_prompt_set
from dagster_rl.tasks.lm.experiment import LMExperiment as Exp
from dagster_rl.tasks.lm.model.policy import ADAPTER
from dagster_rl.tasks.lm.records import LMRollout
from dagster_rl.tasks.lm.rewards import LMReward
from dagster_rl.tasks.lm.step_evaluation import evaluate_step
from dagster_rl.tasks.lm.step_generation import Generated, LMBackends, discard_rollouts, generate_step
from dagster_rl.tasks.lm.weights import base_weights, checkpoint_of, stored_weights, warmup_result, warmup_weights


class LMTrainStats(TrainedFrom):
    version: int
    metrics: dict[str, float]


def adapter_finite(checkpoint: Checkpoint) -> CheckOutcome:
    """The `weights_finite` check of a step's checkpoint: every adapter tensor holds finite numbers."""
    tensors = load_safetensors(checkpoint[ADAPTER])
    bad = sorted(name for name, t in tensors.items() if t.is_floating_point() and not bool(t.isfinite().all()))
    message = f"all {len(tensors)} tensors finite" if not bad else f"non-finite values in {bad[:5]}"
    return weights_finite(len(bad), message)


def _passed(result: StepResult, check: str) -> bool:
    return all(c.passed for c in result.checks if c.name == check)


class LMLoop:
    def initial_weights(self, exp: Exp, store: ArtifactStore) -> Weights[Checkpoint]:
        """Step 0's weights: the warm-up's adapter when the experiment has one, else the base's."""
        return base_weights(exp, store) if exp.warmup is None else warmup_weights(exp, store)

    def warmup(self, exp: Exp, store: ArtifactStore) -> WarmupResult:
        """The `<exp>/sft` asset: the warm-up (computed, or found in the store) and its held-out
        greedy accuracy beside the base's."""
        return warmup_result(exp, store)

    def load_weights(self, exp: Exp, store: ArtifactStore, partition: str, key: str) -> Weights[Checkpoint]:
        return stored_weights(partition, store.ref("weights", key), store.get_all("weights", key))

    def _trained_from(self, exp: Exp, store: ArtifactStore, weights: Weights[Checkpoint], step: int) -> Weights[Checkpoint]:
        """The weights that step `step + 1`'s weights (`weights`) were trained from: the behavior
        policy of a lagged step. Step -1's are the initial weights."""
        if step < 0:
            return self.initial_weights(exp, store)
        stats = LMTrainStats.model_validate_json(store.get("weights", weights.ref.key, STATS))
        return self.load_weights(exp, store, step_key(step), stats.prev_weights_key)

    def prompt_set(self, exp: Exp) -> PromptSet:
        """What a step's prompts and the held-out ones are drawn from."""
        return load_prompt_set(exp.task.source)

    def generate(
        self,
        exp: Exp,
        step: int,
        behavior: Weights[Checkpoint],
        prompts: PromptSet,
        store: ArtifactStore,
        backends: LMBackends,
        warn: Warn,
    ) -> Generated[LMRollout, LMReward]:
        """A step's rollouts and rewards, stored (`step_generation`)."""
        return generate_step(exp, step, behavior, prompts, store, backends, warn)

    def evaluate(
        self,
        exp: Exp,
        step: int,
        weights: Weights[Checkpoint],
        base: Weights[Checkpoint],
        initial: Weights[Checkpoint],
        prompts: PromptSet,
        store: ArtifactStore,
        progress: Progress,
    ) -> StepAsset:
        """A step's held-out evaluation (`step_evaluation`)."""
        return evaluate_step(exp, step, weights, base, initial, prompts, store, progress)

    def iter_steps(
        self, exp: Exp, steps: Sequence[int], start: Weights[Checkpoint], store: ArtifactStore, backends: LMBackends, warn: Warn
    ) -> Iterator[StepResult | StepAsset]:
        prompts = self.prompt_set(exp)
        lag, first, last = exp.max_policy_lag, steps[0], steps[-1]
        weights = {first - 1: start}  # step -> the weights it produced; -1: initial
        if lag and first - 2 >= -1:
            weights[first - 2] = self._trained_from(exp, store, start, first - 2)
        with backends.progress.doing(f"{exp.name}: loading the base model and the initial weights"):
            base = base_weights(exp, store)
            initial = self.initial_weights(exp, store)
        reference = initial if exp.grpo.kl_reference == "sft" else None

        def behavior(k: int) -> Weights[Checkpoint]:
            return weights[max(k - 1 - lag, -1)]

        def generate(k: int):
            return gen_pool.submit(self.generate, exp, k, behavior(k), prompts, store, backends, warn)

        threads = torch.get_num_threads()
        torch.set_num_threads(exp.generation_threads)
        try:
            with ThreadPoolExecutor(1, "generate") as gen_pool, ThreadPoolExecutor(1, "evaluate") as eval_pool:
                generating, evaluating = generate(first), list[Future[StepAsset]]()
                for k in steps:
                    gen = generating.result()
                    if lag and k < last:  # step k+1 generates with the weights of step k-1 while step k trains
                        generating = generate(k + 1)
                    result, weights[k] = self._train(exp, k, weights[k - 1], gen, store, backends, reference)
                    if lag and k < last and not _passed(result, "on_policy"):  # step k+1 was sampled by the same sampler
                        try:
                            discard_rollouts(store, generating.result())
                        except Exception as e:  # its generation failed: nothing of it to discard
                            warn(f"step {step_key(k + 1)}'s generation failed too: {e!r}")
                    passed = all(c.passed for c in result.checks)
                    if not lag and k < last and passed:
                        generating = generate(k + 1)
                    yield result
                    if not passed:  # a failed blocking check ends the range (the driver stops there too)
                        return
                    while evaluating:  # evaluation of step k-1 is awaited after step k trains
                        yield evaluating.pop(0).result()
                    evaluating.append(
                        eval_pool.submit(self.evaluate, exp, k, weights[k], base, initial, prompts, store, backends.progress)
                    )
                for pending in evaluating:
                    yield pending.result()
        finally:
            torch.set_num_threads(threads)

    def _train(
        self,
        exp: Exp,
        step: int,
        previous: Weights[Checkpoint],
        gen: Generated,
        store: ArtifactStore,
        backends: LMBackends,
        reference: Weights[Checkpoint] | None,
    ) -> tuple[StepResult, Weights[Checkpoint]]:
        """Train step `step` from `previous`; `reference`: the KL term's reference adapter (None: the base)."""
        t0 = time.monotonic()

        # rollouts the weights being trained sampled (every step at lag 0, step 0 at lag 1): the ratio's old policy is
        # the trainer's own log-probs, so the update does not depend on the sampler's float noise; stale ones: the sampler's
        sampled_by_previous = gen.rollouts.behavior_policy.get("content_hash") == previous.ref.content_hash

        def train() -> dict[str, bytes]:
            files, metrics = backends.trainer.train(
                exp,
                previous.payload,
                gen.rollouts.trajectories,
                gen.rewards.rewards,
                reference=reference.payload if reference is not None else None,
                old_logp="trainer" if sampled_by_previous else "sampler",
            )
            stats = LMTrainStats(
                **trained_from(exp, step, previous, gen.rewards_ref),
                version=metrics.version,
                metrics={k: float(v) for k, v in metrics.model_dump().items() if v is not None},  # kl: absent at kl_beta 0
            )
            return {**files, STATS: canonical_json(stats)}

        key = weights_key(
            CODE_VERSIONS["weights"],
            exp,
            previous.ref,
            gen.rewards_ref,
            grpo=exp.grpo,
            policy=exp.policy,
            world_size=exp.world_size,
            **({"reference": reference.ref.content_hash} if reference is not None else {}),
        )
        files, ref, hit = store.get_or_put_files("weights", key, train)
        stats = LMTrainStats.model_validate_json(files[STATS])
        weights = Weights(step_key(step), ref, checkpoint_of(files), stats.version)

        rewards = gen.rewards.rewards
        tokens = {r.trial_id: len(r.completion_token_ids) for r in gen.rollouts.trajectories}
        behavior_version = int(gen.rollouts.behavior_policy["version"])
        sampled_as_trained = on_policy(
            stats.metrics.get("logp_max_dev"),
            stats.metrics.get("logp_mean_dev"),
            exp.on_policy_tolerance,
            exp.policy.dtype,
            behavior_version,
            previous.version,
        )
        if not sampled_as_trained.passed:
            discard_rollouts(store, gen)
        result = StepResult(
            step=step,
            n_trials=len(rewards),
            n_trials_planned=gen.rollouts.n_trials_planned,
            mean_reward=mean([r.reward for r in rewards]),
            success_rate=mean([float(r.correct) for r in rewards]),
            weights_version=weights.version,
            cache={**gen.cache, "weights": "hit" if hit else "miss"},
            refs={"rollouts": gen.rollouts_ref, "rewards": gen.rewards_ref, "weights": ref},
            behavior_policy=gen.rollouts.behavior_policy,
            skipped_trials=gen.rewards.skipped,
            recovered_trials=gen.recovered,
            trials_executed=gen.trials,
            judge_calls=gen.judge_calls,
            metrics={
                **{
                    k: stats.metrics[k]
                    for k in (
                        "loss",
                        "ratio",
                        "ratio_max_dev",
                        "logp_max_dev",
                        "logp_mean_dev",
                        "kl",
                        "clip_frac",
                        "grad_norm",
                        "samples_used",
                        "groups_with_signal",
                        "pad_share",
                    )  # fmt: skip
                    if k in stats.metrics  # kl: not computed at kl_beta 0
                },
                "policy_lag": float(previous.version - behavior_version),
                "mean_completion_tokens": mean([float(tokens[r.trial_id]) for r in rewards]),
            },
            timings={
                "generate_s": gen.seconds,
                "judge_s": gen.judge_seconds,
                "judge_hidden_s": gen.judge_hidden_seconds,
                "train_s": time.monotonic() - t0,
                **gen.timings,
            },  # judge_s: of generate_s; judge_hidden_s: of judge_s, judged while the trials still generated
            checks=[
                *step_checks(exp, adapter_finite(weights.payload), rewards, gen.rollouts.n_trials_planned),
                sampled_as_trained,
            ],
        )
        backends.progress.end(step)
        return result, weights
