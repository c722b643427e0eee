"""A sequence's KV cache carried from one call of the sampler to the next (`rollout.kv_cache`):
a continued turn samples what a fresh forward of the whole sequence samples, to float rounding,
and computes only the new tokens."""

import pytest
import torch

from dagster_rl.tasks.lm.rollout.kv_cache import BatchKV
from dagster_rl.tasks.lm.rollout.sampling import generate, generate_cached
from dagster_rl.tasks.lm.settings import SamplingSettings
from tests.lm_fixtures import fresh_policy

LOGP_ATOL = 1e-5  # float32 log-probs of two computations of the same tokens (tests/test_lm_rollout.py)
TURN = SamplingSettings(temperature=1.0, top_p=1.0, max_new_tokens=5)


class Counting(torch.nn.Module):
    """The model, counting the input tokens of its forwards."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model, self.tokens = model, 0

    def forward(self, **kwargs):
        self.tokens += kwargs["input_ids"].numel()
        return self.model(**kwargs)


@pytest.fixture(scope="module")
def turn_one(tiny_dir):
    """Turn 1 of five sequences of other lengths, some ending early at an eos, and what follows each."""
    policy = fresh_policy(tiny_dir)
    policy.mode(training=False)
    vocab = policy.model.get_input_embeddings().num_embeddings
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (4, 9, 6, 12, 7)]
    observations = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (3, 1, 6, 2, 4)]
    with policy.merged() as model:
        eos = generate(model, prompts, list(range(5)), TURN, -1, 0)[2].completion_ids[1]  # row 2's 2nd token: an early stop
        gens, past = generate_cached(model, prompts, list(range(5)), TURN, eos, 0)
    assert past is not None and {g.finish_reason for g in gens} == {"stop", "length"}
    nexts = [[*p, *g.completion_ids, *o] for p, g, o in zip(prompts, gens, observations, strict=True)]
    return policy, eos, past, nexts


def _same_turn(fresh, continued) -> float:
    for f, c in zip(fresh, continued, strict=True):
        assert f.completion_ids == c.completion_ids and f.finish_reason == c.finish_reason
    return max(abs(a - b) for f, c in zip(fresh, continued, strict=True) for a, b in zip(f.logprobs, c.logprobs, strict=True))


@pytest.mark.numerics
def test_a_continued_turn_samples_as_a_fresh_forward_and_computes_only_the_new_tokens(turn_one):
    policy, eos, past, nexts = turn_one
    seeds = [10, 11, 12, 13, 14]
    with policy.merged() as model:
        fresh_model, carried_model = Counting(model), Counting(model)
        fresh = generate(fresh_model, nexts, seeds, TURN, eos, 0)
        continued, again = generate_cached(carried_model, nexts, seeds, TURN, eos, 0, past=past)
    worst = _same_turn(fresh, continued)
    assert worst < LOGP_ATOL, worst
    # what the past already held was computed once: every row's new tokens, in a left-padded chunk, then the decode
    new = [len(n) - len(t) for n, t in zip(nexts, past.tokens, strict=True)]
    assert carried_model.tokens < fresh_model.tokens
    assert carried_model.tokens - len(nexts) * max(new) == fresh_model.tokens - len(nexts) * max(len(n) for n in nexts)
    assert again is not None and [len(t) for t in again.tokens] == [int(n) for n in again.real.sum(-1)]
    for row, (seq, g) in enumerate(zip(nexts, continued, strict=True)):
        assert (
            again.tokens[row][: len(seq)] == seq
            and again.tokens[row][len(seq) :] == g.completion_ids[: len(again.tokens[row]) - len(seq)]
        )


@pytest.mark.numerics
def test_rows_that_leave_and_rows_split_then_stacked_continue_alike(turn_one):
    """Finished episodes leave the batch (`select`); rows kept alone and stacked again (`split`,
    `stack`: what `dagster-rl serve` keeps per prefix) continue as the batch does."""
    policy, eos, past, nexts = turn_one
    kept = [3, 0, 4]
    seqs, seeds = [nexts[i] for i in kept], [20, 21, 22]
    rows = past.split()
    assert [len(r) for r in rows] == [len(t) for t in past.tokens]
    with policy.merged() as model:
        fresh = generate(model, seqs, seeds, TURN, eos, 0)
        selected, _ = generate_cached(model, seqs, seeds, TURN, eos, 0, past=past.select(kept))
        prefix = rows[0].prefix(len(rows[0]) - 2)
        stacked_past = BatchKV.stack([rows[3], prefix, None])  # a shorter prefix of row 0; row 4 from scratch
        stacked, _ = generate_cached(model, seqs, seeds, TURN, eos, 0, past=stacked_past)
    assert past.select(kept).real.shape[1] <= past.real.shape[1]
    assert _same_turn(fresh, selected) < LOGP_ATOL
    assert _same_turn(fresh, stacked) < LOGP_ATOL


def test_a_past_must_begin_each_prompt(turn_one):
    policy, eos, past, nexts = turn_one
    with policy.merged() as model, pytest.raises(ValueError, match="begin their prompt"):
        generate_cached(model, [[1, 2, 3]] * 5, list(range(5)), TURN, eos, 0, past=past)
    with policy.merged() as model, pytest.raises(ValueError, match="begin their prompt"):
        generate_cached(model, [list(t) for t in past.tokens], list(range(5)), TURN, eos, 0, past=past)  # nothing new
    assert BatchKV.stack([None, None]) is None
