"""Shared helpers of the language-model tests: the tiny model on disk, policies, a rollout batch."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

from dagster_rl.lm.policy import Policy, load_policy  # noqa: E402
from dagster_rl.lm.rewards import LMRubric, score  # noqa: E402
from dagster_rl.lm.records import plan_requests  # noqa: E402
from dagster_rl.lm.rollout_hf import generate_rollouts  # noqa: E402
from dagster_rl.lm.settings import GRPOLMSettings, LoRASettings, PolicySettings, SamplingSettings  # noqa: E402
from dagster_rl.lm.prompts import SyntheticPrompts, load_prompt_set, prompts_for_step  # noqa: E402
from dagster_rl.lm.tiny import save_tiny_model  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TINY_TARGETS = ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
RUBRIC = LMRubric(accuracy=1.0, format=0.5)
SAMPLING = SamplingSettings(temperature=1.0, top_p=1.0, max_new_tokens=3)
GRPO = GRPOLMSettings(learning_rate=0.01, kl_beta=0.01, clip_eps=0.2, max_grad_norm=1.0)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def policy_settings(tiny_dir: Path) -> PolicySettings:
    return PolicySettings(base_model=str(tiny_dir), lora=LoRASettings(rank=8, alpha=16, target_modules=TINY_TARGETS, init_seed=7))


def fresh_policy(tiny_dir: Path, checkpoint: dict[str, bytes] | None = None) -> Policy:
    return load_policy(policy_settings(tiny_dir), checkpoint)


def step_batch(policy: Policy, step: int, prompts: int = 4, samples: int = 4, seed: int = 0, sampling: SamplingSettings = SAMPLING):
    """(rollouts, rewards) of one step of the synthetic copy task with the policy as it is."""
    prompt_set = load_prompt_set(SyntheticPrompts(ops=("copy", "add")))
    items = prompts_for_step(prompt_set.train, seed, step, prompts)
    rollouts = generate_rollouts(policy, plan_requests(items, seed, step, samples), sampling, prompt_set.template)
    return rollouts, [score(r, RUBRIC) for r in rollouts]


def subprocess_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a worker subprocess needs to import this checkout."""
    env = {**os.environ, **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("RANK", None)
    return env


def run(cmd: list[str], timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, env=subprocess_env(env), cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done


PYTHON = sys.executable
