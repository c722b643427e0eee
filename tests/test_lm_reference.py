"""The KL term's reference: the base (adapter off) or another adapter (the warm-up's), switched in place."""

import pytest
import torch
from safetensors.torch import load_file

from dagster_rl.tasks.lm.model.policy import checkpoint_bytes, make_optimizer, save_checkpoint
from dagster_rl.tasks.lm.settings import GRPOLMSettings
from dagster_rl.tasks.lm.train.entrypoint import GRADS, METRICS, TrainBatch, TrainJob, launch_torchrun, write_job
from dagster_rl.tasks.lm.train.reference import adapter_reference, base_reference
from dagster_rl.tasks.lm.train.trainer import TrainMetrics, build_samples, train_step
from tests.lm_fixtures import (
    EPS32,
    GRPO,
    ON_POLICY_ROUNDING,
    assert_within_summation_bound,
    fresh_policy,
    gradient_terms,
    policy_settings,
    positions,
    run,
    step_batch,
)

KL_GRPO = GRPOLMSettings(**{**GRPO.model_dump(), "kl_beta": 0.5})
IDS = torch.tensor([[5, 6, 7, 8, 9]])


def _trained(tiny_dir, steps: int = 1) -> dict[str, bytes]:
    policy = fresh_policy(tiny_dir)
    optimizer = make_optimizer(policy, GRPO)
    for step in range(steps):
        rollouts, rewards = step_batch(policy, step)
        samples, facts = build_samples(rollouts, rewards, GRPO.advantage_eps)
        train_step(policy, optimizer, samples, len(samples), GRPO, facts)
    return checkpoint_bytes(policy, optimizer)


@pytest.fixture(scope="module")
def warm(tiny_dir):
    """An adapter one step away from the base: the stand-in for a warm-up's."""
    return _trained(tiny_dir)


def logits(policy) -> torch.Tensor:
    with torch.no_grad():
        return policy.model(input_ids=IDS).logits


def test_switching_to_the_reference_adapter_and_back_leaves_the_trained_one_as_it_was(tiny_dir, warm):
    policy = fresh_policy(tiny_dir)  # the trained adapter: fresh (the base)
    trainable = [(n, p.data.clone()) for n, p in policy.trainable()]
    reference = adapter_reference(policy, warm)
    assert [n for n, _ in policy.trainable()] == [n for n, _ in trainable]  # the reference is frozen
    own = logits(policy)
    with reference():
        as_reference = logits(policy)
    torch.testing.assert_close(as_reference, logits(fresh_policy(tiny_dir, warm)), rtol=0, atol=0)
    assert not torch.equal(as_reference, own)
    assert torch.equal(logits(policy), own)  # switched back
    assert [n for n, _ in policy.trainable()] == [n for n, _ in trainable]
    assert all(torch.equal(p, saved) for (_, p), (_, saved) in zip(policy.trainable(), trainable, strict=True))
    with base_reference(policy)():
        assert torch.equal(logits(policy), own)  # a fresh adapter is the base


@pytest.mark.numerics
def test_kl_to_a_reference_equal_to_the_policy_is_zero_and_to_the_base_is_not(tiny_dir, warm):
    policy = fresh_policy(tiny_dir, warm)
    rollouts, rewards = step_batch(policy, step=3)
    samples, facts = build_samples(rollouts, rewards, KL_GRPO.advantage_eps)
    to_itself = train_step(
        policy,
        make_optimizer(policy, KL_GRPO, warm),
        samples,
        len(samples),
        KL_GRPO,
        facts,
        reference=adapter_reference(policy, warm),
    )
    again = fresh_policy(tiny_dir, warm)
    to_base = train_step(again, make_optimizer(again, KL_GRPO, warm), samples, len(samples), KL_GRPO, facts)
    assert to_itself.kl == 0.0 and to_base.kl > 0.0
    # on-policy: the same policy forward in both (the reference changes the KL term only), and a ratio of
    # 1 up to the sampler's rounding against the trainer's (a mean of token ratios lies within their
    # largest deviation, plus the mean's own rounding, eps32)
    assert to_itself.ratio == to_base.ratio and to_itself.ratio_max_dev == to_base.ratio_max_dev < ON_POLICY_ROUNDING
    assert abs(to_itself.ratio - 1.0) <= to_itself.ratio_max_dev + EPS32


@pytest.mark.numerics
def test_two_rank_step_with_a_reference_adapter_equals_single_process(tiny_dir, warm, tmp_path, record_property):
    """The reference adapter is added before DDP wraps the model; its switches happen outside DDP's forward."""
    current = _trained(tiny_dir, steps=2)
    policy = fresh_policy(tiny_dir, current)
    rollouts, rewards = step_batch(policy, step=5, prompts=3, samples=2)
    batch = TrainBatch(rollouts=rollouts, rewards=rewards)
    (tmp_path / "batch.json").write_text(batch.model_dump_json())
    job = TrainJob(
        policy=policy_settings(tiny_dir),
        grpo=KL_GRPO,
        input_checkpoint=str(save_checkpoint(tmp_path / "input", current)),
        reference_checkpoint=str(save_checkpoint(tmp_path / "reference", warm)),
        batch=str(tmp_path / "batch.json"),
        output_dir=str(tmp_path / "out"),
        dump_grads=True,
    )
    run(launch_torchrun(write_job(job, tmp_path / "job.json"), nproc_per_node=2), timeout=180)
    dist = TrainMetrics.model_validate_json((tmp_path / "out" / METRICS).read_text())
    dist_grads = load_file(str(tmp_path / "out" / GRADS))

    grads = {}
    samples, facts = build_samples(rollouts, rewards, KL_GRPO.advantage_eps)
    with gradient_terms(policy) as terms:
        single = train_step(
            policy,
            make_optimizer(policy, KL_GRPO, current),
            samples,
            len(samples),
            KL_GRPO,
            facts,
            on_grads=grads.update,
            reference=adapter_reference(policy, warm),
        )
    assert dist.world_size == 2 and dist.kl > 0.0
    for field in ("loss", "ratio", "kl", "grad_norm"):
        assert getattr(dist, field) == pytest.approx(getattr(single, field), rel=1e-5, abs=1e-8), field
    assert set(dist_grads) == set(grads)  # only the trained adapter has gradients, on every rank
    worst = assert_within_summation_bound(dist_grads, grads, terms, positions(samples))  # summation order alone (test_lm_ddp)
    record_property("grad_diff", f"{worst:.2f}/{positions(samples) - 1} eps32*sum|terms|")
