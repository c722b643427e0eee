"""Process-wide counts of the expensive calls (trials run, judge calls), for tests and metadata."""

import threading
from collections import Counter

_lock = threading.Lock()
_counts: Counter[str] = Counter()


def bump(name: str, n: int = 1) -> None:
    with _lock:
        _counts[name] += n


def read(name: str) -> int:
    with _lock:
        return _counts[name]


def snapshot() -> dict[str, int]:
    with _lock:
        return dict(_counts)
