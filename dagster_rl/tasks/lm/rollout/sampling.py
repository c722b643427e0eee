"""Batched generation with a KV cache, one seeded generator per row, recording each token's log-prob.

Each row draws exactly one uniform from its own CPU `torch.Generator` per generated token, so what a
row samples depends on its seed and its logits alone, not on which other rows share its batch nor
on the device: the uniforms of a row are drawn up front on the CPU, max_new_tokens of them (the same
numbers, in the same order, as one draw per token; a row that stops early leaves the rest unused),
and sent to the model's device once. A token is drawn by inverse CDF over the tempered distribution
cut to its top-p nucleus (the smallest set of most likely tokens whose mass reaches top_p).
Temperature 0 is greedy (argmax, first on ties).

Rows that sampled their eos leave the forward batch once no more than `COMPACT_AT` of it is live
(`Decode`): a step computes the rows still sampling, not every row until the longest ends. A call
can continue the KV cache of an earlier one (`generate_cached`, `kv_cache`), so that only a
sequence's new tokens are computed (an episode's next turn).

At every step the sampler also records log softmax(logits / temperature) of the token it drew,
from the logits it drew it from (`logprobs.token_logprobs`): the behavior log-probs the loss's
importance ratio needs, with no second forward; and, when asked (`top_logprobs` = k), the k most
likely tokens of that distribution with theirs (what `dagster-rl serve` answers `logprobs: k` with).
"""

from dataclasses import dataclass

import torch

from dagster_rl.tasks.lm.model.logprobs import token_logprobs
from dagster_rl.tasks.lm.rollout.kv_cache import CACHE_ARG, BatchKV, RowKV, cache_of, carryable, take_row
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


# a decode batch drops its finished rows once no more than this share of its rows is live (`Decode.compact`)
COMPACT_AT = 0.75


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
    keep: bool = False,
) -> tuple[list[Generation], list[RowKV] | None]:
    """`generate`, continuing `past` (`kv_cache`): row i's cached tokens must begin its prompt, and
    only the rest of the prompt is a forward. With `keep`, also each row's KV cache for a next call
    (its prompt and the completion tokens fed to the model: all but a last one that ended its
    decode), or None where the cache cannot carry over (`kv_cache.carryable`)."""
    if len(prompts) != len(seeds):
        raise ValueError(f"{len(prompts)} prompts for {len(seeds)} seeds")
    if not prompts:
        return [], [] if keep else None
    if any(not p for p in prompts):
        raise ValueError("every prompt needs at least one token")
    cached: list[list[int]] = [[] for _ in prompts] if past is None else past.tokens
    if past is not None and (
        past.rows != len(prompts) or any(len(c) >= len(p) or list(p[: len(c)]) != c for c, p in zip(cached, prompts, strict=True))
    ):
        raise ValueError("a past's rows must each begin their prompt, and leave at least one of its tokens to compute")
    decode = Decode(model, prompts, seeds, sampling, eos_id, pad_id, top_logprobs, keep)
    decode.prefill([list(p[len(c) :]) for p, c in zip(prompts, cached, strict=True)], past)
    decode.run()
    gens = [_row(toks, lps, eos_id) for toks, lps in zip(decode.tokens.tolist(), decode.logps.tolist(), strict=True)]
    kept = decode.rows() if keep else None
    if top_logprobs:
        tops = [
            [list(zip(i, v, strict=True)) for i, v in zip(ids, lps, strict=True)]
            for ids, lps in zip(decode.top_ids.tolist(), decode.top_lps.tolist(), strict=True)
        ]
        gens = [
            Generation(g.completion_ids, g.logprobs, g.finish_reason, top[: len(g.completion_ids)])
            for g, top in zip(gens, tops, strict=True)
        ]
    return gens, kept


class Decode:
    """One batch's decode loop: the rows still in the forward batch (`at`: their rows of the request),
    its KV cache, attention mask and positions, and what each row sampled.

    A row that sampled its eos keeps its place (fed padding, its draws unused) until no more than
    `COMPACT_AT` of the batch is live: then the finished rows leave the forward batch (and their
    cache), so that a step computes the rows still sampling, not all of them until the longest ends.
    `real` marks the cache columns that hold a row's tokens (the attention mask, less the padding a
    finished row was fed): what a row's KV cache is when `keep` asks for it."""

    def __init__(self, model, prompts, seeds, sampling: SamplingSettings, eos_id: int, pad_id: int, top: int, keep: bool):
        self.model, self.prompts, self.sampling, self.eos_id, self.pad_id, self.keep = (
            model,
            prompts,
            sampling,
            eos_id,
            pad_id,
            keep,
        )
        self.device = device = next(model.parameters()).device
        rows, steps = len(prompts), sampling.max_new_tokens
        # row i's t-th uniform is draws[i, t]: torch.rand(n) of a CPU generator is its next n uniforms
        self.draws = None if sampling.temperature == 0 else torch.stack([uniforms(s, steps) for s in seeds]).to(device)
        self.tokens = torch.full((rows, steps), pad_id, dtype=torch.long, device=device)
        self.logps = torch.zeros((rows, steps), dtype=torch.float32, device=device)
        self.top_ids = torch.zeros((rows, steps, top), dtype=torch.long, device=device)
        self.top_lps = torch.zeros((rows, steps, top), dtype=torch.float32, device=device)
        self.done = torch.zeros(rows, dtype=torch.bool, device=device)
        self.at = torch.arange(rows, device=device)
        self.left: dict[int, RowKV] = {}  # rows that left the forward batch, their KV cache (with `keep`)

    def prefill(self, new: list[list[int]], past: BatchKV | None) -> None:
        """The forward of each row's new tokens (left-padded), after its cached ones."""
        width, device = max(len(n) for n in new), self.device
        ids = torch.tensor([[self.pad_id] * (width - len(n)) + n for n in new], device=device)
        mask = torch.tensor([[0] * (width - len(n)) + [1] * len(n) for n in new], device=device)
        start = torch.tensor([len(p) - len(n) for p, n in zip(self.prompts, new, strict=True)], device=device)
        self.positions = (start[:, None] + mask.cumsum(-1) - 1).clamp(min=0)
        if past is not None:
            mask = torch.cat([past.real.to(device=device, dtype=mask.dtype), mask], dim=1)
        self.mask = self.real = mask
        cache = {} if past is None else {CACHE_ARG: past.fresh_cache()}
        # logits of the last position only: the (B, width, V) ones of a real vocabulary are gigabytes
        self.out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=self.positions, use_cache=True, logits_to_keep=1, **cache
        )

    def run(self) -> None:
        temperature, at = self.sampling.temperature, self.at
        for t in range(self.sampling.max_new_tokens):
            at = self.at
            logits = self.out.logits[:, -1].float()
            chosen = choose_tokens(logits, temperature, self.sampling.top_p, None if self.draws is None else self.draws[at, t])
            live = ~self.done[at]  # rows whose token of this step is theirs (finished rows feed padding; their draw goes unused)
            chosen = torch.where(live, chosen, self.pad_id)
            self.tokens[at, t] = chosen
            self.logps[at, t] = token_logprobs(logits, chosen, temperature)
            if self.top_ids.shape[-1]:
                tempered = logits if temperature in (0, 1) else logits / temperature
                self.top_lps[at, t], self.top_ids[at, t] = torch.topk(
                    torch.log_softmax(tempered, dim=-1), min(self.top_ids.shape[-1], logits.shape[-1]), dim=-1
                )
            self.done[at] |= chosen == self.eos_id
            if t + 1 == self.sampling.max_new_tokens or bool(self.done.all()):
                break
            still = ~self.done[at]
            if int(still.sum()) <= COMPACT_AT * len(at) and carryable(cache_of(self.out)):
                chosen, live = self.compact(still, chosen, live)
            ones = torch.ones((len(self.at), 1), dtype=self.mask.dtype, device=self.device)
            self.mask = torch.cat([self.mask, ones], dim=1)
            self.real = torch.cat([self.real, live[:, None].to(self.mask.dtype)], dim=1)
            self.positions = self.positions[:, -1:] + 1
            self.out = self.model(
                input_ids=chosen[:, None],
                attention_mask=self.mask,
                position_ids=self.positions,
                use_cache=True,
                **{CACHE_ARG: cache_of(self.out)},
            )

    def compact(self, still: torch.Tensor, chosen: torch.Tensor, live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The finished rows leave the forward batch (with `keep`, their KV cache is taken first)."""
        cache = cache_of(self.out)
        if self.keep:
            for b in torch.nonzero(~still)[:, 0].tolist():
                self.left[int(self.at[b])] = self._kv_of(cache, b)
        stay = torch.nonzero(still)[:, 0]
        cache.batch_select_indices(stay)
        self.at, self.mask, self.real, self.positions = (x[stay] for x in (self.at, self.mask, self.real, self.positions))
        return chosen[stay], live[stay]

    def _kv_of(self, cache, b: int) -> RowKV:
        """Batch row b's KV cache: its prompt and the completion tokens it was fed."""
        row = int(self.at[b])
        fed = int(self.real[b].sum()) - len(self.prompts[row])
        return take_row(cache, b, self.real[b], [*self.prompts[row], *self.tokens[row, :fed].tolist()])

    def rows(self) -> list[RowKV] | None:
        """Every row's KV cache (`keep`), or None where the cache cannot carry over."""
        cache = cache_of(self.out)
        if not carryable(cache):
            return None
        rows = {**self.left, **{int(r): self._kv_of(cache, b) for b, r in enumerate(self.at.tolist())}}
        return [rows[i] for i in range(len(self.prompts))]


def _row(tokens: list[int], logps: list[float], eos_id: int) -> Generation:
    """A row's completion: up to and including its first eos, else all of it."""
    n = tokens.index(eos_id) + 1 if eos_id in tokens else len(tokens)
    return Generation(tokens[:n], logps[:n], "stop" if eos_id in tokens else "length")
