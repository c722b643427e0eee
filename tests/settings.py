"""The shipped experiments' settings at the sizes the tests run them, and folders of experiment files."""

from pathlib import Path

import yaml

from tests import REPO

# tiny_grpo's steps at the size of the driver's plumbing tests (caching, lineage, retries, trainers,
# servers): 8 prompts x 8 samples. The shipped 64 prompts a step are what its learning needs; tests of
# the learning itself run the shipped settings.
TINY_PLUMBING = {"prompts_per_step": 8, "n_samples": 8, "min_trials_per_step": 32}
SESSION_STEPS = ("0000", "0001", "0002")


def shipped_settings(experiment: str, **overrides) -> dict:
    """The settings of `experiments/<name>.yaml`, with overrides merged one level deep."""
    raw = yaml.safe_load((REPO / "experiments" / f"{experiment}.yaml").read_text())
    for key, value in overrides.items():
        raw[key] = {**raw[key], **value} if isinstance(value, dict) and isinstance(raw.get(key), dict) else value
    return raw


def demo_settings(**overrides) -> dict:
    """The demo experiment's settings, with overrides merged one level deep."""
    return shipped_settings("demo", **overrides)


def tiny_grpo(**overrides) -> dict:
    """tiny_grpo's settings at the plumbing size (`TINY_PLUMBING`), with overrides merged one level deep."""
    return shipped_settings("tiny_grpo", **{**TINY_PLUMBING, **overrides})


# vLLM's LoRA adapts no lm_head: an openai_server experiment may not target it (tiny_grpo's does)
SERVED_LORA = {
    "rank": 8,
    "alpha": 16,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "init_seed": 7,
}


def served(**overrides) -> dict:
    """`tiny_grpo()` sampled through an OpenAI-compatible server (`openai_server`), on builtin:tiny-qwen2
    with a LoRA that vLLM can serve."""
    policy = {"base_model": "builtin:tiny-qwen2", "lora": SERVED_LORA, **overrides.pop("policy", {})}
    return tiny_grpo(rollout={"backend": "openai_server"}, policy=policy, **overrides)


def session_settings(**overrides) -> dict:
    """`tiny_grpo` without its warm-up, trained by 2 torchrun ranks (a trainer session by default)."""
    trainer = {"backend": "torchrun", "nproc_per_node": 2, "threads_per_process": 1, **overrides.pop("trainer", {})}
    return shipped_settings("tiny_grpo", warmup=None, trainer=trainer, **overrides)


def write_experiments(folder: Path, *raws: dict) -> Path:
    """One YAML file per experiment in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    for raw in raws:
        (folder / f"{raw['name']}.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    return folder
