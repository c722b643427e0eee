"""Retries and time limits for one call of an environment."""

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Limits:
    """An environment's limits on each of its calls (a trial, a judgement, an update)."""

    max_retries: int = 2
    timeout_s: float = 60.0
    max_concurrency: int = 8


class AttemptsExhausted(RuntimeError):
    """A call failed on every attempt; `errors` holds what each attempt raised."""

    def __init__(self, what: str, errors: list[BaseException]):
        self.errors = errors
        super().__init__(f"{what} failed after {len(errors)} attempt(s): {describe(errors[-1])}")


def describe(error: BaseException) -> str:
    """`NotADirectoryError: [Errno 20] Not a directory: '/srv/sandboxes'`: the type and the message,
    which for an OSError names its path (its repr does not)."""
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else repr(error)


def with_retries(what: str, fn: Callable[[int], T], max_retries: int, timeout_s: float) -> T:
    """Call fn(attempt) until it succeeds, at most 1 + max_retries times.

    An in-process attempt cannot be preempted: one that returns after `timeout_s` has its result
    discarded and counts as a failed attempt.
    """
    errors: list[BaseException] = []
    for attempt in range(max_retries + 1):
        start = time.monotonic()
        try:
            result = fn(attempt)
        except Exception as e:  # every failure of an attempt is retried
            errors.append(e)
            continue
        if time.monotonic() - start > timeout_s:
            errors.append(TimeoutError(f"{what} took longer than {timeout_s} s"))
            continue
        return result
    raise AttemptsExhausted(what, errors)
