"""Seeded fault injection. Faults fire on the first attempt only, so retries recover from them."""

import random

from dagster_rl.core.hashing import seed_of


class InjectedFault(RuntimeError):
    """A transient failure injected by the experiment's `faults` settings."""


def maybe_fail(rate: float, attempt: int, *seed_parts: object) -> None:
    if attempt == 0 and rate > 0.0 and random.Random(seed_of("fault", *seed_parts)).random() < rate:
        raise InjectedFault(f"injected fault ({'/'.join(map(str, seed_parts))}, rate {rate}, attempt {attempt})")
