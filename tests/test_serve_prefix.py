"""`dagster-rl serve` keeps the KV cache of what it served by token prefix (`serve.prefix_cache`): an
episode's next turn computes only its new tokens, and answers what a server without the cache
answers, to float rounding."""

from pathlib import Path

import pytest
import torch

from dagster_rl.tasks.lm.rollout.kv_cache import RowKV
from dagster_rl.tasks.lm.serve.engine import Engine
from dagster_rl.tasks.lm.serve.prefix_cache import BLOCK, PrefixCache
from dagster_rl.tasks.lm.serve.protocol import CompletionRequest
from tests.test_serve import TINY, adapter

LOGP_ATOL = 1e-5  # float32 log-probs of two computations of the same tokens (tests/test_lm_rollout.py)


def row(tokens: list[int], layers: int = 2) -> RowKV:
    kv = tuple(torch.full((1, len(tokens), 2), float(len(tokens))) for _ in range(layers))
    return RowKV(tuple(tokens), kv, kv)


def test_the_longest_cached_prefix_is_found_and_the_last_token_is_always_computed():
    cache = PrefixCache(max_bytes=10**9)
    first = list(range(100, 140))  # 40 tokens: two blocks
    cache.store("a", [row(first), row([1] * (BLOCK - 1))])  # too short to index: not kept
    assert len(cache) == 1
    found = cache.lookup("a", [*first, 7, 8])
    assert found is not None and found.tokens == tuple(first) and found.keys[0].shape == (1, 40, 2)
    assert cache.lookup("a", first).tokens == tuple(first[:-1])  # the whole sequence again: its last token is computed
    assert cache.lookup("a", [*first[:20], 5, 5, 5]).tokens == tuple(first[:20])  # a block, then token by token
    assert cache.lookup("b", [*first, 7]) is None  # another model's numbers
    assert cache.lookup("a", [*first[: BLOCK - 1], 0, *first]) is None  # no shared block
    longer = [*first, 7, 8, 9]
    cache.store("a", [row(longer)])
    assert len(cache) == 1 and cache.lookup("a", [*longer, 1]).tokens == tuple(longer)  # the prefix entry went
    cache.drop("a")
    assert len(cache) == 0 and cache.nbytes == 0 and cache.lookup("a", [*longer, 1]) is None


def test_the_least_recently_used_go_past_the_memory_bound():
    sizes = row(list(range(BLOCK))).nbytes
    cache = PrefixCache(max_bytes=2 * sizes)
    a, b, c = ([k] * BLOCK for k in (1, 2, 3))
    cache.store("m", [row(a), row(b)])
    assert cache.lookup("m", [*a, 0]) is not None  # a used: b is the oldest now
    cache.store("m", [row(c)])
    assert len(cache) == 2 and cache.nbytes == 2 * sizes
    assert cache.lookup("m", [*b, 0]) is None and cache.lookup("m", [*a, 0]) is not None


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("prefix-adapters")
    adapter(root / "good", seed=1)
    adapter(root / "other", seed=2)
    return root


@pytest.mark.numerics
def test_an_episodes_next_turn_reuses_its_prefix_and_answers_as_without_the_cache(adapter_root):
    cached, plain = (Engine(TINY, adapter_roots=[str(adapter_root)], prefix_cache_mib=m) for m in (64, 0))
    assert plain.prefixes is None and cached.prefixes is not None
    for engine in (cached, plain):
        engine.load_adapter("a", str(adapter_root / "good"))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 60, (n,), generator=g).tolist() for n in (20, 37, 26)]

    def turn(engine: Engine, prompts: list[list[int]], seed: int):
        return engine.run_batch([CompletionRequest("a", p, 6, 1.0, 1.0, seed + i, logprobs=0) for i, p in enumerate(prompts)])

    first = [turn(e, prompts, 0) for e in (cached, plain)]
    assert [r.token_ids for r in first[0]] == [r.token_ids for r in first[1]]
    observation = [4, 5, 6]
    seconds = [[*p, *r.token_ids, *observation] for p, r in zip(prompts, first[0], strict=True)]
    before = cached.prefixes.reused
    again = [turn(e, seconds, 10) for e in (cached, plain)]
    reused = cached.prefixes.reused - before
    assert reused >= sum(len(p) + len(r.token_ids) - 1 for p, r in zip(prompts, first[0], strict=True))
    for c, p in zip(*again, strict=True):
        assert c.token_ids == p.token_ids
        assert max(abs(x - y) for x, y in zip(c.logprobs, p.logprobs, strict=True)) < LOGP_ATOL
    # the adapter loaded anew in place: its numbers change, and so do the cache's entries (none of the old is used)
    cached.load_adapter("a", str(adapter_root / "other"), inplace=True)
    plain.load_adapter("a", str(adapter_root / "other"), inplace=True)
    before = cached.prefixes.reused
    replaced = [turn(e, seconds, 10) for e in (cached, plain)]
    assert cached.prefixes.reused == before
    assert [r.token_ids for r in replaced[0]] == [r.token_ids for r in replaced[1]]
