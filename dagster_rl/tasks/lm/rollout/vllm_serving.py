"""The vLLM (CPU build) command that serves a language-model experiment's rollouts.

What a real model needs of vLLM beyond the tiny ones, derived from the experiment:

- the model folder its `policy.base_model` names (`builtin:` names resolved: the converted folder
  of `builtin:smollm2-135m-instruct`), served under that name, in its `policy.dtype`;
- `--max-lora-rank`: the smallest rank vLLM accepts that holds the adapter's;
- `--max-model-len`: 1,024 tokens (or the model's context, when shorter), checked against the longest
  prompt of the task plus the longest completion the experiment asks for. vLLM would otherwise size
  its scheduler for the model's full context (8,192 tokens for SmolLM2);
- its KV cache (`VLLM_CPU_KVCACHE_SPACE`, GiB): 1 GiB holds 1,024-token sequences of SmolLM2 many
  times over in float32 (30 layers x 2 x 3 KV heads x 64 x 4 bytes = 45 KiB a token).

    python -m dagster_rl.tasks.lm.rollout.vllm_serving experiments/smollm2_arithmetic.yaml --port 8000   # prints it
"""

import argparse
import json
import shlex
from pathlib import Path

from dagster_rl.base.errors import DagsterRLError
from dagster_rl.inference.server_process import vllm_cpu_command
from dagster_rl.tasks.lm.data.prompts import encode_prompt, load_prompt_set
from dagster_rl.tasks.lm.experiment import LMExperiment
from dagster_rl.tasks.lm.model.cpu_bf16 import check_bf16_cpu
from dagster_rl.tasks.lm.model.tiny import resolve_model

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.32's LoRAConfig.max_lora_rank choices
MAX_MODEL_LEN = 1024
KVCACHE_GIB = 1


def vllm_lora_rank(rank: int) -> int:
    """The smallest `--max-lora-rank` vLLM accepts that serves an adapter of `rank`."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise DagsterRLError(f"LoRA rank {rank} is above vLLM's largest --max-lora-rank, {VLLM_LORA_RANKS[-1]}")


def model_context(folder: str) -> int | None:
    """The model folder's context length (`max_position_embeddings`), when its config states one."""
    config = json.loads((Path(folder) / "config.json").read_text())
    text = config.get("text_config", config)
    return text.get("max_position_embeddings")


def longest_sequence(exp: LMExperiment, folder: str) -> int:
    """The longest prompt of the task (every split, in the model's chat template) plus the longest
    completion the experiment asks for (rollouts or evaluation)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = load_prompt_set(exp.task.source, exp.seed)
    longest = max(len(encode_prompt(tokenizer, it, prompts.template)) for it in [*prompts.train, *prompts.eval])
    return longest + max(exp.sampling.max_new_tokens, exp.eval_max_new_tokens)


def vllm_command_for(
    exp: LMExperiment,
    port: int,
    *,
    python: str = "python",
    host: str = "127.0.0.1",
    threads: int | None = None,
    max_model_len: int = MAX_MODEL_LEN,
) -> list[str]:
    """The command that serves `exp`'s base model and adapters on vLLM's CPU build (`vllm_cpu_command`)."""
    if exp.policy.dtype == "bfloat16":
        check_bf16_cpu(f"experiment {exp.name}'s policy.dtype (vLLM's --dtype)")
    folder = resolve_model(exp.policy.base_model)
    length = min(max_model_len, model_context(folder) or max_model_len)
    needed = longest_sequence(exp, folder)
    if needed > length:
        raise DagsterRLError(
            f"experiment {exp.name}: its longest prompt plus completion is {needed} tokens, more than the {length} vLLM "
            "would serve (--max-model-len); shorten the prompts or max_new_tokens, or raise max_model_len"
        )
    return vllm_cpu_command(
        folder,
        port,
        python=python,
        host=host,
        dtype=exp.policy.dtype,
        max_lora_rank=vllm_lora_rank(exp.policy.lora.rank),
        served_model_name=exp.policy.base_model,
        threads=threads,
        max_model_len=length,
        kvcache_gib=KVCACHE_GIB,
    )


def main(argv: list[str] | None = None) -> int:
    from dagster_rl.core.experiment_files import load_experiment

    parser = argparse.ArgumentParser(description="Print the vLLM (CPU build) command that serves an experiment's rollouts.")
    parser.add_argument("experiment", type=Path, help="the experiment's YAML file")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--python", default=".venv-vllm/bin/python", help="the Python of vLLM's venv")
    args = parser.parse_args(argv)
    exp = load_experiment(args.experiment)
    if not isinstance(exp, LMExperiment):
        parser.error(f"{args.experiment} is not a language-model experiment")
    print(shlex.join(vllm_command_for(exp, args.port, python=args.python, host=args.host)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
