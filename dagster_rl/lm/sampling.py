"""Batched generation with a KV cache, one seeded generator per row.

Each row draws exactly one uniform from its own `torch.Generator` per generated token, so what a row
samples depends on its seed and its logits alone, not on which other rows share its batch. (The
uniforms of a row are drawn up front, max_new_tokens of them: the same numbers, in the same order,
as one draw per token; a row that stops early leaves the rest unused.) A token
is drawn by inverse CDF over the tempered distribution cut to its top-p nucleus (the smallest set
of most likely tokens whose mass reaches top_p). Temperature 0 is greedy (argmax, first on ties).
"""

from dataclasses import dataclass

import torch

from dagster_rl.lm.settings import SamplingSettings


@dataclass(frozen=True)
class Generation:
    completion_ids: list[int]
    finish_reason: str  # "stop" (eos sampled, included) or "length"


def choose_tokens(
    logits: torch.Tensor, temperature: float, top_p: float, uniforms: torch.Tensor | None, rows: list[int] | None = None
) -> list[int]:
    """One token for each of `rows` (default: all) of (B, V) logits, from `uniforms` (float64, one per
    row of `rows`, in [0, 1); unused when greedy).

    Vectorized over rows, and row-wise exact: every op (softmax, sort, cumsum, searchsorted) works
    along the vocabulary of one row alone, so a row's token is the one `choose_token` gives it alone.
    """
    rows = list(range(logits.shape[0])) if rows is None else rows
    if not rows:
        return []
    logits = logits[rows] if len(rows) != logits.shape[0] else logits
    if temperature == 0:
        return torch.argmax(logits, dim=-1).tolist()
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    kept = sorted_p
    if top_p < 1.0:
        before = torch.cumsum(sorted_p, -1) - sorted_p  # mass of the tokens ranked above each one
        kept = torch.where(before < top_p, sorted_p, torch.zeros_like(sorted_p))
        kept[:, 0] = sorted_p[:, 0]
    cdf = torch.cumsum(kept, -1)
    i = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True).clamp(max=cdf.shape[-1] - 1)
    return order.gather(-1, i)[:, 0].tolist()


def choose_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """One token from a (V,) row of logits; consumes exactly one uniform of `generator` unless greedy."""
    if temperature == 0:
        return choose_tokens(logits[None], temperature, top_p, None)[0]
    return choose_tokens(logits[None], temperature, top_p, torch.rand(1, generator=generator, dtype=torch.float64))[0]


def uniforms(seed: int, n: int) -> torch.Tensor:
    """The first n uniforms (float64) of the generator seeded by `seed`: those of its first n tokens."""
    return torch.rand(n, generator=torch.Generator().manual_seed(seed % 2**63), dtype=torch.float64)


def _cache_kwarg(out) -> dict:
    """transformers >= 5.2x names the KV cache `cache`; earlier 5.x `past_key_values`."""
    if "cache" in out:
        return {"cache": out["cache"]}
    return {"past_key_values": out["past_key_values"]}


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    seeds: list[int],
    sampling: SamplingSettings,
    eos_id: int,
    pad_id: int,
) -> list[Generation]:
    """Sample a completion for every prompt (left-padded batch, KV cache), row i seeded by seeds[i]."""
    if len(prompts) != len(seeds):
        raise ValueError(f"{len(prompts)} prompts for {len(seeds)} seeds")
    if not prompts:
        return []
    if any(not p for p in prompts):
        raise ValueError("every prompt needs at least one token")
    device = next(model.parameters()).device
    greedy = sampling.temperature == 0
    # row i's t-th uniform is draws[i, t]: torch.rand(n) of a CPU generator is its next n uniforms
    draws = None if greedy else torch.stack([uniforms(s, sampling.max_new_tokens) for s in seeds])
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    # logits of the last position only: the (B, width, V) ones of a real vocabulary are gigabytes
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
    completions: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    for t in range(sampling.max_new_tokens):
        logits = out.logits[:, -1].float().cpu()
        active = [i for i in range(len(prompts)) if not done[i]]
        step_tokens = [pad_id] * len(prompts)
        u = None if draws is None else draws[active, t]
        for i, tok in zip(active, choose_tokens(logits, sampling.temperature, sampling.top_p, u, active)):
            completions[i].append(tok)
            done[i] = tok == eos_id
            step_tokens[i] = tok
        if all(done) or t + 1 == sampling.max_new_tokens:
            break
        mask = torch.cat([mask, torch.ones((len(prompts), 1), dtype=mask.dtype, device=device)], dim=1)
        positions = positions[:, -1:] + 1
        out = model(
            input_ids=torch.tensor(step_tokens, device=device)[:, None],
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **_cache_kwarg(out),
        )
    return [Generation(c, "stop" if c and c[-1] == eos_id else "length") for c in completions]
