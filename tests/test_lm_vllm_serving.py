"""The vLLM command an experiment needs: the adapter's rank rounded up to one vLLM accepts, a model
length that holds every prompt and completion of the task, the served name, and bfloat16 refused on a
CPU without it."""

import pytest

from dagster_rl.base.errors import DagsterRLError
from dagster_rl.tasks.lm.experiment import LMExperiment
from dagster_rl.tasks.lm.model import cpu_bf16
from dagster_rl.tasks.lm.rollout.vllm_serving import vllm_command_for, vllm_lora_rank
from tests.settings import shipped_settings


def gsm8k_on_vllm(**overrides) -> LMExperiment:
    raw = shipped_settings("tiny_gsm8k", rollout={"backend": "openai_server"}, **overrides)
    raw["policy"]["lora"]["target_modules"] = ["q_proj", "v_proj"]
    return LMExperiment.model_validate(raw)


def test_the_lora_rank_rounds_up_to_one_vllm_accepts():
    assert [vllm_lora_rank(r) for r in (1, 2, 8, 9, 16, 17, 64)] == [1, 8, 8, 16, 16, 32, 64]
    with pytest.raises(DagsterRLError, match="above vLLM's largest"):
        vllm_lora_rank(513)


def test_the_command_serves_the_experiments_model_within_a_length_that_holds_its_sequences():
    exp = gsm8k_on_vllm()
    command = vllm_command_for(exp, 8123, python="py")
    assert command[:3] == ["env", "VLLM_CPU_KVCACHE_SPACE=1", "VLLM_CPU_OMP_THREADS_BIND=nobind"]
    assert "--served-model-name=builtin:tiny-qwen2-gsm8k" in command and "--max-lora-rank=16" in command
    assert "--max-model-len=256" in command  # the tiny model's context, below the default 1024
    with pytest.raises(
        DagsterRLError, match=r"its longest prompt plus completion is \d+ tokens, more than the 40 vLLM would serve"
    ):
        vllm_command_for(exp, 8123, max_model_len=40)


def test_bfloat16_is_refused_before_the_server_starts_on_a_cpu_without_it(monkeypatch):
    monkeypatch.setattr(cpu_bf16.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_bf16, "cpu_flags", lambda: frozenset({"avx2"}))
    with pytest.raises(DagsterRLError, match=r"policy.dtype \(vLLM's --dtype\) is bfloat16"):
        vllm_command_for(gsm8k_on_vllm(policy={"dtype": "bfloat16"}), 8123)
