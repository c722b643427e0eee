"""Where this machine keeps its built-in model folders: $DAGSTER_RL_MODEL_CACHE, default
~/.cache/dagster_rl/models (the tiny models built in code, the packaged models converted)."""

import os
from pathlib import Path


def model_cache_dir() -> Path:
    return Path(os.environ.get("DAGSTER_RL_MODEL_CACHE", Path.home() / ".cache" / "dagster_rl" / "models"))
