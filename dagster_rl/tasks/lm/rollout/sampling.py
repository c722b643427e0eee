"""Batched generation with a KV cache, one seeded generator per row, recording each token's log-prob.

Each row draws exactly one uniform from its own CPU `torch.Generator` per generated token, so what a
row samples depends on its seed and its logits alone, not on which other rows share its batch nor
on the device: the uniforms of a row are drawn up front on the CPU, max_new_tokens of them (the same
numbers, in the same order, as one draw per token; a row that stops early leaves the rest unused),
and sent to the model's device once. A token is drawn by inverse CDF over the tempered distribution
cut to its top-p nucleus (the smallest set of most likely tokens whose mass reaches top_p).
Temperature 0 is greedy (argmax, first on ties).

At every step the sampler also records log softmax(logits / temperature) of the token it drew,
from the logits it drew it from (`logprobs.token_logprobs`): the behavior log-probs the loss's
importance ratio needs, with no second forward; and, when asked (`top_logprobs` = k), the k most
likely tokens of that distribution with theirs (what `dagster-rl serve` answers `logprobs: k` with).
"""

from dataclasses import dataclass

import torch

from dagster_rl.tasks.lm.model.logprobs import token_logprobs
from dagster_rl.tasks.lm.rollout.kv_cache import CACHE_ARG, BatchKV, cache_of, carryable
from dagster_rl.tasks.lm.settings import SamplingSettings


@dataclass(frozen=True)
class Generation:
    completion_ids: list[int]
    logprobs: list[float]  # of each completion token, as sampled
    finish_reason: str  # "stop" (eos sampled, included) or "length"
    top: list[list[tuple[int, float]]] | None = None  # per completion token: the top_logprobs most likely (id, log-prob)


def choose_tokens(logits: torch.Tensor, temperature: float, top_p: float, uniforms: torch.Tensor | None) -> torch.Tensor:
    """One token per row of (B, V) logits, from `uniforms` (float64, (B,), in [0, 1); unused when greedy).

    Row-wise exact: every op (softmax, sort, cumsum, searchsorted) works along the vocabulary of one
    row alone, so a row's token is the one `choose_token` gives it alone.
    """
    if temperature == 0:
        return torch.argmax(logits, dim=-1)
    if uniforms is None:
        raise ValueError(f"sampling at temperature {temperature:g} draws from uniforms; none were given")
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    order = None
    if top_p < 1.0:
        probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        before = torch.cumsum(probs, -1) - probs  # mass of the tokens ranked above each one
        kept = torch.where(before < top_p, probs, torch.zeros_like(probs))
        kept[:, 0] = probs[:, 0]
        probs = kept
    cdf = torch.cumsum(probs, -1)
    u = uniforms.to(device=cdf.device, dtype=cdf.dtype)
    i = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp(max=cdf.shape[-1] - 1)
    return (i if order is None else order.gather(-1, i))[:, 0]


def choose_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """One token from a (V,) row of logits; consumes exactly one uniform of `generator` unless greedy."""
    u = None if temperature == 0 else torch.rand(1, generator=generator, dtype=torch.float64)
    return int(choose_tokens(logits[None], temperature, top_p, u)[0])


def uniforms(seed: int, n: int) -> torch.Tensor:
    """The first n uniforms (float64) of the CPU generator seeded by `seed`: those of its first n tokens."""
    return torch.rand(n, generator=torch.Generator().manual_seed(seed % 2**63), dtype=torch.float64)


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    seeds: list[int],
    sampling: SamplingSettings,
    eos_id: int,
    pad_id: int,
    top_logprobs: int = 0,
) -> list[Generation]:
    """Sample a completion for every prompt (left-padded batch, KV cache), row i seeded by seeds[i];
    a row ends at `eos_id` (included; -1: never) or after max_new_tokens."""
    return generate_cached(model, prompts, seeds, sampling, eos_id, pad_id, top_logprobs)[0]


@torch.no_grad()
def generate_cached(
    model: torch.nn.Module,
    prompts: list[list[int]],
    seeds: list[int],
    sampling: SamplingSettings,
    eos_id: int,
    pad_id: int,
    top_logprobs: int = 0,
    past: BatchKV | None = None,
) -> tuple[list[Generation], BatchKV | None]:
    """`generate`, continuing `past` (`kv_cache`): row i's cached tokens must begin its prompt, and
    only the rest of the prompt is a forward. Returns the generations and the batch's KV cache for a
    next call (its rows: each prompt and the completion tokens fed to the model, all but a last one
    that ended the loop), or None where the cache cannot carry over (`kv_cache.carryable`)."""
    if len(prompts) != len(seeds):
        raise ValueError(f"{len(prompts)} prompts for {len(seeds)} seeds")
    if not prompts:
        return [], None
    if any(not p for p in prompts):
        raise ValueError("every prompt needs at least one token")
    device = next(model.parameters()).device
    rows, steps, temperature = len(prompts), sampling.max_new_tokens, sampling.temperature
    cached: list[list[int]] = [[] for _ in prompts] if past is None else past.tokens
    if past is not None and (
        past.rows != rows or any(len(c) >= len(p) or list(p[: len(c)]) != c for c, p in zip(cached, prompts, strict=True))
    ):
        raise ValueError("a past's rows must each begin their prompt, and leave at least one of its tokens to compute")
    # row i's t-th uniform is draws[i, t]: torch.rand(n) of a CPU generator is its next n uniforms
    draws = None if temperature == 0 else torch.stack([uniforms(s, steps) for s in seeds]).to(device)
    new = [list(p[len(c) :]) for p, c in zip(prompts, cached, strict=True)]
    width = max(len(n) for n in new)
    ids = torch.tensor([[pad_id] * (width - len(n)) + n for n in new], device=device)
    mask = torch.tensor([[0] * (width - len(n)) + [1] * len(n) for n in new], device=device)
    start = torch.tensor([len(c) for c in cached], device=device)
    positions = (start[:, None] + mask.cumsum(-1) - 1).clamp(min=0)
    if past is not None:
        mask = torch.cat([past.real.to(device=device, dtype=mask.dtype), mask], dim=1)
    real = mask  # the columns that hold a row's tokens: the attention mask, less what finished rows are fed
    tokens = torch.full((rows, steps), pad_id, dtype=torch.long, device=device)
    logps = torch.zeros((rows, steps), dtype=torch.float32, device=device)
    top_ids = torch.zeros((rows, steps, top_logprobs), dtype=torch.long, device=device)
    top_lps = torch.zeros((rows, steps, top_logprobs), dtype=torch.float32, device=device)
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    # logits of the last position only: the (B, width, V) ones of a real vocabulary are gigabytes
    cache = {} if past is None else {CACHE_ARG: past.fresh_cache()}
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1, **cache)
    ones = torch.ones((rows, 1), dtype=mask.dtype, device=device)
    for t in range(steps):
        logits = out.logits[:, -1].float()
        chosen = choose_tokens(logits, temperature, sampling.top_p, None if draws is None else draws[:, t])
        live = ~done  # rows whose token of this step is theirs (finished rows feed padding; their draw goes unused)
        chosen = torch.where(done, pad_id, chosen)
        tokens[:, t] = chosen
        logps[:, t] = token_logprobs(logits, chosen, temperature)
        if top_logprobs:
            tempered = logits if temperature in (0, 1) else logits / temperature
            top_lps[:, t], top_ids[:, t] = torch.topk(
                torch.log_softmax(tempered, dim=-1), min(top_logprobs, logits.shape[-1]), dim=-1
            )
        done |= chosen == eos_id
        if t + 1 == steps or bool(done.all()):
            break
        mask = torch.cat([mask, ones], dim=1)
        real = torch.cat([real, live[:, None].to(mask.dtype)], dim=1)
        positions = positions[:, -1:] + 1
        out = model(
            input_ids=chosen[:, None], attention_mask=mask, position_ids=positions, use_cache=True, **{CACHE_ARG: cache_of(out)}
        )
    gens = [_row(toks, lps, eos_id) for toks, lps in zip(tokens.tolist(), logps.tolist(), strict=True)]
    state = None
    if carryable(cache_of(out)):
        fed = (real.sum(-1) - start - torch.tensor([len(n) for n in new], device=device)).tolist()
        state = BatchKV(cache_of(out), real, [[*p, *g.completion_ids[:f]] for p, g, f in zip(prompts, gens, fed, strict=True)])
    if not top_logprobs:
        return gens, state
    tops = [
        [list(zip(i, v, strict=True)) for i, v in zip(ids, lps, strict=True)]
        for ids, lps in zip(top_ids.tolist(), top_lps.tolist(), strict=True)
    ]
    return [
        Generation(g.completion_ids, g.logprobs, g.finish_reason, top[: len(g.completion_ids)])
        for g, top in zip(gens, tops, strict=True)
    ], state


def _row(tokens: list[int], logps: list[float], eos_id: int) -> Generation:
    """A row's completion: up to and including its first eos, else all of it."""
    n = tokens.index(eos_id) + 1 if eos_id in tokens else len(tokens)
    return Generation(tokens[:n], logps[:n], "stop" if eos_id in tokens else "length")
