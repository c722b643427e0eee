"""The tiny model learns the synthetic copy task in a few in-process GRPO steps on the CPU."""

import statistics

import pytest

from dagster_rl.tasks.lm.data.prompts import SyntheticPrompts, load_prompt_set
from dagster_rl.tasks.lm.evaluation import evaluate
from dagster_rl.tasks.lm.in_memory import inprocess_step
from dagster_rl.tasks.lm.model.policy import make_optimizer
from dagster_rl.tasks.lm.settings import GRPOLMSettings, SamplingSettings
from tests.lm_fixtures import ON_POLICY_ROUNDING, RUBRIC, fresh_policy

STEPS = 8


@pytest.mark.numerics
def test_tiny_model_learns_in_a_few_steps(tiny_dir):
    policy = fresh_policy(tiny_dir)
    grpo = GRPOLMSettings(learning_rate=0.01, kl_beta=0.01, clip_eps=0.2, max_grad_norm=1.0)
    optimizer = make_optimizer(policy, grpo)
    prompt_set = load_prompt_set(SyntheticPrompts(ops=("copy",), n_eval=2))
    sampling = SamplingSettings(temperature=1.0, max_new_tokens=1)
    before = evaluate(policy, prompt_set, RUBRIC, max_new_tokens=1)
    rewards, accuracy = [], []
    for step in range(STEPS):
        _, scored, metrics = inprocess_step(policy, optimizer, prompt_set, 0, step, 8, 8, sampling, RUBRIC, grpo)
        rewards.append(metrics.mean_reward)
        accuracy.append(statistics.fmean(float(r.correct) for r in scored))
        if step == 0:  # on-policy: ratio 1 up to the float rounding of the sampler against the trainer
            assert metrics.ratio_max_dev < ON_POLICY_ROUNDING and metrics.kl == 0.0
    after = evaluate(policy, prompt_set, RUBRIC, max_new_tokens=1)
    first, last = statistics.fmean(rewards[:2]), statistics.fmean(rewards[-2:])
    print(
        f"mean reward per step {[round(r, 3) for r in rewards]}; accuracy {[round(a, 3) for a in accuracy]}; "
        f"held-out greedy reward {before.mean_reward} -> {after.mean_reward}"
    )
    # random policy over 68 tokens: ~10/68 digits (format 0.5) and ~1/68 correct -> reward ~0.08
    assert first < 0.15
    assert last > first + 0.3
    assert policy.version == STEPS
