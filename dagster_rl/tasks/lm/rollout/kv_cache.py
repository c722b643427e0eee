"""Sequences' KV caches kept between calls of the sampler, so that a sequence's prefix is computed once.

A multi-turn episode's next turn continues the sequence its last turn sampled: the keys and values
of every token already in it are those the last turn computed, and only the tokens after them (the
last sampled token, the observation) need a forward (`sampling.generate_cached` with a `past`).

`RowKV` is one sequence's keys and values alone (what a decode keeps of each row, `take_row`, and
what `dagster-rl serve` keeps per token prefix, `serve.prefix_cache`). `BatchKV.stack` makes a batch
of rows again, each right-aligned: the model's cache, (B, L) per layer, and `real`, 1 where a column
holds one of row i's tokens. Columns that hold none (a row's left padding, the padding a finished
row was fed, a short row's padding of the next turn's new tokens) are holes: 0 in the attention
mask, so nothing attends to them; a row's positions count its real tokens only. The numbers are
the same as a fresh forward of each row's whole sequence up to float rounding (other shapes, other
kernels): what a left-padded batch already gives.

Only caches whose layers are all plain `DynamicLayer`s carry over (full attention, as Llama and
Qwen2 have); any other (a sliding window) gives `None`, and the next turn computes its whole
sequence again.
"""

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.models.llama.modeling_llama import LlamaModel

# transformers >= 5.2x names the KV cache `cache` (its forward's argument and output), earlier 5.x `past_key_values`
CACHE_ARG = "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


def cache_of(out: Any) -> Any:
    """The KV cache a forward returned."""
    return out[CACHE_ARG] if CACHE_ARG in out else out["past_key_values" if CACHE_ARG == "cache" else "cache"]


def carryable(cache: Any) -> bool:
    """Whether a cache can carry its rows to another call: every layer a plain, filled `DynamicLayer`."""
    layers = getattr(cache, "layers", None) or []
    return bool(layers) and all(type(layer) is DynamicLayer and layer.is_initialized for layer in layers)


def take_row(cache: Any, b: int, real: torch.Tensor, tokens: Sequence[int]) -> "RowKV":
    """Row b of a batch's cache, the columns `real` (1 where the row has a token) marks, as `tokens`'."""
    columns = torch.nonzero(real)[:, 0]
    if len(columns) != len(tokens):
        raise ValueError(f"row {b} holds {len(columns)} tokens of the cache, not {len(tokens)}")
    return RowKV(
        tuple(tokens),
        tuple(layer.keys[b].index_select(1, columns) for layer in cache.layers),
        tuple(layer.values[b].index_select(1, columns) for layer in cache.layers),
    )


@dataclass(frozen=True)
class RowKV:
    """One sequence's keys and values per layer, (kv_heads, len(tokens), head_dim) each."""

    tokens: tuple[int, ...]
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def prefix(self, n: int) -> "RowKV":
        """The first n tokens' keys and values (a causal model's prefix does not depend on what follows)."""
        if not 0 < n <= len(self):
            raise ValueError(f"a prefix of 1..{len(self)} tokens, not {n}")
        if n == len(self):
            return self
        return RowKV(self.tokens[:n], tuple(k[:, :n] for k in self.keys), tuple(v[:, :n] for v in self.values))


@dataclass
class BatchKV:
    """A batch's KV cache: `real` (B, L) marks the columns that hold row i's tokens, `tokens[i]` those
    tokens in order."""

    cache: Any
    real: torch.Tensor
    tokens: list[list[int]]

    def __post_init__(self) -> None:
        if self.real.shape[0] != len(self.tokens) or [int(n) for n in self.real.sum(-1).tolist()] != [
            len(t) for t in self.tokens
        ]:
            raise ValueError("a BatchKV's real columns do not count its rows' tokens")

    @property
    def rows(self) -> int:
        return len(self.tokens)

    def fresh_cache(self) -> DynamicCache:
        """A cache over the same tensors for a forward to extend: a forward grows the cache it is given
        (new tensors, concatenated), and this BatchKV stays as it was."""
        return DynamicCache(ddp_cache_data=[(layer.keys, layer.values) for layer in self.cache.layers])

    @classmethod
    def stack(cls, rows: Sequence[RowKV | None]) -> "BatchKV | None":
        """Rows as one batch, each right-aligned (left padding as holes); a None row holds no token yet.
        None when no row holds one."""
        first = next((r for r in rows if r is not None), None)
        if first is None:
            return None
        width = max(len(r) for r in rows if r is not None)
        layers = []
        for n in range(len(first.keys)):
            k = first.keys[n].new_zeros((len(rows), first.keys[n].shape[0], width, first.keys[n].shape[-1]))
            v = first.values[n].new_zeros((len(rows), first.values[n].shape[0], width, first.values[n].shape[-1]))
            for i, r in enumerate(rows):
                if r is not None:
                    k[i, :, width - len(r) :] = r.keys[n]
                    v[i, :, width - len(r) :] = r.values[n]
            layers.append((k, v))
        real = torch.zeros((len(rows), width), dtype=torch.long, device=first.keys[0].device)
        for i, r in enumerate(rows):
            if r is not None:
                real[i, width - len(r) :] = 1
        return cls(DynamicCache(ddp_cache_data=layers), real, [list(r.tokens) if r is not None else [] for r in rows])
