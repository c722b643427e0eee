"""The prefix cache of `dagster-rl serve`: the KV cache of each sequence it served, kept by its tokens,
so that a request that continues one (an episode's next turn: the sequence so far, then the
observation; another sample of a prompt) computes only the tokens after the shared prefix.

Entries are one sequence each (`kv_cache.RowKV`: the prompt and the completion tokens the model was
fed), stored under the model that computed them (an adapter's load, or the base: a reloaded adapter
is another key) and found by their blocks: every multiple of `BLOCK` tokens of an entry indexes it,
and a request's longest indexed block prefix leads to an entry, then the match goes on token by token.
At least one token of a prompt is always computed (its logits start the completion). An entry that
a newer one extends is dropped; past `max_bytes` the least recently used go.

The numbers are those of a forward of the whole sequence to float rounding (`kv_cache`): a server's
log-probs already depend on the batch a request lands in, and the trainer's check (`on_policy`)
holds them to the same tolerance.
"""

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from dagster_rl.tasks.lm.rollout.kv_cache import RowKV

BLOCK = 16

Key = tuple[str, tuple[int, ...]]


class PrefixCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[Key, RowKV] = OrderedDict()  # least recently used first
        self._blocks: dict[Key, Key] = {}  # (model, a block prefix) -> the entry it leads to
        self._bytes = 0
        self._lock = threading.Lock()
        self.looked_up = 0  # prompt tokens asked for
        self.reused = 0  # of those, found in the cache

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, model: str, prompt: Sequence[int]) -> RowKV | None:
        """The longest cached prefix of `prompt` (at most all but its last token) computed by `model`."""
        with self._lock:
            self.looked_up += len(prompt)
            tokens = tuple(prompt)
            for n in range((len(tokens) - 1) // BLOCK * BLOCK, 0, -BLOCK):
                key = self._blocks.get((model, tokens[:n]))
                entry = self._entries.get(key) if key is not None else None
                if entry is None:
                    continue
                m, limit = n, min(len(entry), len(tokens) - 1)
                while m < limit and entry.tokens[m] == tokens[m]:
                    m += 1
                self._entries.move_to_end(key)  # type: ignore[arg-type]
                self.reused += m
                return entry.prefix(m)
            return None

    def store(self, model: str, rows: Iterable[RowKV]) -> None:
        """Keep each row under `model`; the entries a row extends go."""
        with self._lock:
            for row in rows:
                if len(row) < BLOCK or row.nbytes > self.max_bytes:
                    continue
                key = (model, row.tokens)
                for n in range(BLOCK, len(row) + 1, BLOCK):
                    older = self._blocks.get((model, row.tokens[:n]))
                    if older is not None and older != key and row.tokens[: len(older[1])] == older[1]:
                        self._remove(older)  # a prefix of this row: this row holds all it held
                if key in self._entries:
                    self._remove(key)
                self._entries[key] = row
                self._bytes += row.nbytes
                for n in range(BLOCK, len(row) + 1, BLOCK):
                    self._blocks[(model, row.tokens[:n])] = key
                while self._bytes > self.max_bytes:
                    self._remove(next(iter(self._entries)))

    def drop(self, model: str) -> None:
        """Forget every entry `model` computed (an adapter unloaded, or loaded anew in place)."""
        with self._lock:
            for key in [k for k in self._entries if k[0] == model]:
                self._remove(key)

    def _remove(self, key: Key) -> None:
        row = self._entries.pop(key)
        self._bytes -= row.nbytes
        model, tokens = key
        for n in range(BLOCK, len(tokens) + 1, BLOCK):
            if self._blocks.get((model, tokens[:n])) == key:
                del self._blocks[(model, tokens[:n])]
