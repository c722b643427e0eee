"""Seeded fault injection. Faults fire on the first attempt only, so retries recover from them."""

import random
from collections.abc import Sequence
from typing import Protocol, TypeVar

from dagster_rl.base.hashing import seed_of


class InjectedFault(RuntimeError):
    """A transient failure injected by the experiment's `faults` settings."""


def maybe_fail(rate: float, attempt: int, *seed_parts: object) -> None:
    if attempt == 0 and rate > 0.0 and random.Random(seed_of("fault", *seed_parts)).random() < rate:
        raise InjectedFault(f"injected fault ({'/'.join(map(str, seed_parts))}, rate {rate}, attempt {attempt})")


class _Trial(Protocol):
    @property
    def trial_id(self) -> str: ...


T = TypeVar("T", bound=_Trial)


def flaky_trials(requests: Sequence[T], rate: float, attempt: int, seed: int) -> tuple[list[T], dict[str, InjectedFault]]:
    """An attempt of trials under `faults.flaky_trial_rate`: the requests it plays, and the injected
    failure of each of the others (by trial id)."""
    healthy, failed = [], {}
    for r in requests:
        try:
            maybe_fail(rate, attempt, seed, "trial", r.trial_id)
            healthy.append(r)
        except InjectedFault as e:
            failed[r.trial_id] = e
    return healthy, failed
