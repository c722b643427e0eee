"""The document prior as a Plackett-Luce policy: sampling a reading order, and its score function.

Logits are the log of the prior. An order d_1..d_m (sampled without replacement) has
log p = sum_i [theta(d_i) - log sum_{j not yet read} exp theta(j)], whose gradient
with respect to theta is, at each position, one-hot(d_i) minus the softmax over unread documents.
"""

import math
import random
from collections.abc import Sequence

PRIOR_FLOOR = 1e-6


def sample_order(prior: Sequence[float], k: int, rng: random.Random) -> list[int]:
    """Draw `k` distinct documents, each in proportion to its prior among those not yet drawn."""
    remaining = list(range(len(prior)))
    order = []
    for _ in range(min(k, len(prior))):
        total = math.fsum(prior[i] for i in remaining)
        u = rng.random() * total
        acc = 0.0
        pick = remaining[-1]
        for i in remaining:
            acc += prior[i]
            if u < acc:
                pick = i
                break
        order.append(pick)
        remaining.remove(pick)
    return order


def order_log_prob_grad(prior: Sequence[float], order: Sequence[int]) -> list[float]:
    """d log p(order) / d theta, with theta = log prior."""
    theta = [math.log(p) for p in prior]
    grad = [0.0] * len(prior)
    unread = set(range(len(prior)))
    for d in order:
        z = math.fsum(math.exp(theta[j]) for j in unread)
        for j in sorted(unread):
            grad[j] -= math.exp(theta[j]) / z
        grad[d] += 1.0
        unread.remove(d)
    return grad


def apply_logit_step(prior: Sequence[float], step: Sequence[float]) -> list[float]:
    """softmax(log prior + step), floored so no document becomes impossible."""
    logits = [math.log(p) + s for p, s in zip(prior, step, strict=True)]
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    z = math.fsum(exps)
    floored = [max(e / z, PRIOR_FLOOR) for e in exps]
    z = math.fsum(floored)
    return [p / z for p in floored]


def uniform(n: int) -> list[float]:
    return [1.0 / n] * n
