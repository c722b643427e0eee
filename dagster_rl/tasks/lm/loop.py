"""The language-model loop: generate, judge, train, evaluate, cached by content.

With `max_policy_lag: 1` generation of step k+1 (with the weights of step k-1) runs in a thread
while step k trains; the loss's clipped importance ratio against the recorded sampling
log-probabilities corrects for the stale behavior policy. Held-out evaluation of step k runs in
another thread and is awaited after step k+1 trains.

With a `warmup` section, step 0 starts from the supervised warm-up's adapter (`lm.warmup`, the
`<exp>/sft` asset), stored under a key of everything it depends on; with `grpo.kl_reference: sft`
the KL term's reference is that adapter, else the original base.

Every step reports its `on_policy` check: where the behavior policy is the trained policy, the
trainer's log-probability of each sampled token must equal the sampler's within the dtype's
tolerance. A step that fails it has its rollouts moved aside (and, pipelined, those of the step
generated a step ahead by the same sampler), so that a re-run after the fix samples them again.
"""

import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from safetensors.torch import load as load_safetensors

from dagster_rl.core import counters
from dagster_rl.core.checks import CheckOutcome, on_policy, step_checks, weights_finite
from dagster_rl.core.experiment import step_key
from dagster_rl.core.hashing import cache_key, canonical_json, content_hash
from dagster_rl.tasks.lm.evaluation import Evaluation, evaluate
from dagster_rl.tasks.lm.experiment import LMExperiment as Exp
from dagster_rl.tasks.lm.model.policy import ADAPTER, CHECKPOINT_FILES, checkpoint_bytes, load_policy, read_state
from dagster_rl.tasks.lm.rewards import LMReward
from dagster_rl.tasks.lm.records import LMRollout, plan_requests
from dagster_rl.tasks.lm.data.prompts import PromptSet, load_prompt_set, prompts_for_step
from dagster_rl.core.records import STATS, Rewards, Rollouts, TrainedFrom, TrialFailed
from dagster_rl.core.steps import Judged, judge_all, mean, recovered, rewards_key, rollouts_key, step_rewards, trained_from, trial_set, weights_key
from dagster_rl.store.artifact_store import ArtifactRef, ArtifactStore
from dagster_rl.tasks.lm.train.warmup import WARMUP, WarmupStats, warm_up
from dagster_rl.core.progress import Progress
from dagster_rl.core.task import Backends, StepAsset, StepResult, Warn, WarmupResult, Weights

CODE_VERSIONS = {
    "initial": "lora-init-1",
    "warmup": "sft-lora-3",  # 2: stops at warmup.target_accuracy; 3: keyed by the prompts' content
    # 2: behavior log-probs recorded by the sampler; 3: keyed by the behavior weights' key and the step's prompts' content
    "rollouts": "hf-rollouts-3",
    "rewards": "lm-rubric-2",  # 2: keyed by the rollouts' key, which the rewards record
    # 2: packed micro-batches; 3: the trainer reports logp_max_dev (on_policy); 4: keyed by the keys of the weights and
    # rewards it trains from, and on-policy (the rollouts sampled by the weights it trains) the ratio's old log-probs are
    # the trainer's own
    "weights": "grpo-lora-4",
    "evaluation": "greedy-eval-2",  # 2: keyed by the held-out prompts' content and template; stores each answer
}
Checkpoint = dict[str, bytes]  # file name -> bytes: adapter, its config, optimizer state, version


class LMTrainStats(TrainedFrom):
    version: int
    metrics: dict[str, float]


@dataclass
class Generated:
    """A step's rollouts and rewards, stored."""

    rollouts: Rollouts[LMRollout]
    rollouts_ref: ArtifactRef
    rollouts_key: str  # the key of the complete set (rollouts_ref is a partial one when trials failed)
    rewards: Rewards[LMReward]
    rewards_ref: ArtifactRef
    cache: dict[str, str]
    trials: int
    judge_calls: int
    seconds: float
    recovered: list[str]  # trials an earlier attempt of the step failed, succeeded now
    judge_seconds: float = 0.0  # of `seconds`, the time spent judging the trials as they landed


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with `n` torch threads (the process's setting is restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _checkpoint(files: dict[str, bytes]) -> Checkpoint:
    """The files a policy loads (not the records stored beside them)."""
    return {k: v for k, v in files.items() if k in CHECKPOINT_FILES}


def _stored_weights(partition: str, ref: ArtifactRef, files: dict[str, bytes]) -> Weights[Checkpoint]:
    """Weights read from the store: the checkpoint's files, its version from its state."""
    checkpoint = _checkpoint(files)
    return Weights(partition, ref, checkpoint, read_state(checkpoint)["version"])


def adapter_finite(checkpoint: Checkpoint) -> CheckOutcome:
    """The `weights_finite` check of a step's checkpoint: every adapter tensor holds finite numbers."""
    tensors = load_safetensors(checkpoint[ADAPTER])
    bad = sorted(name for name, t in tensors.items() if t.is_floating_point() and not bool(t.isfinite().all()))
    message = f"all {len(tensors)} tensors finite" if not bad else f"non-finite values in {bad[:5]}"
    return weights_finite(len(bad), message)


def _passed(result: StepResult, check: str) -> bool:
    return all(c.passed for c in result.checks if c.name == check)


def _discard_rollouts(store: ArtifactStore, gen: Generated) -> None:
    """Move a step's rollouts aside (its complete set, and the latest partial of it), so that a re-run
    samples them again instead of finding them: they were not sampled from the policy the trainer scores."""
    for key in dict.fromkeys([gen.rollouts_ref.key, gen.rollouts_key, store.partial("rollouts", gen.rollouts_key)]):
        if key is not None and store.exists("rollouts", key):
            store.warn(f"rollouts {key[:16]} of step {step_key(gen.rollouts.step)} are off-policy: {store.move_aside('rollouts', key, 'off_policy')}")


class LMLoop:
    def initial_weights(self, exp: Exp, store: ArtifactStore) -> Weights[Checkpoint]:
        """Step 0's weights: the warm-up's adapter when the experiment has one, else the base's."""
        return self.base_weights(exp, store) if exp.warmup is None else self.warmup_weights(exp, store)

    def base_weights(self, exp: Exp, store: ArtifactStore) -> Weights[Checkpoint]:
        """A fresh adapter (LoRA B = 0: the base model), the same in every run."""
        key = cache_key("weights", CODE_VERSIONS["initial"], policy=exp.policy)
        files, ref, _ = store.get_or_put_files("weights", key, lambda: checkpoint_bytes(load_policy(exp.policy), None))
        return _stored_weights("initial", ref, files)

    def warmup_weights(self, exp: Exp, store: ArtifactStore) -> Weights[Checkpoint]:
        files, ref, _ = self._warmup(exp, store)
        return _stored_weights("sft", ref, files)

    def _warmup(self, exp: Exp, store: ArtifactStore) -> tuple[dict[str, bytes], ArtifactRef, bool]:
        """The supervised warm-up's adapter (and its `WarmupStats`), computed once per content key."""
        if exp.warmup is None:
            raise ValueError(f"experiment {exp.name} has no warmup section")
        # the check that stops it at a target accuracy scores like the held-out evaluation
        check = {"rubric": exp.rubric, "max_new_tokens": exp.eval_max_new_tokens} if exp.warmup.target_accuracy else None
        prompts = load_prompt_set(exp.task.source)
        key = cache_key(
            "weights",
            CODE_VERSIONS["warmup"],
            policy=exp.policy,
            warmup=exp.warmup,
            source=exp.task.source,
            prompts=content_hash(prompts),  # what the source's file holds now
            seed=exp.seed,
            check=check,
        )

        def compute() -> dict[str, bytes]:
            counters.bump("warmups")

            def accuracy(policy, items) -> float:
                held = PromptSet(train=[], eval=list(items), template=prompts.template)
                return evaluate(policy, held, exp.rubric, exp.eval_max_new_tokens).accuracy

            with torch_threads(exp.trainer.threads_per_process):  # a training job, sized like the trainer's
                files, stats = warm_up(load_policy(exp.policy), prompts.train, prompts.template, exp.warmup, exp.seed, accuracy)
            return {**files, WARMUP: canonical_json(stats)}

        return store.get_or_put_files("weights", key, compute)

    def warmup(self, exp: Exp, store: ArtifactStore) -> WarmupResult:
        """The `<exp>/sft` asset: the warm-up (computed, or found in the store) and its held-out
        greedy accuracy beside the base's."""
        t0 = time.monotonic()
        files, ref, hit = self._warmup(exp, store)
        stats = WarmupStats.model_validate_json(files[WARMUP])
        prompts = load_prompt_set(exp.task.source)
        sft, _, _ = self._evaluation(exp, _stored_weights("sft", ref, files), prompts, store)
        base, _, _ = self._evaluation(exp, self.base_weights(exp, store), prompts, store)
        return WarmupResult(
            cache="hit" if hit else "miss",
            ref=ref,
            metadata={
                "accuracy": sft.accuracy,
                "mean_reward": sft.mean_reward,
                "base_accuracy": base.accuracy,
                "n_prompts": sft.n,
                "demos": len(stats.demos),
                "sft_steps": len(stats.losses),
                "first_loss": stats.losses[0],
                "final_loss": stats.losses[-1],
                "answer_tokens": stats.tokens,
                **({"check_accuracy": stats.checks[-1][1]} if stats.checks else {}),  # what stopped it, on training prompts
                "warmup_s": time.monotonic() - t0,
            },
        )

    def load_weights(self, exp: Exp, store: ArtifactStore, partition: str, key: str) -> Weights[Checkpoint]:
        return _stored_weights(partition, store.ref("weights", key), store.get_all("weights", key))

    def _trained_from(self, exp: Exp, store: ArtifactStore, weights: Weights[Checkpoint], step: int) -> Weights[Checkpoint]:
        """The weights that step `step + 1`'s weights (`weights`) were trained from: the behavior
        policy of a lagged step. Step -1's are the initial weights."""
        if step < 0:
            return self.initial_weights(exp, store)
        stats = LMTrainStats.model_validate_json(store.get("weights", weights.ref.key, STATS))
        return self.load_weights(exp, store, step_key(step), stats.prev_weights_key)

    def iter_steps(
        self, exp: Exp, steps: Sequence[int], start: Weights[Checkpoint], store: ArtifactStore, backends: Backends, warn: Warn
    ) -> Iterator[StepResult | StepAsset]:
        prompts = load_prompt_set(exp.task.source)
        lag, first, last = exp.max_policy_lag, steps[0], steps[-1]
        weights = {first - 1: start}  # step -> the weights it produced; -1: initial
        if lag and first - 2 >= -1:
            weights[first - 2] = self._trained_from(exp, store, start, first - 2)
        with backends.progress.doing(f"{exp.name}: loading the base model and the initial weights"):
            base = self.base_weights(exp, store)
            initial = self.initial_weights(exp, store)
        reference = initial if exp.grpo.kl_reference == "sft" else None

        def behavior(k: int) -> Weights[Checkpoint]:
            return weights[max(k - 1 - lag, -1)]

        def generate(k: int):
            return gen_pool.submit(self._generate, exp, k, behavior(k), prompts, store, backends, warn)

        threads = torch.get_num_threads()
        torch.set_num_threads(exp.generation_threads)
        try:
            with ThreadPoolExecutor(1, "generate") as gen_pool, ThreadPoolExecutor(1, "evaluate") as eval_pool:
                generating, evaluating = generate(first), []
                for k in steps:
                    gen = generating.result()
                    if lag and k < last:  # step k+1 generates with the weights of step k-1 while step k trains
                        generating = generate(k + 1)
                    result, weights[k] = self._train(exp, k, weights[k - 1], gen, store, backends, reference)
                    if lag and k < last and not _passed(result, "on_policy"):  # step k+1 was sampled by the same sampler
                        try:
                            _discard_rollouts(store, generating.result())
                        except Exception as e:  # noqa: BLE001 - its generation failed: nothing of it to discard
                            warn(f"step {step_key(k + 1)}'s generation failed too: {e!r}")
                    passed = all(c.passed for c in result.checks)
                    if not lag and k < last and passed:
                        generating = generate(k + 1)
                    yield result
                    if not passed:  # a failed blocking check ends the range (the driver stops there too)
                        return
                    while evaluating:  # evaluation of step k-1 is awaited after step k trains
                        yield evaluating.pop(0).result()
                    evaluating.append(eval_pool.submit(self._evaluate, exp, k, weights[k], base, initial, prompts, store, backends.progress))
                for pending in evaluating:
                    yield pending.result()
        finally:
            torch.set_num_threads(threads)

    def _generate(
        self, exp: Exp, step: int, behavior: Weights[Checkpoint], prompts: PromptSet, store: ArtifactStore, backends: Backends, warn: Warn
    ) -> Generated:
        t0 = time.monotonic()
        prompts_now = prompts_for_step(prompts.train, exp.seed, step, exp.prompts_per_step)
        requests = {r.trial_id: r for r in plan_requests(prompts_now, exp.seed, step, exp.n_samples)}
        progress = backends.progress
        progress.begin(step, len(requests))
        judged = Judged()  # rewards judged right after generating
        judging = [0.0]

        def run(pending: list[str]) -> list[LMRollout | TrialFailed]:
            progress.generated(step, len(requests) - len(pending))
            outcomes = backends.rollout.generate(exp, [requests[t] for t in pending], behavior, prompts.template)
            progress.generated(step, len(outcomes))
            progress.phase(step, "judging")
            landed = {o.trial_id: o for o in outcomes if isinstance(o, LMRollout)}
            t = time.monotonic()
            for outcome in judge_all(exp, list(landed.values()), backends.judge, lambda n: progress.judged(step, n)):
                judged.add(landed[outcome.trial_id], outcome)
            judging[0] += time.monotonic() - t
            return outcomes

        def make(trajectories: list[LMRollout], failed: list[str]) -> Rollouts[LMRollout]:
            return Rollouts[LMRollout](
                step=step, behavior_policy=behavior.lineage(), n_trials_planned=len(requests), trajectories=trajectories, skipped=failed
            )

        complete_key = self._rollouts_key(exp, step, behavior, prompts_now, prompts.template)
        rollouts = trial_set(store, "rollouts", complete_key, Rollouts[LMRollout], list(requests), run, make, warn)
        if rollouts.hit:
            progress.generated(step, len(requests))
        key = rewards_key(CODE_VERSIONS["rewards"], backends.judge, rollouts.ref, rubric=exp.rubric)
        rewards = step_rewards(
            store, exp, key, rollouts, judged, backends.judge, warn, Rewards[LMReward], lambda n: progress.judged(step, n)
        )
        progress.phase(step, "training")
        return Generated(
            rollouts.value,
            rollouts.ref,
            complete_key,
            rewards.value,
            rewards.ref,
            cache={"rollouts": rollouts.cache, "rewards": rewards.cache},
            trials=len(rollouts.attempted),
            judge_calls=len(rewards.attempted),
            seconds=time.monotonic() - t0,
            recovered=recovered(rollouts, rewards),
            judge_seconds=judging[0],
        )

    def _rollouts_key(self, exp: Exp, step: int, behavior: Weights[Checkpoint], items: list, template: str) -> str:
        """What the step's trials depend on, the content of its prompts (`items`, as the source's file
        holds them now) included."""
        return rollouts_key(
            CODE_VERSIONS["rollouts"],
            exp,
            step,
            behavior.ref,
            policy=exp.policy,
            sampling=exp.sampling,
            prompts=content_hash({"items": items, "template": template}),
            **exp.rollout.cache_inputs(),
        )

    def _train(
        self,
        exp: Exp,
        step: int,
        previous: Weights[Checkpoint],
        gen: Generated,
        store: ArtifactStore,
        backends: Backends,
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
                metrics={k: float(v) for k, v in metrics.model_dump().items()},
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
        weights = Weights(step_key(step), ref, _checkpoint(files), stats.version)

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
            _discard_rollouts(store, gen)
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
                        "loss", "ratio", "ratio_max_dev", "logp_max_dev", "logp_mean_dev", "kl", "clip_frac", "grad_norm",
                        "samples_used", "groups_with_signal",
                    )  # fmt: skip
                },
                "policy_lag": float(previous.version - behavior_version),
                "mean_completion_tokens": mean([float(tokens[r.trial_id]) for r in rewards]),
            },
            timings={"generate_s": gen.seconds, "judge_s": gen.judge_seconds, "train_s": time.monotonic() - t0},  # judge_s: of generate_s
            checks=[*step_checks(exp, adapter_finite(weights.payload), rewards, gen.rollouts.n_trials_planned), sampled_as_trained],
        )
        backends.progress.end(step)
        return result, weights

    def _evaluate(
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
        """The step's held-out greedy accuracy, beside the base's and that of the weights step 0
        started from (the warm-up's, when there is one; else the base's)."""
        t0 = time.monotonic()
        with progress.doing(f"step {step_key(step)}: held-out evaluation on {len(prompts.eval)} prompts"):
            scored, ref, hit = self._evaluation(exp, weights, prompts, store)
            base_scored, _, _ = self._evaluation(exp, base, prompts, store)
            start_scored, _, _ = self._evaluation(exp, initial, prompts, store)
        return StepAsset(
            asset="evaluation",
            step=step,
            cache="hit" if hit else "miss",
            ref=ref,
            metadata={
                "accuracy": scored.accuracy,
                "base_accuracy": base_scored.accuracy,
                "start_accuracy": start_scored.accuracy,
                "mean_reward": scored.mean_reward,
                "n_prompts": scored.n,
                "weights_version": weights.version,
                "eval_s": time.monotonic() - t0,
            },
        )

    def _evaluation(self, exp: Exp, weights: Weights[Checkpoint], prompts: PromptSet, store: ArtifactStore) -> tuple[Evaluation, ArtifactRef, bool]:
        key = cache_key(
            "evaluation",
            CODE_VERSIONS["evaluation"],
            weights=weights.ref.content_hash,
            policy=exp.policy,
            prompts=content_hash({"eval": prompts.eval, "template": prompts.template}),  # what is asked, and the references
            rubric=exp.rubric,
            max_new_tokens=exp.eval_max_new_tokens,
        )

        def compute() -> Evaluation:
            counters.bump("evaluations")
            policy = load_policy(exp.policy, weights.payload)
            return evaluate(policy, prompts, exp.rubric, exp.eval_max_new_tokens, weights_hash=weights.ref.content_hash)

        return store.get_or_put("evaluations", key, Evaluation, compute)
