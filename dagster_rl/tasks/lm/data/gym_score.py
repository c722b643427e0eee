"""reasoning-gym's `score_answer`, as a worker process calls it (`runtime.function_workers`): the
dataset built once per worker, reasoning-gym imported when the worker starts, not within a call's
deadline."""

import json
from typing import Any

import reasoning_gym  # noqa: F401  (imported as the worker loads this module: its import is not a call's time)

from dagster_rl.tasks.lm.data.gym import create

_DATASETS: dict[str, Any] = {}


def score(dataset: str, config: dict[str, Any], answer: str | None, entry: dict[str, Any]) -> float:
    """The dataset's `score_answer(answer, entry)`: in [0, 1]."""
    key = json.dumps([dataset, config], sort_keys=True)
    if key not in _DATASETS:
        _DATASETS[key] = create(dataset, config, seed=0, size=1)
    return float(_DATASETS[key].score_answer(answer, entry))
