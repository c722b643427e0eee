"""math-verify as an answer rule, as a worker process calls it (`runtime.function_workers`): its own
timeouts off (`parsing_timeout=None`, `timeout_seconds=None`: they use `signal.alarm`, which fails
off the main thread, math-verify #50); the worker's deadline bounds the call instead."""

import logging

from math_verify import parse, verify

# with its timeouts off it warns on every call that the caller must bound it: the worker's deadline does
logging.getLogger("math_verify").setLevel(logging.ERROR)


def score(completion: str, reference: str) -> dict:
    """{"answer": what math-verify read of the completion (None: nothing), "score": 1.0 when it equals
    the reference, else 0.0}. A reference math-verify cannot read is an error, not a wrong answer."""
    gold = parse(reference, parsing_timeout=None)
    if not gold:
        raise ValueError(f"math-verify reads nothing in the reference answer {reference[:200]!r}")
    predicted = parse(completion, parsing_timeout=None)
    if not predicted:
        return {"answer": None, "score": 0.0}
    right = verify(gold, predicted, timeout_seconds=None)
    return {"answer": str(predicted[-1]), "score": 1.0 if right else 0.0}
