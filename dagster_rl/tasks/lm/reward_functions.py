"""A rubric's reward functions, called as TRL calls them: `f(prompts=[...], completions=[...],
completion_ids=[...], **columns) -> list[float | None]`, one completion at a time (lists of one), in
a worker process with the function's `timeout_s` (`runtime.function_workers`).

What a function returns is checked before it is a reward: one value per completion, each a finite
number or None (no opinion). Anything else (it raised, returned another length, a NaN, text, or
outlived its timeout, or its worker died) is a `RewardFunctionError` naming the function, the trial
and the error: the trial's judgement fails (retried as the judge's retries say, then the trial is
skipped), never scored 0 and never stored.

The bytes of each function's file (`dagster_rl.base.plugins.source_of`: the `.py` in the experiments
folder, or the module's source file) are in the keys of the rewards and evaluations they score:
editing the file scores again; a worker refuses a file whose bytes differ from the key's.
"""

import hashlib
import math
from typing import Any

from dagster_rl.base.errors import DagsterRLError
from dagster_rl.base.plugins import source_of
from dagster_rl.runtime.function_workers import Callee, FunctionFailed, FunctionWorkers
from dagster_rl.tasks.lm.settings import RewardFunction


class RewardFunctionError(DagsterRLError):
    """A reward function gave no usable value for a trial."""


def callees(functions: tuple[RewardFunction, ...]) -> tuple[Callee, ...]:
    """The functions as a worker loads them, each with the sha256 of its source's bytes as they are now."""
    return tuple(
        Callee(
            f.function,
            str(f.folder) if f.folder is not None else None,
            hashlib.sha256(source_of(f.function, f.folder)).hexdigest(),
        )
        for f in functions
    )


def key_inputs(called: tuple[Callee, ...]) -> dict[str, Any]:
    """What a key holds of the functions beyond the rubric's settings: their sources' bytes (hashed)."""
    return {"functions": [{"function": c.reference, "source_sha256": c.source_sha256} for c in called]} if called else {}


def call(
    workers: FunctionWorkers,
    index: int,
    function: RewardFunction,
    trial_id: str,
    prompt: str,
    completion: str,
    completion_ids: list[int],
    columns: dict[str, Any],
) -> float | None:
    """The function's value for one completion: a finite number, or None (no opinion)."""
    what = f"reward function {function.function}"
    kwargs = {
        **{name: [value] for name, value in columns.items()},
        "prompts": [prompt],
        "completions": [completion],
        "completion_ids": [list(completion_ids)],
    }
    try:
        result = workers.call(index, kwargs, function.timeout_s)
    except FunctionFailed as e:
        if e.how == "raised":
            raise RewardFunctionError(f"{what} raised on trial {trial_id}: {e.detail}") from None
        if e.how == "timeout":
            raise RewardFunctionError(
                f"{what} {e.detail} on trial {trial_id} (its timeout_s: {function.timeout_s:g}); its worker process was killed"
            ) from None
        if e.how == "load":
            raise RewardFunctionError(f"{what} could not be loaded (trial {trial_id}): {e.detail}") from None
        raise RewardFunctionError(f"{what} on trial {trial_id}: {e.detail}") from None
    if not isinstance(result, list):
        raise RewardFunctionError(
            f"{what} returned {_shown(result)} on trial {trial_id}: it must return a list, one float or None per completion"
        )
    if len(result) != 1:
        raise RewardFunctionError(
            f"{what} returned {len(result)} values for 1 completion on trial {trial_id}: one float or None per completion"
        )
    value = result[0]
    if value is None:
        return None
    if not isinstance(value, (int, float)):  # a bool is a number, as TRL sums it: 1.0 or 0.0
        raise RewardFunctionError(f"{what} returned {_shown(value)} on trial {trial_id}: a reward is a number, or None")
    if not math.isfinite(value):
        raise RewardFunctionError(
            f"{what} returned {value} on trial {trial_id}: a reward is a finite number, or None for no opinion"
        )
    return float(value)


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{text[:80]}{'...' if len(text) > 80 else ''} (a {type(value).__name__})"
