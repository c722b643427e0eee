"""The batched trainer: packing, micro-batches under a token budget, and gradients equal to the
per-sample computation to float rounding."""

import pytest
import torch

from dagster_rl.tasks.lm.model.logprobs import completion_logprobs, pack
from dagster_rl.tasks.lm.model.policy import checkpoint_bytes, make_optimizer
from dagster_rl.tasks.lm.settings import GRPOLMSettings
from dagster_rl.tasks.lm.train.grpo_loss import grpo_batch_loss, grpo_sample_loss
from dagster_rl.tasks.lm.train.trainer import TrainSample, build_samples, micro_batches, plan_micro_batches, train_step
from tests.lm_fixtures import GRPO, assert_within_summation_bound, fresh_policy, gradient_terms, positions, step_batch

STALE = GRPOLMSettings(**{**GRPO.model_dump(), "kl_beta": 0.5, "clip_eps": 0.05})


def test_pack_right_pads_and_marks_the_positions_that_predict_completion_tokens():
    batch = pack([[5, 6, 7], [8]], [[9, 10], [11, 12, 13]], [1.0, 0.5], pad_id=0, device="cpu")
    assert batch.input_ids.tolist() == [[5, 6, 7, 9, 10], [8, 11, 12, 13, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    # position t predicts token t + 1: row 0's completion starts at 3, predicted from 2 and 3
    assert batch.predicts.tolist() == [[False, False, True, True, False], [True, True, True, False, False]]
    assert batch.targets.tolist() == [[9, 10, 0], [11, 12, 13]]
    assert batch.completion_mask.tolist() == [[True, True, False], [True, True, True]]
    assert batch.temperature.tolist() == [1.0, 0.5] and batch.tokens == 10
    with pytest.raises(ValueError, match="completion token"):
        pack([[1]], [[]], [1.0], 0, "cpu")


def _sample(prompt: int, completion: int, i: int = 0) -> TrainSample:
    return TrainSample(f"t{i}", [1] * prompt, [2] * completion, [-1.0] * completion, 1.0, 0.0)


def test_micro_batches_stay_under_the_token_budget_and_cover_every_sample_once():
    samples = [_sample(p, c, i) for i, (p, c) in enumerate([(10, 3), (4, 1), (12, 8), (5, 5), (3, 2), (30, 30), (9, 9)])]
    batches = micro_batches(samples, budget=40)
    assert sorted(i for b in batches for i in b) == list(range(len(samples)))
    for b in batches:
        width = max(len(samples[i].prompt_ids) + len(samples[i].completion_ids) for i in b)
        assert len(b) * width <= 40 or len(b) == 1  # a sequence longer than the budget goes alone
    assert [5] in batches  # 60 tokens: alone
    assert micro_batches(samples, budget=10**6) == [
        sorted(range(7), key=lambda i: (len(samples[i].prompt_ids) + len(samples[i].completion_ids), i))
    ]
    assert all(len(b) == 1 for b in micro_batches(samples, budget=1))
    assert micro_batches(samples, 40) == micro_batches(list(samples), 40)  # a pure function of the samples


def test_batched_loss_equals_the_per_sample_loss_row_by_row():
    torch.manual_seed(0)
    lengths = [3, 1, 5]
    new = torch.randn(3, 5) * 0.3 - 1.0
    old = new + torch.randn(3, 5) * 0.2
    ref = new + torch.randn(3, 5) * 0.1
    mask = torch.arange(5)[None] < torch.tensor(lengths)[:, None]
    adv = torch.tensor([1.5, -0.7, 0.0])
    new_b = new.clone().requires_grad_(True)
    loss, stats = grpo_batch_loss(new_b, old.masked_fill(~mask, 0), ref.masked_fill(~mask, 0), mask, adv, 0.2, 0.3)
    loss.sum().backward()
    devs = []
    for i, n in enumerate(lengths):
        row = new[i, :n].clone().requires_grad_(True)
        one, st = grpo_sample_loss(row, old[i, :n], ref[i, :n], float(adv[i]), 0.2, 0.3)
        one.backward()
        assert float(loss.detach()[i]) == pytest.approx(float(one.detach()), rel=1e-6, abs=1e-7)
        assert (float(stats.ratio[i]), float(stats.kl[i]), float(stats.clip_frac[i])) == pytest.approx(
            (st.ratio, st.kl, st.clip_frac), rel=1e-6
        )
        torch.testing.assert_close(new_b.grad[i, :n], row.grad, rtol=1e-6, atol=1e-8)
        assert torch.all(new_b.grad[i, n:] == 0)  # padding gets no gradient
        devs.append(st.ratio_max_dev)
    assert float(stats.ratio_max_dev) == pytest.approx(max(devs), rel=1e-6) and max(devs) > 0.05


@pytest.fixture(scope="module")
def stale_batch(tiny_dir):
    """A v1 checkpoint and the v0 batch it was trained on: stale now (ratio != 1, KL > 0, clipping)."""
    policy = fresh_policy(tiny_dir)
    optimizer = make_optimizer(policy, STALE)
    rollouts, rewards = step_batch(policy, step=0, prompts=4, samples=3)
    samples, facts = build_samples(rollouts, rewards, STALE.advantage_eps)
    train_step(policy, optimizer, samples, len(samples), STALE, facts)
    return checkpoint_bytes(policy, optimizer), samples, facts


def _per_sample_gradient(tiny_dir, files, samples):
    """The definition: each sample alone, unpadded, its loss scaled by 1/N, one backward each."""
    policy = fresh_policy(tiny_dir, files)
    policy.model.train()
    losses = []
    for s in samples:
        with torch.no_grad(), policy.model.disable_adapter():
            ref = completion_logprobs(policy.model, s.prompt_ids, s.completion_ids, s.temperature)
        new = completion_logprobs(policy.model, s.prompt_ids, s.completion_ids, s.temperature)
        loss, stats = grpo_sample_loss(new, torch.tensor(s.old_logp), ref, s.advantage, STALE.clip_eps, STALE.kl_beta)
        (loss / len(samples)).backward()
        losses.append(stats)
    return {n: p.grad.clone() for n, p in policy.trainable()}, losses


@pytest.mark.parametrize(
    "budget,checkpointing",
    [(1, False), (64, False), (10**6, False), (64, True)],
    ids=["one-sample-each", "a-few-each", "one-micro-batch", "a-few-each-recomputed"],
)
@pytest.mark.numerics
def test_micro_batched_gradient_equals_the_per_sample_gradient(tiny_dir, stale_batch, budget, checkpointing, record_property):
    files, samples, facts = stale_batch
    expected, per_sample = _per_sample_gradient(tiny_dir, files, samples)
    policy = fresh_policy(tiny_dir, files)
    grpo = STALE.model_copy(update={"micro_batch_tokens": budget, "activation_checkpointing": checkpointing})
    grads = {}
    with gradient_terms(policy) as terms:
        metrics = train_step(
            policy, make_optimizer(policy, grpo, files), samples, len(samples), grpo, facts, on_grads=grads.update
        )
    n_batches = len(micro_batches(samples, budget))
    assert n_batches == {1: len(samples), 10**6: 1}.get(budget, n_batches) and (budget != 64 or 1 < n_batches < len(samples))
    assert sum(float(g.norm()) for g in grads.values()) > 1e-3
    # the same per-position terms summed in another order: micro-batches vs one sample at a time
    worst = assert_within_summation_bound(grads, expected, terms, positions(samples))
    record_property("grad_diff", f"{worst:.2f}/{positions(samples) - 1} eps32*sum|terms|")
    n = len(samples)
    assert metrics.loss == pytest.approx(sum(s.loss for s in per_sample) / n, rel=1e-5)
    assert metrics.ratio == pytest.approx(sum(s.ratio for s in per_sample) / n, rel=1e-6)
    assert metrics.kl == pytest.approx(sum(s.kl for s in per_sample) / n, rel=1e-5)
    assert metrics.clip_frac == pytest.approx(sum(s.clip_frac for s in per_sample) / n, rel=1e-6)
    assert metrics.ratio_max_dev == pytest.approx(max(s.ratio_max_dev for s in per_sample), rel=1e-5)
    assert metrics.kl > 0 and metrics.clip_frac > 0 and metrics.ratio_max_dev > STALE.clip_eps
    assert policy.model.get_base_model().is_activation_checkpointing == checkpointing
    print(
        f"budget {budget}, checkpointing {checkpointing}: {n_batches} micro-batches, worst |grad - per-sample grad| {worst:.2f} eps32 sum|terms|"
    )


def test_the_same_plan_trains_the_same_bytes(tiny_dir, stale_batch):
    files, samples, facts = stale_batch
    grpo = STALE.model_copy(update={"micro_batch_tokens": 64})
    out = []
    for _ in range(2):
        policy = fresh_policy(tiny_dir, files)
        optimizer = make_optimizer(policy, grpo, files)
        metrics = train_step(policy, optimizer, samples, len(samples), grpo, facts)
        out.append((metrics, checkpoint_bytes(policy, optimizer)))
    assert out[0] == out[1]


def test_on_policy_the_update_does_not_depend_on_the_samplers_float_noise(tiny_dir):
    """With the trainer's own log-probs as the ratio's old policy (rollouts the trained weights
    sampled), log-probs the sampler rounded otherwise train the same bytes; `logp_max_dev` still
    measures the sampler against the trainer. With the sampler's as the old policy, they do not."""
    from dataclasses import replace

    policy = fresh_policy(tiny_dir)
    rollouts, rewards = step_batch(policy, step=0, prompts=4, samples=3)
    samples, facts = build_samples(rollouts, rewards, GRPO.advantage_eps)
    noisy = [
        replace(s, old_logp=[x + 2e-6 * (-1) ** i for i, x in enumerate(s.old_logp)]) for s in samples
    ]  # a server's batch shapes; above float32's spacing at these log-probs (4.8e-7 near -5), which a CPU's kernels already differ by

    def trained(batch, old_logp):
        p = fresh_policy(tiny_dir)
        optimizer = make_optimizer(p, GRPO)
        metrics = train_step(p, optimizer, batch, len(batch), GRPO, facts, old_logp=old_logp)
        return checkpoint_bytes(p, optimizer), metrics

    (clean, m_clean), (heard, m_heard) = trained(samples, "trainer"), trained(noisy, "trainer")
    assert clean == heard
    assert (m_clean.ratio, m_clean.ratio_max_dev) == (1.0, 0.0)
    assert m_heard.logp_max_dev > m_clean.logp_max_dev and m_heard.logp_max_dev >= 1e-6  # the check still sees the sampler
    assert trained(samples, "sampler")[0] != trained(noisy, "sampler")[0]  # the sampler's noise enters the update
    with pytest.raises(ValueError, match="old_logp"):
        train_step(policy, make_optimizer(policy, GRPO), samples, len(samples), GRPO, facts, old_logp="behavior")


def _padded(lengths: list[int], runs: list[tuple[int, int]]) -> int:
    return sum((end - start) * lengths[end - 1] - sum(lengths[start:end]) for start, end in runs)


def _fits(lengths: list[int], budget: int, runs: list[tuple[int, int]]) -> bool:
    return all(e - s == 1 or (e - s) * lengths[e - 1] <= budget for s, e in runs)


def _all_cuts(n: int):
    """Every cut of n ascending lengths into runs [start, end)."""
    for mask in range(2 ** max(n - 1, 0)):
        bounds = [0, *(i + 1 for i in range(n - 1) if mask >> i & 1), n]
        yield list(zip(bounds, bounds[1:], strict=False))


def test_micro_batches_are_as_few_as_fit_and_pad_the_least_among_those():
    """Against every cut of small random batches: no cut that fits the budget has fewer runs, and
    none with as few runs pads less; a run of one fits whatever its length."""
    import random

    rng = random.Random(0)
    for _ in range(200):
        n, budget = rng.randint(1, 9), rng.randint(5, 60)
        lengths = sorted(rng.randint(1, 20) for _ in range(n))
        runs = plan_micro_batches(lengths, budget)
        assert [i for s, e in runs for i in range(s, e)] == list(range(n))
        assert _fits(lengths, budget, runs)
        best = min((len(c), _padded(lengths, c)) for c in _all_cuts(n) if _fits(lengths, budget, c))
        assert (len(runs), _padded(lengths, runs)) == best, (lengths, budget, runs)
    with pytest.raises(ValueError, match="ascending"):
        plan_micro_batches([3, 2], 10)


def test_the_padded_share_is_reported(tiny_dir, stale_batch):
    files, samples, facts = stale_batch
    grpo = STALE.model_copy(update={"micro_batch_tokens": 64})
    policy = fresh_policy(tiny_dir, files)
    metrics = train_step(policy, make_optimizer(policy, grpo, files), samples, len(samples), grpo, facts)
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in samples]
    batches = micro_batches(samples, 64)
    total = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    assert metrics.pad_share == pytest.approx((total - sum(lengths)) / total, abs=1e-12)
    assert 0.0 <= metrics.pad_share < 0.5


def test_at_kl_beta_0_the_reference_forward_is_skipped_and_the_same_bytes_are_trained(tiny_dir, stale_batch, monkeypatch):
    """Nothing the update computes depends on the reference at kl_beta 0 but the KL it reports: it
    skips the reference forward, reports `kl` as not computed (None), and trains the adapter and
    optimizer state the reference forward would have trained, byte for byte."""
    from dagster_rl.tasks.lm.train import trainer

    files, samples, facts = stale_batch
    grpo = STALE.model_copy(update={"kl_beta": 0.0, "micro_batch_tokens": 64})
    forwards = []
    counted = trainer.packed_logprobs

    def counting(model, batch):
        forwards.append(torch.is_grad_enabled())
        return counted(model, batch)

    monkeypatch.setattr(trainer, "packed_logprobs", counting)

    def trained():
        policy = fresh_policy(tiny_dir, files)
        optimizer = make_optimizer(policy, grpo, files)
        metrics = train_step(policy, optimizer, samples, len(samples), grpo, facts)
        return metrics, checkpoint_bytes(policy, optimizer)

    skipped, skipped_files = trained()
    n_batches = len(micro_batches(samples, 64))
    assert forwards == [True] * n_batches and n_batches > 1  # no no-grad (reference) forward
    assert skipped.kl is None and "kl" not in skipped.model_dump(exclude_none=True)
    forwards.clear()
    monkeypatch.setattr(trainer, "reference_needed", lambda grpo: True)
    computed, computed_files = trained()
    assert forwards == [False] * n_batches + [True] * n_batches
    assert computed.kl is not None and computed.kl > 0
    assert computed_files == skipped_files
    assert computed.model_dump(exclude={"kl"}) == skipped.model_dump(exclude={"kl"})
