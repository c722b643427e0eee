"""The agent's supervised warm-up: SFT of the LoRA adapter on the environment's demonstrations.

A demonstration is an episode the environment's `demonstrate` plays (not necessarily a good one:
for `secret_search`, documents opened in random order until the digest shows, then the answer) that
is valid: it succeeds within the turn budget (one that does not is drawn again). It is recorded as a
rollout records it: the first prompt, then each action's ids (its text tokenized, then the eos that
ends the turn) with mask 1, then the environment's answer in the chat template's turn markers with
mask 0. The loss is the cross-entropy of the masked-in ids only: the model learns to act, never to
predict the environment. (Keeping the valid ones favours the shorter searches a little: with 6
documents and 4 turns, a random searcher's valid episodes open the clue's document first a third of
the time, each other document 2 times in 15.)

`steps` AdamW steps of `batch_size` demonstrations each (fresh permutations of the demonstrations),
on worlds of their own (`d<i>`: never a training step's `t<step>.<p>` nor a held-out `e<i>`). The
demonstrations, their order and the adapter's init are drawn from seeds, so the warm-up computes the
same bytes in every run on a machine. The adapter's version stays 0: versions count GRPO updates.
"""

import random
from pathlib import Path

from dagster_rl.base.errors import DagsterRLError
from dagster_rl.base.hashing import seed_of
from dagster_rl.core.records import Record
from dagster_rl.sandbox.placement import Sandboxes
from dagster_rl.tasks.agent.chat import ChatTurns
from dagster_rl.tasks.agent.environment import World
from dagster_rl.tasks.agent.episode import Episode, Stage, stage
from dagster_rl.tasks.agent.experiment import AgentExperiment, AgentWarmupSettings
from dagster_rl.tasks.agent.records import EpisodeRequest
from dagster_rl.tasks.lm.model.policy import Policy, checkpoint_bytes
from dagster_rl.tasks.lm.train.warmup import Example, fit


class AgentWarmupStats(Record):
    demos: int
    demo_turns: float  # mean turns of a demonstration
    losses: list[float]  # per step: mean cross-entropy per action token
    tokens: int  # action tokens over the demonstrations


MAX_DRAWS = 1000  # draws of one demonstration before the environment's are judged unable to succeed


def demo_world(seed: int, index: int) -> World:
    world_id = f"d{index}"
    return World(world_id, seed_of(seed, "world", world_id))


def demonstration(episodes: Stage, seed: int, index: int) -> Example:
    """Demonstration `index`: the environment's actions, played and recorded as a rollout would be;
    drawn again until the episode succeeds within the stage's turn budget."""
    spec, environment, chat, max_turns = episodes.spec, episodes.settings, episodes.chat, episodes.max_turns
    if spec.demonstrate is None:
        raise DagsterRLError(
            f"environment {spec.name} has no demonstrations (EnvironmentSpec.demonstrate): remove the warmup section"
        )
    world = demo_world(seed, index)
    rng = random.Random(seed_of(seed, "warmup", "demo", index))
    request = EpisodeRequest(
        trial_id=f"demo-{index}", step=-1, prompt=index, sample=0, world_id=world.id, world_seed=world.seed, seed=0
    )
    for _ in range(MAX_DRAWS):
        episode = Episode(request, episodes)
        try:
            for action in spec.demonstrate(environment, world, rng):
                if not episode.live:
                    break
                ids = [*chat.tokenizer(action, add_special_tokens=False)["input_ids"], chat.eos_id]
                episode.advance(ids, [0.0] * len(ids), "stop")
            if not episode.live and episode.trajectory(1.0, 1.0, 0).success:
                return episode.ids, [0] * len(episode.prompt_ids) + episode.mask
        finally:
            episode.close()
    raise DagsterRLError(
        f"environment {spec.name}'s demonstrations of world {world.id} did not succeed within max_turns={max_turns} in "
        f"{MAX_DRAWS} draws: raise warmup.max_turns, or fix its `demonstrate`"
    )


def warm_up(
    policy: Policy, exp: AgentExperiment, settings: AgentWarmupSettings, sandbox_root: Path, sandboxes: Sandboxes | None
) -> tuple[dict[str, bytes], AgentWarmupStats]:
    """Fit the policy's adapter to the environment's demonstrations (valid within the warm-up's turn
    budget, played in this process: they are the environment's own actions); return its checkpoint
    files and the stats."""
    episodes = stage(exp, ChatTurns.of(policy.tokenizer), sandbox_root, sandboxes, isolated=False, max_turns=exp.demo_turns)
    seed = exp.seed
    demos = [demonstration(episodes, seed, i) for i in range(settings.demos)]
    losses = fit(policy, demos, settings.steps, settings.batch_size, settings.learning_rate, 0.0, settings.max_grad_norm, seed)
    turns = [sum(1 for a, b in zip(m, m[1:], strict=False) if a == 1 and b == 0) + (m[-1] == 1) for _, m in demos]
    stats = AgentWarmupStats(
        demos=len(demos), demo_turns=sum(turns) / len(turns), losses=losses, tokens=sum(sum(m) for _, m in demos)
    )
    return checkpoint_bytes(policy, None), stats
