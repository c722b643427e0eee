"""The off-policy corrections (`dagster_rl.tasks.lm.train.corrections`) against values computed by
hand: the sampler-trainer mismatch weight (token or sequence, truncated or masked), the decoupled
objective's behavior-to-proximal weight, how they choose the ratio's old policy and combine, and
the loss they weight. About 1 s: tensors of a few numbers, no model."""

import math

import pytest
import torch

from dagster_rl.tasks.lm.settings import DecoupledObjective, GRPOLMSettings, MismatchCorrection
from dagster_rl.tasks.lm.train.corrections import correct, decoupled_weights, mismatch_weights
from dagster_rl.tasks.lm.train.grpo_loss import grpo_batch_loss

LN = math.log


def _row(*values: float) -> torch.Tensor:
    return torch.tensor([list(values)], dtype=torch.float32)


MASK3 = torch.ones((1, 3), dtype=torch.bool)
# behavior - sampler = ln 3, ln 0.5, ln 1.5: weights 3, 0.5, 1.5 before the cap
BEHAVIOR, SAMPLER = _row(LN(3.0), LN(0.5), LN(1.5)), _row(0.0, 0.0, 0.0)


def test_token_truncation_caps_each_weight_at_the_cap():
    weights, capped = mismatch_weights(BEHAVIOR, SAMPLER, MASK3, MismatchCorrection(level="token", action="truncate", cap=2.0))
    assert weights.tolist()[0] == pytest.approx([2.0, 0.5, 1.5], abs=1e-6)
    assert capped.tolist() == [[True, False, False]]


def test_token_masking_zeroes_a_weight_above_the_cap_and_keeps_the_others():
    weights, capped = mismatch_weights(BEHAVIOR, SAMPLER, MASK3, MismatchCorrection(level="token", action="mask", cap=2.0))
    assert weights.tolist()[0] == pytest.approx([0.0, 0.5, 1.5], abs=1e-6)
    assert capped.tolist() == [[True, False, False]]


def test_sequence_level_weighs_every_token_of_a_completion_by_the_product_over_its_tokens():
    # row 0: 1.5 x 1.5 = 2.25 > cap 2; row 1: 1.2 x 0.5 = 0.6, its third position is padding
    behavior = torch.tensor([[LN(1.5), LN(1.5), 0.0], [LN(1.2), LN(0.5), 7.0]])
    sampler = torch.zeros((2, 3))
    mask = torch.tensor([[True, True, False], [True, True, False]])
    truncated, capped = mismatch_weights(
        behavior, sampler, mask, MismatchCorrection(level="sequence", action="truncate", cap=2.0)
    )
    assert truncated.tolist()[0] == pytest.approx([2.0, 2.0, 0.0], abs=1e-6)
    assert truncated.tolist()[1] == pytest.approx([0.6, 0.6, 0.0], abs=1e-6)
    assert capped.tolist() == [[True, True, False], [False, False, False]]
    masked, _ = mismatch_weights(behavior, sampler, mask, MismatchCorrection(level="sequence", action="mask", cap=2.0))
    assert masked.tolist()[0] == [0.0, 0.0, 0.0] and masked.tolist()[1] == pytest.approx([0.6, 0.6, 0.0], abs=1e-6)


def test_a_huge_sequence_ratio_is_capped_or_masked_never_inf_or_nan():
    behavior, sampler = torch.full((1, 3), 100.0), torch.zeros((1, 3))  # exp(300) overflows float32
    for action, expected in (("truncate", 5.0), ("mask", 0.0)):
        weights, _ = mismatch_weights(behavior, sampler, MASK3, MismatchCorrection(level="sequence", action=action, cap=5.0))
        assert weights.tolist() == [[expected] * 3], action


def test_decoupled_weight_is_proximal_over_behavior_masked_above_its_cap():
    # proximal - behavior = ln 6, ln 2, ln 0.25; cap 5: the first is masked
    weights, masked = decoupled_weights(_row(LN(6.0), LN(2.0), LN(0.25)), _row(0.0, 0.0, 0.0), MASK3, DecoupledObjective(cap=5.0))
    assert weights.tolist()[0] == pytest.approx([0.0, 2.0, 0.25], abs=1e-6)
    assert masked.tolist() == [[True, False, False]]


def test_without_corrections_the_old_policy_is_the_behaviors_where_known_else_the_samplers():
    proximal, sampler, behavior = _row(-1.0, -2.0, -3.0), _row(-1.1, -2.1, -3.1), _row(-1.2, -2.2, -3.2)
    plain = GRPOLMSettings()
    assert correct(proximal, sampler, behavior, MASK3, plain).old is behavior
    none = correct(proximal, sampler, None, MASK3, plain)
    assert none.old is sampler and none.weight is None and none.mismatch_capped is None
    with pytest.raises(ValueError, match="log-probs of the behavior weights"):
        correct(proximal, sampler, None, MASK3, GRPOLMSettings(mismatch=MismatchCorrection()))


def test_corrections_together_clip_around_the_proximal_and_multiply_their_weights():
    # mismatch b - s = ln 3, ln 0.5, 0 (token truncate, cap 2: 2, 0.5, 1); decoupled p - b = ln 2, ln 6, ln 0.5
    # (cap 5: 2, 0, 0.5): weights 4, 0, 0.5
    sampler = _row(0.0, 0.0, 0.0)
    behavior = _row(LN(3.0), LN(0.5), 0.0)
    proximal = behavior + _row(LN(2.0), LN(6.0), LN(0.5))
    grpo = GRPOLMSettings(mismatch=MismatchCorrection(cap=2.0), decoupled=DecoupledObjective(cap=5.0))
    c = correct(proximal, sampler, behavior, MASK3, grpo)
    assert c.old is proximal
    assert c.weight is not None and c.weight.tolist()[0] == pytest.approx([4.0, 0.0, 0.5], abs=1e-5)
    assert c.mismatch_capped is not None and c.mismatch_capped.tolist() == [[True, False, False]]
    assert c.decoupled_masked is not None and c.decoupled_masked.tolist() == [[False, True, False]]
    # decoupled alone, behavior unknown (a lag without mismatch): the sampler's stand in, p - s = ln 6, ln 3, ln 0.5
    alone = correct(proximal, sampler, None, MASK3, GRPOLMSettings(decoupled=DecoupledObjective(cap=5.0)))
    assert alone.old is proximal and alone.weight is not None
    assert alone.weight.tolist()[0] == pytest.approx([0.0, 3.0, 0.5], abs=1e-5)


def test_the_weight_multiplies_each_tokens_clipped_policy_term_not_the_kl():
    old = _row(-1.0, -2.0, -0.5)
    new = (old + torch.log(torch.tensor([[1.5, 0.5, 1.0]]))).clone().requires_grad_(True)
    ref = torch.zeros((1, 3))
    weight = _row(2.0, 0.5, 0.0)
    adv = torch.tensor([2.0])
    loss, _ = grpo_batch_loss(new, old, ref, MASK3, adv, clip_eps=0.2, kl_beta=0.1, weight=weight)
    unweighted, _ = grpo_batch_loss(new.detach(), old, ref, MASK3, adv, clip_eps=0.2, kl_beta=0.1)
    # A=+2: min(rA, clip(r)A) = 2.4 | 1.0 | 2.0, weighted 4.8 | 0.5 | 0 -> mean 5.3/3; the KL term is the same in both
    kl = unweighted.item() + 1.8  # unweighted: -(1.8 - 0.1 KL)
    assert loss.item() == pytest.approx(-5.3 / 3 + kl, abs=1e-5)
    loss.backward()
    # policy gradient -(1/3) w_t A r_t where the unclipped term is chosen (token 2), 0 where clipped (1) or weighted 0 (3);
    # plus the KL's beta (1 - exp(ref - new)) / 3
    kl_grad = [0.1 * (1 - math.exp(0.0 - v)) / 3 for v in new.detach().tolist()[0]]
    assert new.grad.tolist()[0] == pytest.approx([kl_grad[0], -(0.5 * 2.0 * 0.5) / 3 + kl_grad[1], kl_grad[2]], abs=1e-6)


def test_the_decoupled_update_is_the_weighted_policy_gradient_with_one_step_per_batch():
    """Old = the proximal = the trainer's own log-probs, detached: r = 1 in value, so the clip never
    binds and d loss / d new_t = -(1/T) w_t A."""
    new = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    sampler = new.detach() - torch.log(torch.tensor([[2.0, 0.5, 8.0]]))  # proximal / behavior = 2, 0.5, 8 (masked at 5)
    c = correct(new.detach(), sampler, None, MASK3, GRPOLMSettings(decoupled=DecoupledObjective(cap=5.0)))
    loss, stats = grpo_batch_loss(new, c.old, new.detach(), MASK3, torch.tensor([-1.5]), 0.2, 0.0, sampler, weight=c.weight)
    loss.backward()
    assert new.grad.tolist()[0] == pytest.approx([1.5 * 2.0 / 3, 1.5 * 0.5 / 3, 0.0], abs=1e-6)
    assert float(stats.clip_frac[0]) == 0.0 and float(stats.ratio_max_dev) == 0.0
