"""One GRPO update of the adapter over a batch of samples, in one process or data-parallel.

Each rank holds a shard of the samples (maybe none) and packs it into right-padded micro-batches of
at most `grpo.micro_batch_tokens` padded tokens (a longer sample is a micro-batch of its own). Per
micro-batch: the reference log-probs in one no-grad forward (all of them under one
`Policy.adapter_disabled()`), the policy's in one forward with grad, the GRPO loss of its samples scaled by
world_size / total_samples, one backward. DDP averages gradients over ranks, so the synchronized
gradient is (1/N) sum_i grad loss_i over all N samples: the single-process, per-sample gradient up
to float rounding, whatever the micro-batches. Micro-batch backwards run inside `no_sync()` (local
accumulation, no collective, each graph freed at once); then every rank, empty shard or not, runs
exactly ONE forward of one token through the DDP module, scaled by 0.0, and its backward: the one
all-reduce. The collective count is the same on every rank by construction.
"""

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.distributed as dist

from dagster_rl.base.errors import DagsterRLError
from dagster_rl.base.hashing import seed_of
from dagster_rl.core.advantages import group_normalized_advantages, groups_with_signal
from dagster_rl.core.records import Record
from dagster_rl.tasks.lm.model.logprobs import PackedBatch, pack, packed_logprobs
from dagster_rl.tasks.lm.model.policy import Policy
from dagster_rl.tasks.lm.settings import GRPOLMSettings
from dagster_rl.tasks.lm.train.corrections import Corrected, correct
from dagster_rl.tasks.lm.train.grpo_loss import grpo_batch_loss

OldLogp = Literal["sampler", "trainer"]  # the ratio's old policy (see `train_step`)


class Sampled(Protocol):
    """What the update reads of a rollout: a single-turn completion (`tasks.lm.records.LMRollout`) or a
    multi-turn trajectory (`tasks.agent.records.AgentTrajectory`, which adds its `completion_mask`)."""

    trial_id: str
    step: int
    prompt: int  # the GRPO group within the step
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    sampling_logprobs: list[float]  # one per sampled completion token
    temperature: float


class Rewarded(Protocol):
    trial_id: str
    reward: float


@dataclass(frozen=True)
class TrainSample:
    trial_id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    old_logp: list[float]  # one per sampled completion token (mask 1), in order
    temperature: float
    advantage: float
    mask: list[int] | None = None  # 1 on the completion tokens the model sampled; None: all of them

    @property
    def sampled(self) -> int:
        return len(self.completion_ids) if self.mask is None else sum(self.mask)


class TrainMetrics(Record):
    version: int  # of the adapter this step produced
    loss: float  # mean over samples
    ratio: float  # mean over samples of the token mean
    kl: float | None  # mean k3 KL to the reference; None (absent): not computed, at kl_beta 0 (`reference_needed`)
    clip_frac: float
    ratio_max_dev: (
        float  # max over the step's tokens of |ratio - 1|: 0 on-policy (old = the trainer's own), the lag's drift off it
    )
    logp_max_dev: float  # max over the step's tokens of |trainer's log-prob - sampler's| before the update (on_policy)
    logp_mean_dev: float  # mean over the step's tokens of (trainer's log-prob - sampler's): a bias, where there is one
    # the off-policy corrections' (`lm.train.corrections`), over the step's sampled tokens; None where off
    mismatch_capped_frac: float | None = None  # share whose sampler-trainer weight the cap truncated or masked
    mismatch_weight: float | None = None  # mean of that weight as applied
    decoupled_masked_frac: float | None = None  # share the decoupled objective masked (behavior-to-proximal weight > cap)
    decoupled_weight: float | None = None  # mean of its weight as applied
    grad_norm: float  # before clipping
    samples_used: int
    groups: int
    groups_with_signal: int
    mean_reward: float
    world_size: int
    pad_share: float  # padded tokens / all tokens of the step's micro-batches (`padding`)


def build_samples(
    rollouts: Sequence[Sampled], rewards: Sequence[Rewarded], advantage_eps: float
) -> tuple[list[TrainSample], dict[str, float]]:
    """Samples sorted by trial id, advantages normalized within each (step, prompt) group.

    Rollouts without a reward (skipped trials) are left out; a group whose rewards are all equal
    gets advantage 0 and still counts in the KL term. A rollout with a `completion_mask` (a
    multi-turn trajectory, `dagster_rl.tasks.agent.records`) is trained on its sampled tokens only.
    Returns the samples and batch facts.
    """
    by_trial = {r.trial_id: r for r in rewards}
    used = sorted((r for r in rollouts if r.trial_id in by_trial and r.completion_token_ids), key=lambda r: r.trial_id)
    if not used:
        raise DagsterRLError(
            f"no rollout has a reward ({len(rollouts)} rollouts, {len(rewards)} rewards): the trainer has nothing "
            "to learn from. Check that the rewards were computed for these rollouts."
        )
    groups = [(r.step, r.prompt) for r in used]
    values = [by_trial[r.trial_id].reward for r in used]
    adv = group_normalized_advantages(groups, values, advantage_eps)
    samples = [
        TrainSample(
            r.trial_id,
            r.prompt_token_ids,
            r.completion_token_ids,
            r.sampling_logprobs,
            r.temperature,
            a,
            getattr(r, "completion_mask", None),
        )
        for r, a in zip(used, adv, strict=True)
    ]
    facts = {
        "groups": float(len(set(groups))),
        "groups_with_signal": float(groups_with_signal(groups, adv)),
        "mean_reward": sum(values) / len(values),
    }
    return samples, facts


def shard(samples: Sequence[TrainSample], rank: int, world_size: int) -> list[TrainSample]:
    """Rank r takes samples r, r + W, r + 2W, ...: a shard is empty when there are fewer samples than ranks."""
    return list(samples[rank::world_size])


def micro_batches(samples: Sequence[TrainSample], budget: int) -> list[list[int]]:
    """Indices of `samples` grouped into micro-batches of at most `budget` padded tokens (rows x the
    longest sequence), a sequence longer than the budget a batch of its own. A pure function of the
    samples: the same plan packs the same.

    Bucketed by length: the sequences sorted by length (then index) are cut into runs, as few runs as
    fit the budget (the greedy count, which no cut beats: a run that fits still fits with a row less),
    and among the cuts into that many runs, the one with the fewest padded tokens (`plan_micro_batches`).
    """
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in samples]
    order = sorted(range(len(samples)), key=lambda i: (lengths[i], i))
    runs = plan_micro_batches([lengths[i] for i in order], budget)
    return [[order[k] for k in range(start, end)] for start, end in runs]


def plan_micro_batches(lengths: Sequence[int], budget: int) -> list[tuple[int, int]]:
    """Cuts of ascending `lengths` into runs [start, end): the fewest runs whose rows x longest fit
    `budget` (a run of one always fits), and among those the fewest padded tokens; ties go to the
    the shortest last run. Dynamic programming over the run that ends at each length: O(n x rows per run)."""
    if any(b < a for a, b in zip(lengths, lengths[1:], strict=False)):
        raise ValueError("plan_micro_batches takes lengths in ascending order")
    n = len(lengths)
    prefix = [0]
    for length in lengths:
        prefix.append(prefix[-1] + length)
    best: list[tuple[int, int]] = [(0, 0)] + [(n + 1, 0)] * n  # (runs, padded tokens) of the first j lengths
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        longest = lengths[end - 1]
        for start in range(end - 1, -1, -1):
            rows = end - start
            if rows > 1 and rows * longest > budget:
                break  # more rows under the same longest fit no better
            runs, padded = best[start]
            cost = (runs + 1, padded + rows * longest - (prefix[end] - prefix[start]))
            if cost < best[end]:
                best[end], cut[end] = cost, start
    out: list[tuple[int, int]] = []
    end = n
    while end:
        out.append((cut[end], end))
        end = cut[end]
    return out[::-1]


def _pack(samples: Sequence[TrainSample], pad_id: int, device: torch.device) -> tuple[PackedBatch, torch.Tensor, torch.Tensor]:
    """The micro-batch, its behavior log-probs (B, C) (0 where no token was sampled), and its advantages (B,)."""
    batch = pack(
        [s.prompt_ids for s in samples],
        [s.completion_ids for s in samples],
        [s.temperature for s in samples],
        pad_id,
        device,
        masks=[s.mask for s in samples],
    )
    old = torch.zeros(batch.completion_mask.shape, dtype=torch.float32)
    for row, s in enumerate(samples):
        if s.mask is None:
            old[row, : len(s.old_logp)] = torch.tensor(s.old_logp, dtype=torch.float32)
        else:
            old[row, : len(s.mask)] = torch.zeros(len(s.mask)).masked_scatter(
                torch.tensor(s.mask, dtype=torch.bool), torch.tensor(s.old_logp, dtype=torch.float32)
            )
    return batch, old.to(device), torch.tensor([s.advantage for s in samples], dtype=torch.float32, device=device)


def reference_needed(grpo: GRPOLMSettings) -> bool:
    """Whether the update computes the reference's log-probs: only where the loss weighs the KL term
    (`kl_beta` > 0). At 0 nothing the update returns depends on them but the `kl` it reports, which
    it then leaves out (None) rather than pay a forward of every micro-batch for it."""
    return grpo.kl_beta > 0


def reference_logprobs(
    policy: Policy, batches: Sequence[PackedBatch], grpo: GRPOLMSettings, reference: Callable[[], AbstractContextManager] | None
) -> list[torch.Tensor | None]:
    """The reference's (B, C) log-probs of each micro-batch, in one no-grad forward each, all under one
    switch of the model to the reference (a switch walks the whole model); Nones when not needed."""
    if not reference_needed(grpo):
        return [None] * len(batches)
    with torch.no_grad(), (reference or policy.adapter_disabled)():
        return [packed_logprobs(policy.model, batch) for batch in batches]


def padding(batches: Sequence[PackedBatch], distributed: bool, device: torch.device) -> float:
    """Padded tokens / all tokens of the micro-batches (of every rank, `distributed`): what padding
    adds to a forward's width, the share `micro_batches` keeps small."""
    counts = torch.tensor(
        [sum(b.tokens for b in batches), sum(int(b.attention_mask.sum()) for b in batches)], dtype=torch.float64, device=device
    )
    if distributed:
        dist.all_reduce(counts)
    total, real = counts.tolist()
    return (total - real) / total if total else 0.0


def train_step(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    samples: Sequence[TrainSample],
    total_samples: int,
    grpo: GRPOLMSettings,
    facts: dict[str, float],
    ddp: torch.nn.parallel.DistributedDataParallel | None = None,
    on_grads: Callable[[dict[str, torch.Tensor]], None] | None = None,
    reference: Callable[[], AbstractContextManager] | None = None,
    old_logp: OldLogp = "sampler",
    behavior: Callable[[], AbstractContextManager] | None = None,
) -> TrainMetrics:
    """Update the policy's adapter in place over this rank's `samples`; bump its version.

    `on_grads` sees the synchronized gradients before clipping (the debug dump). With `ddp`, every
    rank must call this once, with the same `total_samples`. `reference` switches the model to the
    KL term's reference policy (`lm.reference`); default: the base, adapter disabled. `old_logp`:
    the ratio's old policy: the log-probs the sampler recorded (`sampler`: the behavior policy of
    stale rollouts), or the trainer's own, detached (`trainer`: for rollouts the policy being trained
    sampled, so that the update does not depend on the sampler's float noise). Either way
    `logp_max_dev` compares the trainer's log-probs with the sampler's: those of the behavior
    weights where it has them. `behavior` switches the model to the behavior weights' adapter, for
    stale rollouts (`old_logp="sampler"`): the trainer recomputes their log-probs in one no-grad
    forward (what `grpo.mismatch` compares with the sampler's). `grpo.decoupled` and
    `grpo.mismatch` choose the ratio's old policy and weight each token (`lm.train.corrections`).
    """
    if old_logp not in ("sampler", "trainer"):
        raise ValueError(f"old_logp is 'sampler' or 'trainer', not {old_logp!r}")
    world_size = dist.get_world_size() if ddp is not None else 1
    if total_samples < 1:
        raise DagsterRLError("a train step needs at least one sample across all ranks")
    if any(len(s.old_logp) != s.sampled for s in samples):
        raise DagsterRLError("a sample's behavior log-probs do not cover its sampled tokens; the rollout record is corrupt")
    model = policy.model
    forward_model = ddp if ddp is not None else model
    scale = world_size / total_samples
    device = next(model.parameters()).device
    # loss, ratio, kl, clip_frac, samples, logp dev sum, tokens; mismatch capped, weight; decoupled masked, weight
    sums = torch.zeros(11, dtype=torch.float64, device=device)
    max_dev = torch.zeros(2, dtype=torch.float64, device=device)  # max |ratio - 1|, max |new - old|
    pad = policy.tokenizer.pad_token_id
    batches = [_pack([samples[i] for i in idx], pad, device) for idx in micro_batches(samples, grpo.micro_batch_tokens)]
    cuda = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed_of("train-step", policy.version))  # LoRA dropout, if any: same on every replay
        policy.mode(training=True)  # and left so: whoever samples next sets eval mode
        policy.activation_checkpointing(grpo.activation_checkpointing)
        optimizer.zero_grad(set_to_none=True)
        refs = reference_logprobs(policy, [batch for batch, _, _ in batches], grpo, reference)
        recomputed: list[torch.Tensor | None] = [None] * len(batches)
        if behavior is not None and old_logp == "sampler":  # stale rollouts: the behavior weights' log-probs, by the trainer
            with torch.no_grad(), behavior():
                recomputed = [packed_logprobs(model, batch) for batch, _, _ in batches]
        with ddp.no_sync() if ddp is not None else nullcontext():
            for (batch, sampler, adv), ref, behaved in zip(batches, refs, recomputed, strict=True):
                new = packed_logprobs(forward_model, batch)
                ref = new.detach() if ref is None else ref  # no KL term: the loss's KL is exactly 0, its gradient 0
                mask = batch.completion_mask
                scored = new.detach() if old_logp == "trainer" else behaved
                c = correct(new.detach(), sampler, scored, mask, grpo)
                loss, stats = grpo_batch_loss(
                    new, c.old, ref, mask, adv, grpo.clip_eps, grpo.kl_beta, sampler, weight=c.weight, scored_logp=scored
                )
                (loss.sum() * scale).backward()
                sums[:4] += torch.stack([x.sum() for x in (loss.detach(), stats.ratio, stats.kl, stats.clip_frac)]).double()
                sums[4] += len(adv)
                sums[5:7] += torch.stack([stats.logp_dev_sum.double(), mask.sum().double()])
                sums[7:] += correction_sums(c, mask)
                max_dev = torch.maximum(max_dev, torch.stack([stats.ratio_max_dev, stats.logp_max_dev]).double())
        if ddp is not None:
            sync = ddp(input_ids=torch.tensor([[pad]], device=device), use_cache=False)
            (sync.logits.float().sum() * 0.0).backward()  # the one synchronizing backward
            dist.all_reduce(sums)
            dist.all_reduce(max_dev, op=dist.ReduceOp.MAX)
    pad_share = padding([batch for batch, _, _ in batches], ddp is not None, device)
    sums, (max_dev, logp_dev) = sums.cpu(), max_dev.tolist()
    named = policy.trainable()
    grads: dict[str, torch.Tensor] = {}
    for name, p in named:
        if p.grad is None:  # single process, no sample touched it
            p.grad = torch.zeros_like(p)
        grads[name] = p.grad
    if on_grads is not None:
        on_grads({name: g.detach().clone() for name, g in grads.items()})
    grad_norm = torch.nn.utils.clip_grad_norm_([p for _, p in named], grpo.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    policy.version += 1
    n = float(sums[4])
    if int(n) != total_samples:
        raise DagsterRLError(
            f"ranks trained {int(n)} samples, not the {total_samples} the step was given; shards overlap or are lost"
        )
    return TrainMetrics(
        version=policy.version,
        loss=float(sums[0]) / n,
        ratio=float(sums[1]) / n,
        kl=float(sums[2]) / n if reference_needed(grpo) else None,
        clip_frac=float(sums[3]) / n,
        ratio_max_dev=max_dev,
        logp_max_dev=logp_dev,
        logp_mean_dev=float(sums[5]) / max(float(sums[6]), 1.0),
        **correction_metrics(grpo, sums[7:], max(float(sums[6]), 1.0)),
        grad_norm=float(grad_norm),
        samples_used=int(n),
        groups=int(facts["groups"]),
        groups_with_signal=int(facts["groups_with_signal"]),
        mean_reward=facts["mean_reward"],
        world_size=world_size,
        pad_share=pad_share,
    )


def correction_sums(c: Corrected, mask: torch.Tensor) -> torch.Tensor:
    """(mismatch capped, mismatch weight, decoupled masked, decoupled weight) summed over the sampled tokens (0: off)."""
    parts = (c.mismatch_capped, c.mismatch_weight, c.decoupled_masked, c.decoupled_weight)
    zero = torch.zeros((), dtype=torch.float64, device=mask.device)
    return torch.stack([zero if x is None else torch.where(mask, x.double(), 0.0).sum() for x in parts])


def correction_metrics(grpo: GRPOLMSettings, sums: torch.Tensor, tokens: float) -> dict[str, float]:
    """The corrections' shares and mean weights over the step's `tokens` sampled tokens, for those that are on."""
    found: dict[str, float] = {}
    if grpo.mismatch is not None:
        found |= {"mismatch_capped_frac": float(sums[0]) / tokens, "mismatch_weight": float(sums[1]) / tokens}
    if grpo.decoupled is not None:
        found |= {"decoupled_masked_frac": float(sums[2]) / tokens, "decoupled_weight": float(sums[3]) / tokens}
    return found
