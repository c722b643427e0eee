"""The language-model loop: generate, judge, train, evaluate, cached by content.

With `max_policy_lag: k` step n is sampled by the weights of step n-1-k (`behavior_step`; the
initial weights for n <= k): a thread generates the steps in order, each as soon as its behavior
weights exist, so up to k steps are generated (or wait, generated) while step n trains. The loss
corrects for the stale behavior policy with its clipped importance ratio, and with the corrections
of `grpo.decoupled` and `grpo.mismatch` when set (`lm.train.corrections`). Every step's rollouts are
stored as they are generated, keyed by the weights that sampled them: a range that stops (a crash, a
kill) and resumes walks back to the weights its first steps are sampled by, finds the rollouts of the
steps generated ahead in the store, and generates the others again, to the same bytes. Held-out
evaluation of step k runs in another thread and is awaited after step k+1 trains.

With a `warmup` section, step 0 starts from the supervised warm-up's adapter
(`dagster_rl.tasks.lm.weights`, the `<exp>/sft` asset), stored under a key of everything it depends on; with `grpo.kl_reference: sft`
the KL term's reference is that adapter, else the original base.

Every step reports its `on_policy` check: where the behavior policy is the trained policy, the
trainer's log-probability of each sampled token must equal the sampler's within the dtype's
tolerance, and so must the trainer's recomputation of the behavior weights' (at a lag, with
`grpo.mismatch`). A step that fails it has its rollouts moved aside (and those of the steps generated
ahead by the same sampler), so that a re-run after the fix samples them again.

A step's generation and judging are `step_generation`'s, its held-out evaluation
`step_evaluation`'s; this module pipelines them around the update it trains.
"""

import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from safetensors.torch import load as load_safetensors

from dagster_rl.base.hashing import canonical_json
from dagster_rl.core.checks import CheckOutcome, on_policy, step_checks, weights_finite
from dagster_rl.core.experiment import step_key
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

CORRECTION_METRICS = ("mismatch_capped_frac", "mismatch_weight", "decoupled_masked_frac", "decoupled_weight")


def behavior_step(step: int, lag: int) -> int:
    """The step whose trained weights sample step `step` at `max_policy_lag: lag`: step - 1 - lag, the
    newest weights at most `lag` steps older than those step `step` trains from, or -1 (the weights
    the experiment starts from) for its first lag + 1 steps. A function of the experiment alone, so a
    resumed range samples every step with the weights an uninterrupted one did, and finds the
    rollouts that range stored before it stopped."""
    return max(step - 1 - lag, -1)


class LMTrainStats(TrainedFrom):
    version: int
    metrics: dict[str, float]


def adapter_finite(checkpoint: Checkpoint) -> CheckOutcome:
    """The `weights_finite` check of a step's checkpoint: every adapter tensor holds finite numbers."""
    tensors = load_safetensors(checkpoint[ADAPTER])
    bad = sorted(name for name, t in tensors.items() if t.is_floating_point() and not bool(t.isfinite().all()))
    message = f"all {len(tensors)} tensors finite" if not bad else f"non-finite values in {bad[:5]}"
    return weights_finite(len(bad), message)


def function_means(rewards: list) -> dict[str, float]:
    """`reward_<name>`: the mean of each reward function's values (as it returned them, unweighted) over
    the step's trials it had an opinion on, as TRL logs `rewards/<name>/mean`; none where it had none
    (nor for a task whose rewards have no functions: the agent's, which trains through this loop)."""
    by_trial = [getattr(r, "functions", {}) for r in rewards]
    means = {}
    for name in dict.fromkeys(name for functions in by_trial for name in functions):
        values = [v for functions in by_trial if (v := functions.get(name)) is not None]
        if values:
            means[f"reward_{name}"] = mean(values)
    return means


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
        """The weights that step `step + 1`'s weights (`weights`) were trained from, step `step`'s:
        the behavior policy of a lagged step. Step -1's are the initial weights."""
        if step < 0:
            return self.initial_weights(exp, store)
        stats = LMTrainStats.model_validate_json(store.get("weights", weights.ref.key, STATS))
        return self.load_weights(exp, store, step_key(step), stats.prev_weights_key)

    def prompt_set(self, exp: Exp) -> PromptSet:
        """What a step's prompts and the held-out ones are drawn from."""
        return load_prompt_set(exp.task.source, exp.seed)

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
        weights = self._weights_before(exp, store, start, first, lag)  # step -> the weights it produced; -1: initial
        with backends.progress.doing(f"{exp.name}: loading the base model and the initial weights"):
            base = base_weights(exp, store)
            initial = self.initial_weights(exp, store)
        reference = initial if exp.grpo.kl_reference == "sft" else None

        def behavior(k: int) -> Weights[Checkpoint]:
            return weights[behavior_step(k, lag)]

        generating: dict[int, Future[Generated]] = {}  # steps generated ahead, in step order, by one thread
        ahead = first  # the next step to generate

        def generate_ready(trained: int) -> None:
            """Queue every step whose behavior weights exist now that step `trained` has trained: at most `lag` ahead."""
            nonlocal ahead
            while ahead <= last and behavior_step(ahead, lag) <= trained:
                generating[ahead] = gen_pool.submit(self.generate, exp, ahead, behavior(ahead), prompts, store, backends, warn)
                ahead += 1

        threads = torch.get_num_threads()
        torch.set_num_threads(exp.generation_threads)
        gen_pool = ThreadPoolExecutor(1, "generate")
        try:
            with ThreadPoolExecutor(1, "evaluate") as eval_pool:
                evaluating = list[Future[StepAsset]]()
                generate_ready(first - 1)
                for k in steps:
                    gen = generating.pop(k).result()
                    result, weights[k] = self._train(exp, k, weights[k - 1], gen, store, backends, reference, behavior(k))
                    if not _passed(result, "on_policy"):  # the steps generated ahead were sampled by the same sampler
                        for later, pending in sorted(generating.items()):
                            if pending.cancel():  # not started: nothing sampled
                                continue
                            try:
                                discard_rollouts(store, pending.result())
                            except Exception as e:  # its generation failed: nothing of it to discard
                                warn(f"step {step_key(later)}'s generation failed too: {e!r}")
                    passed = all(c.passed for c in result.checks)
                    if passed:
                        generate_ready(k)
                    for done in [j for j in weights if j < behavior_step(k + 1, lag)]:
                        del weights[done]  # neither trained from nor the behavior of a step to come
                    yield result
                    if not passed:  # a failed blocking check ends the range (the driver stops there too)
                        return
                    while evaluating:  # evaluation of step k-1 is awaited after step k trains
                        yield evaluating.pop(0).result()
                    evaluating.append(
                        eval_pool.submit(self.evaluate, exp, k, weights[k], base, initial, prompts, store, backends.progress)
                    )
                for pending_eval in evaluating:
                    yield pending_eval.result()
        finally:
            # a range that ends early (a failure, a crash, the run cancelled) starts no queued generation; one that runs
            # ends and stores its rollouts, which a resumed range finds
            gen_pool.shutdown(wait=True, cancel_futures=True)
            torch.set_num_threads(threads)

    def _weights_before(
        self, exp: Exp, store: ArtifactStore, start: Weights[Checkpoint], first: int, lag: int
    ) -> dict[int, Weights[Checkpoint]]:
        """The weights a range starting at step `first` needs before it trains: those it starts from
        (`start`, step first - 1's) and, walking back the chain of weights each was trained from, those
        that sample its first steps (down to step `behavior_step(first, lag)`'s; -1: the initial ones)."""
        weights = {first - 1: start}
        for j in range(first - 2, behavior_step(first, lag) - 1, -1):
            weights[j] = self._trained_from(exp, store, weights[j + 1], j)
        return weights

    def _train(
        self,
        exp: Exp,
        step: int,
        previous: Weights[Checkpoint],
        gen: Generated,
        store: ArtifactStore,
        backends: LMBackends,
        reference: Weights[Checkpoint] | None,
        behavior: Weights[Checkpoint] | None = None,
    ) -> tuple[StepResult, Weights[Checkpoint]]:
        """Train step `step` from `previous`; `reference`: the KL term's reference adapter (None: the base);
        `behavior`: the weights that sampled the step's rollouts (`grpo.mismatch` recomputes their
        log-probs where they are not `previous`)."""
        t0 = time.monotonic()

        # rollouts the weights being trained sampled (every step at lag 0, steps 0..lag at a lag): the ratio's old policy
        # is the trainer's own log-probs, so the update does not depend on the sampler's float noise; stale ones: the
        # sampler's, or, with grpo.mismatch, the trainer's recomputation with the behavior weights
        sampled_by_previous = gen.rollouts.behavior_policy.get("content_hash") == previous.ref.content_hash
        recompute = exp.grpo.mismatch is not None and not sampled_by_previous
        if recompute and (behavior is None or behavior.ref.content_hash != gen.rollouts.behavior_policy.get("content_hash")):
            raise ValueError(f"step {step_key(step)}: grpo.mismatch needs the weights that sampled its rollouts")

        def train() -> dict[str, bytes]:
            if exp.faults.step_delay_s:  # fault injection: a step slow enough to be killed in the middle
                time.sleep(exp.faults.step_delay_s)
            files, metrics = backends.trainer.train(
                exp,
                previous.payload,
                gen.rollouts.trajectories,
                gen.rewards.rewards,
                reference=reference.payload if reference is not None else None,
                old_logp="trainer" if sampled_by_previous else "sampler",
                behavior=behavior.payload if recompute and behavior is not None else None,
            )
            stats = LMTrainStats(
                **trained_from(exp, step, previous, gen.rewards_ref),
                version=metrics.version,
                metrics={k: float(v) for k, v in metrics.model_dump(exclude_none=True).items()},
            )
            return {**files, STATS: canonical_json(stats)}

        key = weights_key(
            CODE_VERSIONS["weights"],
            exp,
            previous.ref,
            gen.rewards_ref,
            grpo=exp.grpo.cache_inputs(),
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
            recomputed=recompute,
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
                **{k: v for k, v in stats.metrics.items() if k in CORRECTION_METRICS},
                "policy_lag": float(previous.version - behavior_version),
                "behavior_step": float(behavior_step(step, exp.max_policy_lag)),
                "mean_completion_tokens": mean([float(tokens[r.trial_id]) for r in rewards]),
                **function_means(rewards),
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
