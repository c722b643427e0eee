"""Shared helpers of the language-model tests: policies over the tiny model (the `tiny_dir` fixture of
conftest.py), a rollout batch, float32's bounds on on-policy ratios and gradients, worker subprocesses."""

import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from dagster_rl.tasks.lm.data.prompts import SyntheticPrompts, load_prompt_set, prompts_for_step
from dagster_rl.tasks.lm.model.policy import Policy, load_policy
from dagster_rl.tasks.lm.records import plan_requests
from dagster_rl.tasks.lm.rewards import LMRubric, score
from dagster_rl.tasks.lm.rollout.hf import generate_rollouts
from dagster_rl.tasks.lm.settings import GRPOLMSettings, LoRASettings, PolicySettings, SamplingSettings
from tests import REPO

TINY_TARGETS = ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
RUBRIC = LMRubric(accuracy=1.0, format=0.5)
SAMPLING = SamplingSettings(temperature=1.0, top_p=1.0, max_new_tokens=3)
GRPO = GRPOLMSettings(learning_rate=0.01, kl_beta=0.01, clip_eps=0.2, max_grad_norm=1.0)


def policy_settings(tiny_dir: Path) -> PolicySettings:
    return PolicySettings(base_model=str(tiny_dir), lora=LoRASettings(rank=8, alpha=16, target_modules=TINY_TARGETS, init_seed=7))


def fresh_policy(tiny_dir: Path, checkpoint: dict[str, bytes] | None = None) -> Policy:
    return load_policy(policy_settings(tiny_dir), checkpoint)


def step_batch(
    policy: Policy, step: int, prompts: int = 4, samples: int = 4, seed: int = 0, sampling: SamplingSettings = SAMPLING
):
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
EPS32 = torch.finfo(torch.float32).eps
# How far from 1 an on-policy importance ratio may be in float32: the sampler and the trainer compute
# the same log-probs with other batch shapes (padding, batch size, the KV cache's step-by-step
# attention against one packed pass), so each dot product is summed in another order, within
# (n - 1) eps32 sum|terms| for n up to 4 x hidden = 256 in the tiny models (255 eps32 = 3e-5 of
# sum|terms|), compounded over 2 layers and the log-softmax. Measured: <= 1e-6 with AVX-512 and AVX2
# kernels, 1.4e-5 with ATEN_CPU_CAPABILITY=default (retried trials, generated in other batches). An
# off-policy step is far above it: 1e-3 and more one step behind, 0.59-1.04 sampled from a generation
# config's truncated distribution.
ON_POLICY_ROUNDING = 1e-4
# The on_policy check's float32 bound on |log p_trainer - log p_sampler| (LMExperiment's default), which a
# sampler in another process (vLLM, `dagster-rl serve`) must keep.
FLOAT32_TOLERANCE = 1e-3


@contextmanager
def gradient_terms(policy: Policy) -> Iterator[dict[str, torch.Tensor]]:
    """Per LoRA matrix of the policy (named as in `policy.trainable()`), the sum over the token positions p
    of every backward inside the block of |g_p| |x_p|^T: the absolute values of the terms its gradient
    sums, sum_p g_p x_p^T (g_p the gradient at the matrix's output, x_p its input at position p)."""
    from peft.tuners.lora import Linear as LoraLinear

    names = {n for n, _ in policy.trainable()}
    terms: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in policy.model.named_modules():
        if isinstance(module, LoraLinear):
            for part, adapter in ((p, a) for p in ("lora_A", "lora_B") for a in getattr(module, p)):
                key = f"{name}.{part}.{adapter}.weight"
                if key not in names:  # a frozen adapter (a KL reference) gets no gradient
                    continue

                def keep_input(mod, args, out):
                    mod.kept_input = args[0].detach()

                def add_terms(mod, grad_in, grad_out, key=key):
                    g = grad_out[0].reshape(-1, grad_out[0].shape[-1]).abs().double()
                    x = mod.kept_input.reshape(-1, mod.kept_input.shape[-1]).abs().double()
                    terms[key] = terms.get(key, 0.0) + (g.T @ x).cpu()

                linear = getattr(module, part)[adapter]
                hooks += [linear.register_forward_hook(keep_input), linear.register_full_backward_hook(add_terms)]
    try:
        with warnings.catch_warnings():  # torch notes that the first layer's input needs no gradient: so be it
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            yield terms
    finally:
        for hook in hooks:
            hook.remove()


def assert_within_summation_bound(
    got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], terms: dict[str, torch.Tensor], n: int
) -> float:
    """Gradients that add the same n per-position terms in other orders agree within the bound of
    float32 summation: a sum of n terms in any order is within (n - 1) u sum|terms| of the exact sum
    (u = eps32 / 2; Higham, Accuracy and Stability of Numerical Algorithms, eq. 4.4), so two orders
    differ by at most (n - 1) eps32 sum|terms|, element by element. (The terms' factors come out of the
    same forward and backward in both, up to their own rounding, which this leaves to the bound's slack:
    measured, the worst element is at most 15 eps32 sum|terms| on AVX-512, AVX2 and default kernels (AVX2:
    0 to 13.9), against n - 1 = 7 to 94 in these tests; `make check-numerics` prints it per test. That
    holds where each row is padded to the same width in both layouts: a row padded otherwise is computed
    with other vector tails, its log-probs an ulp apart on AVX2 and default kernels, which the KL
    coefficient 1 - exp(ref - new) amplifies past the bound: 134 measured, test_lm_ddp.) Returns the worst
    |difference| in units of eps32 sum|terms|."""
    assert set(got) == set(expected) == set(terms), (sorted(set(got) ^ set(expected)), sorted(set(expected) ^ set(terms)))
    worst = 0.0
    for name, g in expected.items():
        diff, scale = (got[name].cpu().double() - g.cpu().double()).abs(), EPS32 * terms[name]
        excess = diff - (n - 1) * scale
        assert float(excess.max()) <= 0.0, (
            f"{name}: |difference| exceeds (n - 1) eps32 sum|terms| by {float(excess.max()):.3g} (n = {n})"
        )
        worst = max(worst, float((diff / scale.clamp_min(1e-300)).max()))
    return worst


def positions(samples) -> int:
    """Token positions of a batch of samples: the terms each LoRA gradient sums."""
    return sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
