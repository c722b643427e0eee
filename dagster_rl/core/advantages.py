"""GRPO group-normalized advantages, in plain Python floats (bit-for-bit reproducible)."""

import math
from collections.abc import Hashable, Sequence


def group_normalized_advantages(groups: Sequence[Hashable], rewards: Sequence[float], eps: float = 1e-4) -> list[float]:
    """Within each group: (r - mean) / (std + eps), std the population std.

    A group whose rewards are all equal has no signal: its advantages are exactly 0.
    """
    if len(groups) != len(rewards):
        raise ValueError(f"{len(groups)} group ids for {len(rewards)} rewards")
    members: dict[Hashable, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    advantages = [0.0] * len(rewards)
    for idxs in members.values():
        values = [rewards[i] for i in idxs]
        if all(v == values[0] for v in values):
            continue
        mean = math.fsum(values) / len(values)
        std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))
        for i in idxs:
            advantages[i] = (rewards[i] - mean) / (std + eps)
    return advantages


def groups_with_signal(groups: Sequence[Hashable], advantages: Sequence[float]) -> int:
    return len({g for g, a in zip(groups, advantages, strict=True) if a != 0.0})
