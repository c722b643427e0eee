"""Seeded rollouts, the sampler's own log-probs, and the on-policy ratio within float rounding."""

import pytest
import torch

from dagster_rl.tasks.lm.data.prompts import SyntheticPrompts, load_prompt_set, prompts_for_step
from dagster_rl.tasks.lm.model.logprobs import completion_logprobs, token_logprobs
from dagster_rl.tasks.lm.model.policy import make_optimizer
from dagster_rl.tasks.lm.records import plan_requests
from dagster_rl.tasks.lm.rollout.hf import generate_rollouts
from dagster_rl.tasks.lm.rollout.sampling import choose_token, choose_tokens, generate, uniforms
from dagster_rl.tasks.lm.train.trainer import build_samples, train_step
from tests.lm_fixtures import GRPO, SAMPLING, fresh_policy, step_batch

# float32 log-probs of the same tokens from two computations (a KV-cache decode in one batch, another
# batch, or the trainer's packed forward) differ by rounding alone: measured <= 1e-6 on this CPU
LOGP_ATOL = 1e-5


@pytest.mark.numerics
def test_retried_rollout_is_token_identical_in_any_batch(tiny_dir):
    policy = fresh_policy(tiny_dir)
    ps = load_prompt_set(SyntheticPrompts(ops=("copy", "add", "last"), n_eval=10))
    requests = plan_requests(prompts_for_step(ps.train, 11, 3, 6), seed=11, step=3, n_samples=4)
    first = {r.trial_id: r for r in generate_rollouts(policy, requests, SAMPLING, ps.template)}
    # the retry: a few of the trials, another order, other batch sizes, other neighbours (other prompt lengths)
    others = plan_requests(prompts_for_step(ps.train, 99, 0, 5), seed=99, step=0, n_samples=2)
    retry_requests = [requests[7], others[0], requests[0], others[3], requests[21], requests[13]]
    retried = generate_rollouts(policy, retry_requests, SAMPLING, ps.template, batch_size=4)
    same = [(r, first[r.trial_id]) for r in retried if r.trial_id in first and r.seed == first[r.trial_id].seed]
    assert len(same) == 4
    for r, f in same:
        assert r.completion_token_ids == f.completion_token_ids and r.completion_text == f.completion_text
        assert r.sampling_logprobs == pytest.approx(f.sampling_logprobs, abs=LOGP_ATOL)
        assert r.model_dump(exclude={"sampling_logprobs"}) == f.model_dump(exclude={"sampling_logprobs"})
    # log-probs of another batch layout differ in their last bits, not more (no promise of bit equality)
    print(
        "max |logp retried - first|:",
        max(abs(a - b) for r, f in same for a, b in zip(r.sampling_logprobs, f.sampling_logprobs, strict=True)),
    )
    # the same requests in the same batches: the same bytes
    assert generate_rollouts(policy, requests, SAMPLING, ps.template) == sorted(first.values(), key=lambda r: r.trial_id)
    # different seeds do sample differently
    assert len({tuple(r.completion_token_ids) for r in first.values()}) > 12


@pytest.mark.numerics
def test_sampler_records_the_log_prob_of_each_token_it_draws(tiny_dir):
    """The recorded log-probs are log softmax(logits / T) of the drawn tokens, before top-p, where the
    logits are those of the sequence so far: a forward of the whole sequence gives them again."""
    policy = fresh_policy(tiny_dir)
    tok = policy.tokenizer
    sampling = SAMPLING.model_copy(update={"temperature": 0.7, "top_p": 0.8, "max_new_tokens": 6})
    prompts = [tok("copy 3 : the answer is")["input_ids"], tok("what is 1 + 2 ?")["input_ids"], tok("last 4 5")["input_ids"]]
    gens = generate(policy.model.eval(), prompts, [1, 2, 3], sampling, tok.eos_token_id, tok.pad_token_id)
    for p, g in zip(prompts, gens, strict=True):
        assert len(g.logprobs) == len(g.completion_ids) >= 1 and all(lp <= 0.0 for lp in g.logprobs)
        with torch.no_grad():
            logits = policy.model(input_ids=torch.tensor([p + g.completion_ids])).logits[0, len(p) - 1 : -1]
        alone = token_logprobs(logits, torch.tensor(g.completion_ids), 0.7)
        assert g.logprobs == pytest.approx(alone.tolist(), abs=LOGP_ATOL)
        by_hand = torch.log_softmax(logits.double() / 0.7, -1).gather(-1, torch.tensor(g.completion_ids)[:, None])[:, 0]
        assert g.logprobs == pytest.approx(by_hand.tolist(), abs=LOGP_ATOL)
        assert g.finish_reason == ("stop" if g.completion_ids[-1] == tok.eos_token_id else "length")
    # greedy: temperature 0 counts as 1
    greedy = generate(
        policy.model.eval(),
        prompts[:1],
        [0],
        sampling.model_copy(update={"temperature": 0.0}),
        tok.eos_token_id,
        tok.pad_token_id,
    )[0]
    with torch.no_grad():
        logits = policy.model(input_ids=torch.tensor([prompts[0] + greedy.completion_ids])).logits[0, len(prompts[0]) - 1 : -1]
    assert greedy.completion_ids == logits.argmax(-1).tolist()[: len(greedy.completion_ids)]
    assert greedy.logprobs == pytest.approx(torch.log_softmax(logits, -1).max(-1).values.tolist(), abs=LOGP_ATOL)


@pytest.mark.numerics
def test_on_policy_ratio_is_one_within_float_rounding_and_first_kl_is_exactly_zero(tiny_dir):
    policy = fresh_policy(tiny_dir)
    optimizer = make_optimizer(policy, GRPO)
    rollouts, rewards = step_batch(policy, step=0)
    samples, facts = build_samples(rollouts, rewards, GRPO.advantage_eps)
    assert facts["groups_with_signal"] >= 1
    m0 = train_step(policy, optimizer, samples, len(samples), GRPO, facts)
    # the sampler's log-probs against the trainer's packed forward: rounding apart (measured ~5e-7)
    assert 0.0 <= m0.ratio_max_dev < LOGP_ATOL and m0.ratio == pytest.approx(1.0, abs=1e-6) and m0.clip_frac == 0.0
    # the reference and the policy share one packed layout, and LoRA B = 0 adds exactly 0: KL is exactly 0
    assert m0.kl == 0.0
    assert m0.grad_norm > 0 and m0.samples_used == len(rollouts) == 16

    # next step, on-policy again with the moved adapter: ratio 1 within rounding, KL now > 0
    rollouts, rewards = step_batch(policy, step=1)
    r = rollouts[0]
    policy.model.train()
    new = completion_logprobs(policy.model, r.prompt_token_ids, r.completion_token_ids, r.temperature)
    assert new.tolist() == pytest.approx(r.sampling_logprobs, abs=LOGP_ATOL) and new.requires_grad
    samples, facts = build_samples(rollouts, rewards, GRPO.advantage_eps)
    m1 = train_step(policy, optimizer, samples, len(samples), GRPO, facts)
    assert m1.ratio_max_dev < LOGP_ATOL and m1.kl > 0.0 and m1.version == 2
    print(f"ratio_max_dev on-policy: step 0 {m0.ratio_max_dev:.2e}, step 1 {m1.ratio_max_dev:.2e}")


def test_vectorized_sampling_draws_each_row_as_alone():
    """choose_tokens over a batch gives every row the token choose_token gives it alone, and a row's
    uniforms drawn up front are the ones it would draw one token at a time."""
    torch.manual_seed(0)
    for temperature, top_p in ((1.0, 1.0), (0.7, 0.9), (1.3, 0.3), (0.0, 1.0)):
        logits = torch.randn(9, 3, 68)[:, -1] * 3  # a strided view, as in generate
        logits[4, :40] = 0.0  # ties
        rows = [0, 2, 3, 4, 8]
        batched = choose_tokens(logits[rows], temperature, top_p, torch.stack([uniforms(i, 1)[0] for i in rows])).tolist()
        alone = [choose_token(logits[i].clone(), temperature, top_p, torch.Generator().manual_seed(i)) for i in rows]
        assert batched == alone
    for seed in (0, 7, 2**64 - 1):
        one_at_a_time = torch.Generator().manual_seed(seed % 2**63)
        assert uniforms(seed, 40).tolist() == [
            torch.rand((), generator=one_at_a_time, dtype=torch.float64).item() for _ in range(40)
        ]
