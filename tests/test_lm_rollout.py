"""Seeded rollouts, and the exact on-policy ratio."""

import torch

from dagster_rl.lm.logprobs import completion_logprobs
from dagster_rl.lm.policy import make_optimizer
from dagster_rl.lm.records import plan_requests
from dagster_rl.lm.rollout_hf import generate_rollouts
from dagster_rl.lm.sampling import choose_token, choose_tokens, uniforms
from dagster_rl.lm.prompts import SyntheticPrompts, load_prompt_set, prompts_for_step
from dagster_rl.lm.trainer import build_samples, train_step
from tests.lm_fixtures import GRPO, SAMPLING, fresh_policy, step_batch, tiny_dir  # noqa: F401


def test_retried_rollout_is_token_identical_in_any_batch(tiny_dir):
    policy = fresh_policy(tiny_dir)
    ps = load_prompt_set(SyntheticPrompts(ops=("copy", "add", "last"), n_eval=10))
    requests = plan_requests(prompts_for_step(ps.train, 11, 3, 6), seed=11, step=3, n_samples=4)
    first = {r.trial_id: r for r in generate_rollouts(policy, requests, SAMPLING, ps.template)}
    # the retry: a few of the trials, another order, other batch sizes, other neighbours (other prompt lengths)
    others = plan_requests(prompts_for_step(ps.train, 99, 0, 5), seed=99, step=0, n_samples=2)
    retry_requests = [requests[7], others[0], requests[0], others[3], requests[21], requests[13]]
    retried = generate_rollouts(policy, retry_requests, SAMPLING, ps.template, batch_size=4)
    for r in retried:
        if r.trial_id in first and r.seed == first[r.trial_id].seed:
            assert r == first[r.trial_id]  # tokens, text and log-probs
    assert sum(r.trial_id in first for r in retried) == 4
    # different seeds do sample differently
    assert len({tuple(r.completion_token_ids) for r in first.values()}) > 12


def test_first_on_policy_step_has_ratio_exactly_one_and_kl_exactly_zero(tiny_dir):
    policy = fresh_policy(tiny_dir)
    optimizer = make_optimizer(policy, GRPO)
    rollouts, rewards = step_batch(policy, step=0)
    samples, facts = build_samples(rollouts, rewards, GRPO.advantage_eps)
    assert facts["groups_with_signal"] >= 1
    m0 = train_step(policy, optimizer, samples, len(samples), GRPO, facts)
    assert m0.ratio == 1.0 and m0.kl == 0.0 and m0.clip_frac == 0.0
    assert m0.grad_norm > 0 and m0.samples_used == len(rollouts) == 16

    # next step, on-policy again with the moved adapter: ratio still exactly 1, KL now > 0
    rollouts, rewards = step_batch(policy, step=1)
    r = rollouts[0]
    policy.model.train()
    new = completion_logprobs(policy.model, r.prompt_token_ids, r.completion_token_ids, r.temperature)
    assert new.tolist() == r.sampling_logprobs and new.requires_grad
    samples, facts = build_samples(rollouts, rewards, GRPO.advantage_eps)
    m1 = train_step(policy, optimizer, samples, len(samples), GRPO, facts)
    assert m1.ratio == 1.0 and m1.kl > 0.0 and m1.version == 2


def test_vectorized_sampling_draws_each_row_as_alone():
    """choose_tokens over a batch (a subset of rows active) gives every row the token choose_token gives it alone,
    and a row's uniforms drawn up front are the ones it would draw one token at a time."""
    torch.manual_seed(0)
    for temperature, top_p in ((1.0, 1.0), (0.7, 0.9), (1.3, 0.3), (0.0, 1.0)):
        logits = torch.randn(9, 3, 68)[:, -1] * 3  # a strided view, as in generate
        logits[4, :40] = 0.0  # ties
        rows = [0, 2, 3, 4, 8]
        batched = choose_tokens(logits, temperature, top_p, torch.stack([uniforms(i, 1)[0] for i in rows]), rows)
        alone = [choose_token(logits[i].clone(), temperature, top_p, torch.Generator().manual_seed(i)) for i in rows]
        assert batched == alone
    for seed in (0, 7, 2**64 - 1):
        one_at_a_time = torch.Generator().manual_seed(seed % 2**63)
        assert uniforms(seed, 40).tolist() == [torch.rand((), generator=one_at_a_time, dtype=torch.float64).item() for _ in range(40)]
