"""The language-model path on a GPU, and what holds without one.

Tests marked `cuda` (here, and the 2-rank NCCL case of `test_lm_ddp`) run only where torch sees a
GPU (`pytest -m cuda`); elsewhere they are skipped with the reason. The rest run everywhere: device resolution, the process-group backend, and that
the device is not part of what a step's keys hash.
"""

import pytest
import torch

from dagster_rl.base.errors import DagsterRLError
from dagster_rl.tasks.lm.model.policy import checkpoint_bytes, make_optimizer, resolve_device
from dagster_rl.tasks.lm.records import plan_requests
from dagster_rl.tasks.lm.rollout.hf import generate_rollouts
from dagster_rl.tasks.lm.settings import PolicySettings
from dagster_rl.tasks.lm.train.entrypoint import process_group_backend
from dagster_rl.tasks.lm.train.trainer import build_samples, train_step
from tests.lm_fixtures import GRPO, SAMPLING, fresh_policy, policy_settings

GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not GPU, reason="no GPU: torch.cuda.is_available() is False on this machine")


def test_device_resolution_and_process_group_backend():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if GPU else "cpu")
    assert process_group_backend(torch.device("cpu")) == "gloo"
    assert process_group_backend(torch.device("cuda", 1)) == "nccl"
    if not GPU:
        with pytest.raises(DagsterRLError, match="sees no GPU"):
            resolve_device("cuda")


def test_the_device_is_in_no_key_and_the_dtype_is():
    from dagster_rl.base.hashing import content_hash

    cpu = PolicySettings(base_model="m", device="cpu")
    cuda = PolicySettings(base_model="m", device="cuda")
    assert cuda.device == "cuda" and "device" not in cuda.model_dump(mode="json")
    assert content_hash(cpu) == content_hash(cuda)
    assert content_hash(PolicySettings(base_model="m", dtype="bfloat16")) != content_hash(cpu)
    with pytest.raises(ValueError):
        PolicySettings(base_model="m", device="tpu")


def _step(policy, step=0):
    from dagster_rl.tasks.lm.data.prompts import SyntheticPrompts, load_prompt_set, prompts_for_step
    from dagster_rl.tasks.lm.rewards import score
    from tests.lm_fixtures import RUBRIC

    prompt_set = load_prompt_set(SyntheticPrompts(ops=("copy", "add")))
    requests = plan_requests(prompts_for_step(prompt_set.train, 0, step, 4), 0, step, 4)
    rollouts = generate_rollouts(policy, requests, SAMPLING, prompt_set.template)
    return rollouts, [score(r, RUBRIC) for r in rollouts]


def _train(policy, rollouts, rewards):
    samples, facts = build_samples(rollouts, rewards, GRPO.advantage_eps)
    grads = {}
    optimizer = make_optimizer(policy, GRPO)
    metrics = train_step(policy, optimizer, samples, len(samples), GRPO, facts, on_grads=grads.update)
    return metrics, {k: v.cpu() for k, v in grads.items()}, checkpoint_bytes(policy, optimizer)


@pytest.mark.cuda
@needs_gpu
def test_generation_and_training_on_cuda_agree_with_the_cpu(tiny_dir):
    from dagster_rl.tasks.lm.model.policy import load_policy

    on_cpu = fresh_policy(tiny_dir)
    on_gpu = load_policy(policy_settings(tiny_dir).model_copy(update={"device": "cuda"}))
    assert next(on_gpu.model.parameters()).device.type == "cuda"
    cpu_rollouts, rewards = _step(on_cpu)
    gpu_rollouts, _ = _step(on_gpu)
    # the uniforms come from the CPU generator everywhere: the same tokens where the logits agree
    same = sum(a.completion_token_ids == b.completion_token_ids for a, b in zip(cpu_rollouts, gpu_rollouts, strict=True))
    assert same >= len(cpu_rollouts) - 1, same
    for a, b in zip(cpu_rollouts, gpu_rollouts, strict=True):
        if a.completion_token_ids == b.completion_token_ids:
            assert a.sampling_logprobs == pytest.approx(b.sampling_logprobs, abs=1e-4)
    m_cpu, g_cpu, _ = _train(on_cpu, cpu_rollouts, rewards)
    m_gpu, g_gpu, files = _train(on_gpu, cpu_rollouts, rewards)  # the same batch on both devices
    assert m_gpu.ratio_max_dev < 1e-4 and m_gpu.kl == pytest.approx(m_cpu.kl, abs=1e-6)
    for name, g in g_cpu.items():
        torch.testing.assert_close(g_gpu[name], g, rtol=1e-3, atol=1e-6)
    assert all(t for t in files.values())  # the checkpoint is written from the GPU


@pytest.mark.cuda
@needs_gpu
def test_a_bfloat16_base_trains_a_float32_adapter_on_cuda(tiny_dir):
    from dagster_rl.tasks.lm.model.policy import load_policy

    policy = load_policy(policy_settings(tiny_dir).model_copy(update={"device": "cuda", "dtype": "bfloat16"}))
    assert {p.dtype for _, p in policy.trainable()} == {torch.float32}
    rollouts, rewards = _step(policy)
    metrics, grads, _ = _train(policy, rollouts, rewards)
    # bf16 logits of the decode and of the packed forward differ more than fp32 ones: report, bound loosely
    print(f"bf16 on-policy ratio_max_dev {metrics.ratio_max_dev:.3e}")
    assert metrics.ratio_max_dev < 0.1 and metrics.grad_norm > 0 and all(torch.isfinite(g).all() for g in grads.values())
