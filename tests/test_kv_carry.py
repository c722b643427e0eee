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
    """The model, counting the input tokens (rows x new positions) of its forwards."""

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
        gens, rows = generate_cached(model, prompts, list(range(5)), TURN, eos, 0, keep=True)
    assert rows is not None and {g.finish_reason for g in gens} == {"stop", "length"}
    for p, g, r in zip(prompts, gens, rows, strict=True):  # what was fed: all but a last token that ended the decode
        assert list(r.tokens) == [*p, *g.completion_ids[: len(r) - len(p)]] and len(r) - len(p) >= len(g.completion_ids) - 1
    nexts = [[*p, *g.completion_ids, *o] for p, g, o in zip(prompts, gens, observations, strict=True)]
    return policy, eos, rows, nexts


def _same_turn(fresh, continued) -> float:
    for f, c in zip(fresh, continued, strict=True):
        assert f.completion_ids == c.completion_ids and f.finish_reason == c.finish_reason
    return max(abs(a - b) for f, c in zip(fresh, continued, strict=True) for a, b in zip(f.logprobs, c.logprobs, strict=True))


@pytest.mark.numerics
def test_a_continued_turn_samples_as_a_fresh_forward_and_computes_only_the_new_tokens(turn_one):
    policy, eos, rows, nexts = turn_one
    seeds = [10, 11, 12, 13, 14]
    with policy.merged() as model:
        fresh_model, carried_model = Counting(model), Counting(model)
        fresh = generate(fresh_model, nexts, seeds, TURN, eos, 0)
        continued, again = generate_cached(carried_model, nexts, seeds, TURN, eos, 0, past=BatchKV.stack(rows), keep=True)
    worst = _same_turn(fresh, continued)
    assert worst < LOGP_ATOL, worst
    # what the past held was computed once: the prefill is every row's new tokens, left-padded; the decode is the same
    new = max(len(n) - len(r) for n, r in zip(nexts, rows, strict=True))
    assert carried_model.tokens - len(nexts) * new == fresh_model.tokens - len(nexts) * max(len(n) for n in nexts)
    assert again is not None
    for seq, g, r in zip(nexts, continued, again, strict=True):
        assert list(r.tokens) == [*seq, *g.completion_ids[: len(r) - len(seq)]]


@pytest.mark.numerics
def test_rows_that_leave_and_shorter_prefixes_continue_alike(turn_one):
    """Episodes that ended leave the batch; a row's prefix (what `dagster-rl serve` finds for another
    sample of a prompt) and a row with nothing cached continue as a fresh forward does."""
    policy, eos, rows, nexts = turn_one
    kept = [3, 0, 4]
    seqs, seeds = [nexts[i] for i in kept], [20, 21, 22]
    with policy.merged() as model:
        fresh = generate(model, seqs, seeds, TURN, eos, 0)
        selected, _ = generate_cached(model, seqs, seeds, TURN, eos, 0, past=BatchKV.stack([rows[i] for i in kept]))
        stacked_past = BatchKV.stack([rows[3], rows[0].prefix(len(rows[0]) - 2), None])  # row 4 from scratch
        stacked, _ = generate_cached(model, seqs, seeds, TURN, eos, 0, past=stacked_past)
    assert _same_turn(fresh, selected) < LOGP_ATOL
    assert _same_turn(fresh, stacked) < LOGP_ATOL


@pytest.mark.numerics
def test_finished_rows_leave_the_decode_batch_and_nothing_else_changes(turn_one, monkeypatch):
    """Once few enough rows are live, finished ones leave the forward batch: fewer rows computed, the
    same tokens, log-probs and kept caches to float rounding."""
    from dagster_rl.tasks.lm.rollout import sampling

    policy, eos, rows, nexts = turn_one
    long_turn = TURN.model_copy(update={"max_new_tokens": 12})
    seeds = list(range(30, 35))

    def decoded(compact_at: float):
        monkeypatch.setattr(sampling, "COMPACT_AT", compact_at)
        with policy.merged() as model:
            counting = Counting(model)
            gens, kept = generate_cached(counting, nexts, seeds, long_turn, eos, 0, keep=True)
        return counting.tokens, gens, kept

    with policy.merged() as model:  # a stop token that ends several rows early
        unstopped = generate(model, nexts, seeds, long_turn, -1, 0)
    early = [set(g.completion_ids[:6]) for g in unstopped]
    eos = max(sorted(set().union(*early)), key=lambda t: sum(t in e for e in early))
    (n_full, full, full_kv), (n_compact, compact, compact_kv) = decoded(0.0), decoded(1.0)
    assert sum(g.finish_reason == "stop" for g in full) >= 2 and n_compact < n_full
    assert _same_turn(full, compact) < LOGP_ATOL
    for a, b in zip(full_kv, compact_kv, strict=True):  # a row that left was not fed its eos: one token less
        assert a.tokens[: len(b)] == b.tokens and len(a) - len(b) in (0, 1)
        for x, y in zip((*a.prefix(len(b)).keys, *a.prefix(len(b)).values), (*b.keys, *b.values), strict=True):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    assert any(len(a) > len(b) for a, b in zip(full_kv, compact_kv, strict=True))


def test_a_past_must_begin_each_prompt(turn_one):
    policy, eos, rows, nexts = turn_one
    past = BatchKV.stack(rows)
    with policy.merged() as model, pytest.raises(ValueError, match="begin their prompt"):
        generate_cached(model, [[1, 2, 3]] * 5, list(range(5)), TURN, eos, 0, past=past)
    with policy.merged() as model, pytest.raises(ValueError, match="begin their prompt"):
        generate_cached(model, [list(r.tokens) for r in rows], list(range(5)), TURN, eos, 0, past=past)  # nothing new
    assert BatchKV.stack([None, None]) is None
