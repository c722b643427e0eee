"""The GRPO loss and advantages against values computed by hand."""

import math

import pytest
import torch

from dagster_rl.core.advantages import group_normalized_advantages
from dagster_rl.tasks.lm.train.grpo_loss import grpo_sample_loss
from dagster_rl.tasks.lm.train.trainer import build_samples

EPS = 0.2
RATIOS = [1.5, 0.5, 1.0]  # above 1+eps, below 1-eps, on-policy


def _logps(ratios):
    old = torch.tensor([-1.0, -2.0, -0.5])
    new = (old + torch.log(torch.tensor(ratios))).clone().requires_grad_(True)
    return new, old


def test_positive_advantage_clips_the_ratio_above_and_keeps_it_below():
    new, old = _logps(RATIOS)
    loss, stats = grpo_sample_loss(new, old, new.detach().clone(), advantage=2.0, clip_eps=EPS, kl_beta=0.0)
    # A=+2: min(rA, clip(r)A) = min(3.0, 2.4)=2.4 | min(1.0, 1.6)=1.0 | 2.0  -> mean 1.8
    assert loss.item() == pytest.approx(-1.8, abs=1e-6)
    assert stats.ratio == pytest.approx(1.0, abs=1e-6)
    assert stats.clip_frac == pytest.approx(2 / 3)
    assert stats.kl == 0.0
    loss.backward()
    # d loss / d new_t = -(1/3) A r_t where the unclipped term is chosen, 0 where the clipped one is
    assert new.grad.tolist() == pytest.approx([0.0, -(2.0 * 0.5) / 3, -2.0 / 3], abs=1e-6)


def test_negative_advantage_clips_the_ratio_below_and_keeps_it_above():
    new, old = _logps(RATIOS)
    loss, stats = grpo_sample_loss(new, old, new.detach().clone(), advantage=-2.0, clip_eps=EPS, kl_beta=0.0)
    # A=-2: min(-3.0, -2.4)=-3.0 | min(-1.0, -1.6)=-1.6 | -2.0  -> mean -2.2
    assert loss.item() == pytest.approx(2.2, abs=1e-6)
    loss.backward()
    assert new.grad.tolist() == pytest.approx([(2.0 * 1.5) / 3, 0.0, 2.0 / 3], abs=1e-6)


def test_k3_kl_against_the_reference():
    new = torch.zeros(3, requires_grad=True)
    ref = torch.tensor([math.log(2.0), 0.0, -math.log(2.0)])
    loss, stats = grpo_sample_loss(new, new.detach().clone(), ref, advantage=0.0, clip_eps=EPS, kl_beta=0.5)
    # exp(d) - d - 1: (1 - ln2) + 0 + (ln2 - 0.5) = 0.5, mean 1/6
    assert stats.kl == pytest.approx(1 / 6, abs=1e-7)
    assert loss.item() == pytest.approx(0.5 * (1 / 6), abs=1e-7)
    assert stats.ratio == 1.0 and stats.clip_frac == 0.0
    loss.backward()
    # d/dnew of beta*mean(exp(ref-new) + new - ref - 1) = beta*(1 - exp(ref-new))/3
    assert new.grad.tolist() == pytest.approx([0.5 * (1 - 2.0) / 3, 0.0, 0.5 * (1 - 0.5) / 3], abs=1e-7)


def test_mismatched_shapes_are_refused():
    with pytest.raises(ValueError, match="same completion tokens"):
        grpo_sample_loss(torch.zeros(3), torch.zeros(2), torch.zeros(3), 1.0, EPS, 0.0)


def test_advantages_zero_variance_group_gives_zero_but_keeps_its_samples():
    groups = ["a", "a", "a", "b", "b"]
    adv = group_normalized_advantages(groups, [1.0, 0.0, 0.5, 1.0, 1.0], eps=1e-4)
    std = math.sqrt(((0.5) ** 2 + 0.5**2 + 0) / 3)
    assert adv[:3] == pytest.approx([0.5 / (std + 1e-4), -0.5 / (std + 1e-4), 0.0])
    assert adv[3:] == [0.0, 0.0]


def test_build_samples_groups_by_step_and_prompt_and_keeps_no_signal_groups():
    from dagster_rl.tasks.lm.records import LMRollout
    from dagster_rl.tasks.lm.rewards import LMReward

    def rollout(p, s):
        return LMRollout(
            trial_id=f"s0-p{p}-n{s}",
            step=0,
            prompt=p,
            sample=s,
            prompt_id=f"x{p}",
            reference="1",
            seed=0,
            prompt_token_ids=[1],
            completion_token_ids=[2],
            completion_text="",
            sampling_logprobs=[-1.0],
            finish_reason="length",
            temperature=1.0,
            top_p=1.0,
            behavior_version=0,
        )

    def reward(p, s, r):
        return LMReward(
            trial_id=f"s0-p{p}-n{s}", step=0, prompt=p, answer=None, reference="1", correct=False, components={}, reward=r
        )

    rollouts = [rollout(p, s) for p in range(2) for s in range(2)]
    rewards = [reward(0, 0, 1.0), reward(0, 1, 0.0), reward(1, 0, 0.5), reward(1, 1, 0.5)]
    samples, facts = build_samples(list(reversed(rollouts)), rewards, advantage_eps=1e-4)
    assert [s.trial_id for s in samples] == ["s0-p0-n0", "s0-p0-n1", "s0-p1-n0", "s0-p1-n1"]
    assert [s.advantage for s in samples] == pytest.approx([0.5 / 0.5001, -0.5 / 0.5001, 0.0, 0.0], rel=1e-12)  # std 0.5
    assert facts == {"groups": 2.0, "groups_with_signal": 1.0, "mean_reward": 0.5}
