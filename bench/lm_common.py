"""What the language-model benchmarks share: a model folder of a chosen size, its policy, the prompts.

The model is the project's tiny Qwen2 (tokenizer built in code, nothing downloaded) at the default
size (hidden 64, 2 layers) or a larger one, written as a normal Hugging Face folder so that every
engine loads it the way it loads a real base model.
"""

import os
import resource
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from transformers import AutoModelForCausalLM

from dagster_rl.tasks.lm.model.policy import Policy, load_policy
from dagster_rl.tasks.lm.model.tiny import tiny_config
from dagster_rl.tasks.lm.model.tokenizers import tiny_tokenizer
from dagster_rl.tasks.lm.settings import LoRASettings, PolicySettings

# the tests' adapter: every projection of every layer plus the head
TARGETS = ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
LORA = LoRASettings(rank=8, alpha=16, dropout=0.0, target_modules=TARGETS, init_seed=7)


def save_model(directory: Path, hidden: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """The tiny model (hidden 64, 2 layers: exactly `tiny.save_tiny_model`) or a larger one, as an HF folder."""
    tok = tiny_tokenizer()
    config = tiny_config(len(tok), tok.pad_token_id, tok.eos_token_id, hidden=hidden, layers=layers)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tok.save_pretrained(directory)
    return directory


def make_policy(model_dir: Path, lora: LoRASettings = LORA, device: str = "cpu", dtype: str = "float32") -> Policy:
    return load_policy(PolicySettings(base_model=str(model_dir), lora=lora, device=device, dtype=dtype))


def peak_rss_mib() -> float:
    """This process's resident-set high-water mark (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
