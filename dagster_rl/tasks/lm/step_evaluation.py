"""A step's held-out evaluation (the `<exp>/evaluation` asset): greedy accuracy of its weights
beside the base's and the starting weights', each stored under a key of what it scores."""

import time

from dagster_rl.base import counters
from dagster_rl.base.hashing import cache_key, content_hash
from dagster_rl.core.experiment import step_key
from dagster_rl.core.progress import Progress
from dagster_rl.core.task import StepAsset, Weights
from dagster_rl.store.artifact_store import ArtifactRef, ArtifactStore
from dagster_rl.tasks.lm.backend_protocols import Checkpoint
from dagster_rl.tasks.lm.code_versions import CODE_VERSIONS
from dagster_rl.tasks.lm.data.prompts import PromptSet
from dagster_rl.tasks.lm.evaluation import Evaluation, evaluate
from dagster_rl.tasks.lm.experiment import LMExperiment as Exp
from dagster_rl.tasks.lm.model.policy import load_policy
from dagster_rl.tasks.lm.rewards import scorer_of


def evaluate_step(
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
        scored, ref, hit = evaluation_of(exp, weights, prompts, store)
        base_scored, _, _ = evaluation_of(exp, base, prompts, store)
        start_scored, _, _ = evaluation_of(exp, initial, prompts, store)
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


def evaluation_of(
    exp: Exp, weights: Weights[Checkpoint], prompts: PromptSet, store: ArtifactStore
) -> tuple[Evaluation, ArtifactRef, bool]:
    scorer = scorer_of(exp)  # made once: the functions' sources the key names are the ones it runs
    key = cache_key(
        "evaluation",
        CODE_VERSIONS["evaluation"],
        weights=weights.ref.content_hash,
        policy=exp.policy,
        prompts=content_hash({"eval": prompts.eval, "template": prompts.template}),  # what is asked, and the references
        rubric=exp.rubric,
        max_new_tokens=exp.eval_max_new_tokens,
        **scorer.key_inputs(),  # the verifier's version, the functions' sources: none for the built-in rubric
    )

    def compute() -> Evaluation:
        counters.bump("evaluations")
        policy = load_policy(exp.policy, weights.payload)
        return evaluate(policy, prompts, scorer, exp.eval_max_new_tokens, weights_hash=weights.ref.content_hash)

    return store.get_or_put("evaluations", key, Evaluation, compute)
