"""The supervised warm-up: a few SFT steps of the LoRA adapter on demonstrations of the task.

Real GRPO post-training starts from a model that can already do the task a little. Here the base is
a random tiny model, so an experiment with a `warmup` section first fits the adapter to
`demos` worked answers drawn from the training split (never the held-out prompts): `steps` AdamW
steps of `batch_size` demonstrations each, token-level cross-entropy on the answer and its eos
token only (the prompt is context). Step 0 of the GRPO chain starts from that adapter; the GRPO
optimizer starts fresh (the warm-up's moments are not carried over), and the adapter's version stays
0: versions count GRPO updates.

With `target_accuracy`, the warm-up stops early: every `check_every` steps it measures greedy accuracy
on `check_prompts` training prompts that are not demonstrations (never a held-out prompt), and stops
at the first check that reaches the target. How fast SFT on a few demonstrations generalizes depends
on the last bits of every step (the CPU's kernels round differently, and 100 steps amplify that), so a
fixed step count can leave one machine at half the task and another at nearly all of it; stopping at a
target leaves GRPO the same room to learn on every machine.

Deterministic: the demonstrations and their order are drawn from (experiment seed, "warmup"), the
adapter's init from its LoRA seed, so the warm-up computes the same bytes in every run on a machine.
"""

import random
from collections.abc import Callable, Sequence

import torch

from dagster_rl.base.errors import DagsterRLError
from dagster_rl.base.hashing import seed_of
from dagster_rl.core.records import Record
from dagster_rl.tasks.lm.data.prompts import PromptItem, encode_prompt
from dagster_rl.tasks.lm.model.policy import Policy, checkpoint_bytes
from dagster_rl.tasks.lm.settings import WarmupSettings

WARMUP = "warmup.json"  # the file of a warm-up checkpoint that says how it was made


class WarmupError(DagsterRLError):
    """The warm-up's settings do not fit the experiment's prompts."""

    retryable = False


class WarmupStats(Record):
    """Stored beside the warm-up's adapter: what it trained on and how the loss went."""

    demos: list[str]  # prompt ids, in the order drawn
    losses: list[float]  # per step: mean cross-entropy per answer token
    tokens: int  # answer tokens per epoch over the demonstrations
    checks: list[tuple[int, float]] = []  # (steps done, greedy accuracy on the check prompts), with target_accuracy


def draw_demos(train: Sequence[PromptItem], seed: int, n: int) -> list[PromptItem]:
    """`n` distinct training items with a worked answer, drawn from the experiment seed."""
    usable = [it for it in train if it.solution]
    if len(usable) < n:
        raise WarmupError(
            f"the warm-up asks for {n} demonstrations but the training split has {len(usable)} items with a worked "
            "answer; lower warmup.demos"
        )
    return random.Random(seed_of(seed, "warmup", "demos")).sample(usable, n)


def draw_check_prompts(train: Sequence[PromptItem], demos: Sequence[PromptItem], seed: int, n: int) -> list[PromptItem]:
    """`n` distinct training items that are not demonstrations: what `target_accuracy` is checked on."""
    taken = {it.id for it in demos}
    rest = [it for it in train if it.id not in taken]
    if len(rest) < n:
        raise WarmupError(
            f"the warm-up checks its accuracy on {n} training prompts that are not demonstrations, but the training "
            f"split has {len(rest)} left after the {len(demos)} demonstrations; lower warmup.check_prompts or warmup.demos"
        )
    return random.Random(seed_of(seed, "warmup", "check")).sample(rest, n)


Check = Callable[[Policy, Sequence[PromptItem]], float]  # greedy accuracy of the policy on these prompts


def demo_tokens(policy: Policy, item: PromptItem, template: str) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids ending with eos): the prompt exactly as a rollout sees it."""
    tok = policy.tokenizer
    answer = list(tok(item.solution, add_special_tokens=False)["input_ids"]) + [tok.eos_token_id]
    return encode_prompt(tok, item, template), answer


Example = tuple[list[int], list[int]]  # (token ids, 1 where the loss is and 0 where they are context)


def masked_loss(model: torch.nn.Module, batch: list[Example], pad_id: int) -> tuple[torch.Tensor, int]:
    """Summed cross-entropy of the masked-in ids of a right-padded batch, and their count."""
    width = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), width), pad_id)
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    target = torch.zeros((len(batch), width), dtype=torch.bool)
    for i, (seq, mask) in enumerate(batch):
        ids[i, : len(seq)] = torch.tensor(seq)
        attention[i, : len(seq)] = 1
        target[i, : len(seq)] = torch.tensor(mask, dtype=torch.bool)
    device = next(model.parameters()).device
    logits = model(input_ids=ids.to(device), attention_mask=attention.to(device), use_cache=False).logits[:, :-1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None].to(device))[..., 0]
    chosen = target[:, 1:].to(device)
    return -(logp * chosen).sum(), int(chosen.sum())


def answer_example(prompt: list[int], answer: list[int]) -> Example:
    """A demonstration's ids with the loss on its answer tokens."""
    return prompt + answer, [0] * len(prompt) + [1] * len(answer)


def fit(
    policy: Policy,
    examples: Sequence[Example],
    steps: int,
    batch_size: int,
    learning_rate: float,
    weight_decay: float,
    max_grad_norm: float,
    seed: int,
    after_step: Callable[[int], bool] | None = None,
) -> list[float]:
    """Supervised fine-tuning of the adapter: `steps` AdamW steps (clipped to `max_grad_norm`) on
    batches of `batch_size` examples, epochs of a fresh seeded permutation each, the cross-entropy
    on their masked-in ids. `after_step(step)` (1-based) returning True stops it. Returns the losses."""
    params = [p for _, p in policy.trainable()]
    optimizer = torch.optim.AdamW(params, lr=learning_rate, weight_decay=weight_decay, foreach=False)
    order = random.Random(seed_of(seed, "warmup", "order"))
    queue: list[int] = []
    losses = []
    model = policy.mode(training=True)
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        torch.manual_seed(seed_of(seed, "warmup", "dropout"))
        for step in range(1, steps + 1):
            while len(queue) < batch_size:  # epochs of a fresh permutation each
                queue += order.sample(range(len(examples)), len(examples))
            picked, queue = queue[:batch_size], queue[batch_size:]
            optimizer.zero_grad(set_to_none=True)
            total, count = masked_loss(model, [examples[i] for i in picked], policy.tokenizer.pad_token_id)
            (total / count).backward()
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            optimizer.step()
            losses.append(float(total.detach()) / count)
            if after_step is not None and after_step(step):
                break
    policy.mode(training=False)
    return losses


def warm_up(
    policy: Policy, items: Sequence[PromptItem], template: str, settings: WarmupSettings, seed: int, check: Check | None = None
) -> tuple[dict[str, bytes], WarmupStats]:
    """Fit the policy's adapter to the demonstrations; return its checkpoint files and the stats.
    With `settings.target_accuracy`, `check` measures the accuracy that stops it."""
    demos = draw_demos(items, seed, settings.demos)
    stop: tuple[Check, float] | None = None  # the check and the accuracy that stops the fit
    held: list[PromptItem] = []
    if settings.target_accuracy is not None:
        if check is None:
            raise ValueError("warmup.target_accuracy needs a check: the accuracy of the policy on prompts")
        stop = (check, settings.target_accuracy)
        held = draw_check_prompts(items, demos, seed, settings.check_prompts)
    checks: list[tuple[int, float]] = []
    examples = [demo_tokens(policy, it, template) for it in demos]

    def after_step(step: int) -> bool:
        if stop is None or not held or step % settings.check_every:
            return False
        measure, target = stop
        checks.append((step, measure(policy, held)))
        policy.mode(training=True)
        return checks[-1][1] >= target

    losses = fit(
        policy,
        [answer_example(p, a) for p, a in examples],
        settings.steps,
        settings.batch_size,
        settings.learning_rate,
        settings.weight_decay,
        settings.max_grad_norm,
        seed,
        after_step,
    )
    files = checkpoint_bytes(policy, None)  # version 0, no optimizer moments: GRPO starts its own
    stats = WarmupStats(
        demos=[it.id for it in demos],
        losses=losses,
        tokens=sum(len(a) for _, a in examples),
        checks=checks,
    )
    return files, stats
