"""Shared helpers of the agent tests: a policy of the built-in agent model, episode requests, and
`chatter`, a text environment that answers every action and never ends an episode itself, and
`brittle`, a `chatter` that raises on its second turn (in world t0.0 always, in t0.1 once)."""

from pathlib import Path
from typing import Literal

import torch

from dagster_rl.base.hashing import seed_of
from dagster_rl.tasks.agent.chat import ChatTurns
from dagster_rl.tasks.agent.environment import EnvironmentSettings, EnvironmentSpec, Outcome, environment_of, register_environment
from dagster_rl.tasks.agent.episode import Stage
from dagster_rl.tasks.agent.records import EpisodeRequest
from dagster_rl.tasks.lm.model.policy import Policy, load_policy
from dagster_rl.tasks.lm.settings import LoRASettings, PolicySettings

AGENT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head", "embed_tokens")


class ChatterSettings(EnvironmentSettings):
    name: Literal["chatter"] = "chatter"


class Chatter:
    """Answers every action with a line of its own: only the turn budget ends an episode."""

    def __init__(self, settings, world, seed, sandbox):
        self.turns = 0

    def reset(self) -> str:
        return "say something"

    def step(self, action: str) -> Outcome:
        self.turns += 1
        return Outcome(f"heard {len(action)} letters, turn {self.turns}", tool="say", argument=action)

    def verdict(self):
        return {"success": False}

    def close(self) -> None:
        pass


CHATTER = register_environment(EnvironmentSpec(name="chatter", settings=ChatterSettings, make=Chatter, code_version="chatter-1"))


class BrittleSettings(ChatterSettings):
    name: Literal["brittle"] = "brittle"  # type: ignore[assignment]
    marks: str = ""  # a folder where it marks the worlds it broke in (each trial's environment is a process of its own)


class Brittle(Chatter):
    """`chatter` that raises on its second turn: in world t0.0 always, in world t0.1 the first time."""

    def __init__(self, settings, world, seed, sandbox):
        super().__init__(settings, world, seed, sandbox)
        self.world, self.marks = world.id, Path(settings.marks)

    def step(self, action: str) -> Outcome:
        mark = self.marks / self.world
        if self.turns == 1 and (self.world == "t0.0" or (self.world == "t0.1" and not mark.exists())):
            mark.touch()
            raise OSError(f"brittle broke in world {self.world}")
        return super().step(action)


BRITTLE = register_environment(EnvironmentSpec(name="brittle", settings=BrittleSettings, make=Brittle, code_version="brittle-1"))


def stage_of(
    settings: EnvironmentSettings, chat: ChatTurns, root: Path, max_turns: int = 3, timeout_s: float = 60, **more
) -> Stage:
    """The stage of episodes of `settings`' registered environment, trials' folders under `root`."""
    return Stage(environment_of(settings.name), settings, chat, max_turns, timeout_s, root, **more)


def request(i: int, seed: int = 0) -> EpisodeRequest:
    """Trial s0-p{i}-n0 on world t0.{i}."""
    world = f"t0.{i}"
    return EpisodeRequest(
        trial_id=f"s0-p{i}-n0",
        step=0,
        prompt=i,
        sample=0,
        world_id=world,
        world_seed=seed_of(seed, "world", world),
        seed=seed_of(seed, 0, i, 0),
    )


def agent_settings(targets: tuple[str, ...] = AGENT_TARGETS, base_model: str = "builtin:tiny-qwen2-agent") -> PolicySettings:
    return PolicySettings(base_model=base_model, lora=LoRASettings(rank=4, alpha=8, target_modules=targets, init_seed=3))


def busy_policy(targets: tuple[str, ...] = AGENT_TARGETS, settings: PolicySettings | None = None) -> Policy:
    """The built-in agent model (or `settings`' policy) with an adapter whose B is drawn, not 0: a
    policy that is not the base."""
    policy = load_policy(settings or agent_settings(targets))
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        for name, p in policy.trainable():
            if "lora_B" in name or "lora_embedding_B" in name:
                p.normal_(0.0, 0.05)
    return policy
