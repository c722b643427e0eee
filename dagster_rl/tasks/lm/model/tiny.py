"""A tiny causal LM built in code: what the tests and the CPU example train.

`save_tiny_model(dir)` writes a normal Hugging Face model folder (config, safetensors, tokenizer
files) that `AutoModelForCausalLM.from_pretrained(dir)` and `AutoTokenizer.from_pretrained(dir)`
load, so the tiny model goes through exactly the code path a real base model does. The weights are a
pure function of the seed.

The tokenizer is a real Qwen2 byte-level BPE whose vocabulary is the specials, the digits and the
words of the synthetic task (68 tokens), trained in code on those words. (transformers 5 loads every
`qwen2` model folder with `Qwen2Tokenizer` whatever `tokenizer_config.json` names, so a WordLevel
tokenizer would be silently replaced; a BPE that Qwen2Tokenizer rebuilds exactly is what survives.)
Digits are always single tokens, and decoding gives back the text exactly ("12" stays "12").

Built-in models, by name (`builtin:<name>`; what a name builds never changes, since machines cache
the folder by name): `tiny-qwen2` (the 68-token vocabulary above, hidden 64, 2 layers, no chat
template), `tiny-qwen2-agent` for the text environments of `dagster_rl.tasks.agent` (`tasks.agent.tiny`: every
byte, each word of the `secret_search` text world one token, ChatML; hidden 128 with 4 heads, 2 layers),
`tiny-qwen2-agent-gain8` (the same, with the final norm's weight 8 instead of 1: see `Builtin.output_gain`),
`tiny-qwen2-gsm8k` for the GSM8K-format word problems of `tasks.lm.data.word_problems`: every
byte plus each word of their vocabulary as one token, ChatML special tokens and a chat template
(`<|im_start|>user ... <|im_end|>`, eos `<|im_end|>`), hidden 64, 2 layers; and `tiny-qwen2-vllm`,
a model a real vLLM serves on the CPU: `tiny-qwen2`'s tokenizer, hidden 128 with 4 heads (head size
32: vLLM's CPU attention runs 32, 64, 80, ... and not 16), and the sampling defaults a real model
folder carries in its `generation_config.json`: Qwen2.5-Instruct's (`QWEN25_INSTRUCT_SAMPLING`,
with two eos ids), which a server must not apply to rollouts the trainer scores.
"""

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, Qwen2Config
from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

from dagster_rl.tasks.lm.model.build import building
from dagster_rl.tasks.lm.model.cache import cached_folder, model_cache_dir
from dagster_rl.tasks.lm.model.packaged import PACKAGED, provision
from dagster_rl.tasks.lm.model.tokenizers import gsm8k_tokenizer, tiny_tokenizer


def tiny_config(vocab_size: int, pad_id: int, eos_id: int, hidden: int = 64, layers: int = 2) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=None,
        use_cache=True,
    )


# The sampling defaults of Qwen2.5-Instruct's generation_config.json (its eos ids are its own vocabulary's).
QWEN25_INSTRUCT_SAMPLING = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}


@dataclass(frozen=True)
class Builtin:
    """A model built in code: its tokenizer, its size, the seed of its random weights, the
    sampling defaults its generation_config.json carries (None: transformers' own file), and the
    weight of its final norm.

    `output_gain`: logits are the final norm's output (RMS 1 per unit of gain, ~11 over hidden 128)
    against lm_head's rows as drawn (std 0.02, norm ~0.23), so at gain 1 no hidden state reaches a
    logit above ~2.5: over the agent's ~400 tokens a policy that cannot adapt lm_head (vLLM's LoRA
    adapts the attention and MLP projections only) stays near uniform when sampled, whatever it
    learns. At gain 8 the reach is ~20 (measured: `tiny_agent`'s sampled episodes went from 1 turn, a
    bad action, to 2.7 turns after the warm-up; docs/agents.md)."""

    tokenizer: Callable[[], Qwen2Tokenizer]
    seed: int = 0
    hidden: int = 64
    layers: int = 2
    generation: dict | None = None
    output_gain: float = 1.0  # the final norm's weight: how far the logits of lm_head as drawn reach


def _agent_tokenizer() -> Qwen2Tokenizer:
    """`dagster_rl.tasks.agent.tiny`'s, imported by name when built (as `task.BUILTIN_TASKS` names a task's
    module): the agent's package imports this one, not the other way."""
    return importlib.import_module("dagster_rl.tasks.agent.tiny").agent_tokenizer()


BUILTINS = {
    "tiny-qwen2": Builtin(tiny_tokenizer),
    "tiny-qwen2-gsm8k": Builtin(gsm8k_tokenizer),
    "tiny-qwen2-vllm": Builtin(tiny_tokenizer, hidden=128, generation=QWEN25_INSTRUCT_SAMPLING),
    "tiny-qwen2-agent": Builtin(_agent_tokenizer, hidden=128),
    "tiny-qwen2-agent-gain8": Builtin(_agent_tokenizer, hidden=128, output_gain=8.0),
}


def tiny_model(seed: int = 0, builtin: str = "tiny-qwen2") -> PreTrainedModel:
    """Random weights drawn from `seed` alone; the global RNG is left as it was."""
    spec = BUILTINS[builtin]
    tok = spec.tokenizer()
    config = tiny_config(len(tok), tok.pad_token_id, tok.eos_token_id, hidden=spec.hidden, layers=spec.layers)
    with building(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if spec.output_gain != 1.0:
            with torch.no_grad():
                model.model.norm.weight.fill_(spec.output_gain)
    return model.eval()


def save_tiny_model(directory: Path | str, seed: int = 0, builtin: str = "tiny-qwen2") -> Path:
    """Write a built-in model and its tokenizer as a Hugging Face model folder; return the folder."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    spec = BUILTINS[builtin]
    tiny_model(seed, builtin).save_pretrained(directory, safe_serialization=True)
    tok = spec.tokenizer()
    tok.save_pretrained(directory)
    if spec.generation is not None:  # as a real model folder has it: sampling defaults, and two eos ids (eos, then pad)
        generation = {**spec.generation, "eos_token_id": [tok.eos_token_id, tok.pad_token_id], "pad_token_id": tok.pad_token_id}
        (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return directory


BUILTIN_PREFIX = "builtin:"


def resolve_model(name: str) -> str:
    """`builtin:tiny-qwen2` -> a model folder built in code once per machine; anything else as given.

    Experiments and checkpoints keep the logical name, so artifact keys do not depend on where a
    machine keeps its model cache.
    """
    if not name.startswith(BUILTIN_PREFIX):
        return name
    builtin = name[len(BUILTIN_PREFIX) :]
    if builtin in PACKAGED:  # a pretrained model that ships in a package, converted once
        return str(provision(builtin, model_cache_dir()))
    if builtin not in BUILTINS:
        raise ValueError(f"no built-in model {builtin!r}; built-in models: {', '.join([*BUILTINS, *PACKAGED])}")
    seed = BUILTINS[builtin].seed
    return str(cached_folder(model_cache_dir(), builtin, lambda folder: save_tiny_model(folder, seed, builtin), name))
