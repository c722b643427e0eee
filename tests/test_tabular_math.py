"""The RL math of the tabular policy, against numbers computed by hand and finite differences."""

import math
import random

import pytest

from dagster_rl.core.advantages import group_normalized_advantages
from dagster_rl.tasks.secret_search.experiment import GRPOSettings
from dagster_rl.tasks.secret_search.prior import apply_logit_step, order_log_prob_grad, sample_order
from dagster_rl.tasks.secret_search.records import Reward, TabularWeights
from dagster_rl.tasks.secret_search.update import update


def test_group_normalized_advantages_by_hand():
    # group a: rewards 1, 3 -> mean 2, pstd 1 -> -1/(1+eps), +1/(1+eps); group b all equal -> 0
    adv = group_normalized_advantages(["a", "a", "b", "b", "b"], [1.0, 3.0, 2.0, 2.0, 2.0], eps=1e-4)
    assert adv[0] == pytest.approx(-1 / 1.0001, abs=1e-12)
    assert adv[1] == pytest.approx(1 / 1.0001, abs=1e-12)
    assert adv[2:] == [0.0, 0.0, 0.0]
    # three samples 0, 0, 3: mean 1, pstd sqrt(2)
    adv = group_normalized_advantages([0, 0, 0], [0.0, 0.0, 3.0], eps=1e-4)
    assert adv == pytest.approx([-1 / (math.sqrt(2) + 1e-4)] * 2 + [2 / (math.sqrt(2) + 1e-4)], abs=1e-12)


def _log_prob(prior, order):
    unread, lp = list(range(len(prior))), 0.0
    for d in order:
        lp += math.log(prior[d] / sum(prior[j] for j in unread))
        unread.remove(d)
    return lp


def test_plackett_luce_gradient_matches_finite_differences():
    prior = [0.1, 0.2, 0.3, 0.4]
    order = [2, 0, 3]
    grad = order_log_prob_grad(prior, order)
    h = 1e-6
    for i in range(4):
        bumped = [p * (math.exp(h) if j == i else 1.0) for j, p in enumerate(prior)]
        numeric = (_log_prob(bumped, order) - _log_prob(prior, order)) / h
        assert grad[i] == pytest.approx(numeric, abs=1e-5)


def test_sampling_follows_the_prior_and_never_repeats():
    rng = random.Random(0)
    firsts = [sample_order([0.7, 0.1, 0.1, 0.1], 3, rng) for _ in range(4000)]
    assert all(len(set(o)) == 3 for o in firsts)
    assert sum(o[0] == 0 for o in firsts) / 4000 == pytest.approx(0.7, abs=0.03)


def test_logit_step_keeps_a_distribution_with_a_floor():
    p = apply_logit_step([0.25] * 4, [100.0, 0.0, 0.0, 0.0])
    assert math.fsum(p) == pytest.approx(1.0, abs=1e-12)
    assert min(p) > 0


def _reward(trial, prompt, docs, r):
    return Reward(
        trial_id=trial, prompt=prompt, world_id="w0", docs_read=docs, verified=r > 0, components={}, score=0.0, reward=r
    )


def test_update_moves_prior_toward_documents_of_positive_advantage_and_is_pure():
    weights = TabularWeights(version=3, doc_prior={"w0": [0.25] * 4})
    rewards = [_reward("a", 0, [1], 2.0), _reward("b", 0, [0, 2, 3], 0.0), _reward("c", 1, [3], 1.0), _reward("d", 1, [2], 1.0)]
    new, stats = update(weights, rewards, GRPOSettings(learning_rate=1.0))
    assert new.version == 4
    assert new.doc_prior["w0"][1] > 0.25 > new.doc_prior["w0"][0]
    assert stats["groups"] == 2 and stats["groups_with_signal"] == 1 and stats["samples_used"] == 2
    again, _ = update(weights, rewards, GRPOSettings(learning_rate=1.0))
    assert again.model_dump_json() == new.model_dump_json()


def test_update_refuses_rewards_in_completion_order():
    weights = TabularWeights(version=0, doc_prior={"w0": [0.5, 0.5]})
    with pytest.raises(ValueError, match="sorted by trial id"):
        update(weights, [_reward("b", 0, [0], 1.0), _reward("a", 0, [1], 0.0)], GRPOSettings())
