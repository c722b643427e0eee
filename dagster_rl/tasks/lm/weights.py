"""The language model's weights as steps store them, and where step 0's come from: the base model
with a fresh adapter, or the supervised warm-up's adapter (`dagster_rl.tasks.lm.train.warmup`), which
the `<exp>/sft` asset materializes with its held-out accuracy beside the base's."""

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from dagster_rl.base import counters
from dagster_rl.base.hashing import cache_key, canonical_json, content_hash
from dagster_rl.core.task import WarmupResult, Weights
from dagster_rl.store.artifact_store import ArtifactRef, ArtifactStore
from dagster_rl.tasks.lm.backend_protocols import Checkpoint
from dagster_rl.tasks.lm.code_versions import CODE_VERSIONS
from dagster_rl.tasks.lm.data.prompts import PromptSet, load_prompt_set
from dagster_rl.tasks.lm.evaluation import evaluate
from dagster_rl.tasks.lm.experiment import LMExperiment as Exp
from dagster_rl.tasks.lm.model.policy import CHECKPOINT_FILES, checkpoint_bytes, load_policy, read_state
from dagster_rl.tasks.lm.rewards import scorer_of
from dagster_rl.tasks.lm.step_evaluation import evaluation_of
from dagster_rl.tasks.lm.train.warmup import WARMUP, WarmupStats, warm_up


def checkpoint_of(files: dict[str, bytes]) -> Checkpoint:
    """The files a policy loads (not the records stored beside them)."""
    return {k: v for k, v in files.items() if k in CHECKPOINT_FILES}


def stored_weights(partition: str, ref: ArtifactRef, files: dict[str, bytes]) -> Weights[Checkpoint]:
    """Weights read from the store: the checkpoint's files, its version from its state."""
    checkpoint = checkpoint_of(files)
    return Weights(partition, ref, checkpoint, read_state(checkpoint)["version"])


def base_weights(exp: Exp, store: ArtifactStore) -> Weights[Checkpoint]:
    """A fresh adapter (LoRA B = 0: the base model), the same in every run."""
    key = cache_key("weights", CODE_VERSIONS["initial"], policy=exp.policy)
    files, ref, _ = store.get_or_put_files("weights", key, lambda: checkpoint_bytes(load_policy(exp.policy), None))
    return stored_weights("initial", ref, files)


def warmup_weights(exp: Exp, store: ArtifactStore) -> Weights[Checkpoint]:
    files, ref, _ = warmup_files(exp, store)
    return stored_weights("sft", ref, files)


def warmup_files(exp: Exp, store: ArtifactStore) -> tuple[dict[str, bytes], ArtifactRef, bool]:
    """The supervised warm-up's adapter (and its `WarmupStats`), computed once per content key."""
    settings = exp.warmup
    if settings is None:
        raise ValueError(f"experiment {exp.name} has no warmup section")
    # the check that stops it at a target accuracy scores like the held-out evaluation
    # (its verifier's version too, where it is not the number rule: {} for every run before there were others;
    # its greedy completions are the evaluation's: keyed by the evaluation's code version)
    scorer = scorer_of(exp).without_functions()  # accuracy alone: the functions' terms are no part of it
    check = (
        {
            "rubric": exp.rubric,
            "max_new_tokens": exp.eval_max_new_tokens,
            "evaluation": CODE_VERSIONS["evaluation"],
            **scorer.key_inputs(),
        }
        if settings.target_accuracy
        else None
    )
    prompts = load_prompt_set(exp.task.source, exp.seed)
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
            return evaluate(policy, held, scorer, exp.eval_max_new_tokens).accuracy

        with torch_threads(exp.trainer.threads_per_process):  # a training job, sized like the trainer's
            files, stats = warm_up(load_policy(exp.policy), prompts.train, prompts.template, settings, exp.seed, accuracy)
        return {**files, WARMUP: canonical_json(stats)}

    return store.get_or_put_files("weights", key, compute)


def warmup_result(exp: Exp, store: ArtifactStore) -> WarmupResult:
    """The `<exp>/sft` asset: the warm-up (computed, or found in the store) and its held-out
    greedy accuracy beside the base's."""
    t0 = time.monotonic()
    files, ref, hit = warmup_files(exp, store)
    stats = WarmupStats.model_validate_json(files[WARMUP])
    prompts = load_prompt_set(exp.task.source, exp.seed)
    sft, _, _ = evaluation_of(exp, stored_weights("sft", ref, files), prompts, store)
    base, _, _ = evaluation_of(exp, base_weights(exp, store), prompts, store)
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


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with `n` torch threads (the process's setting is restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
