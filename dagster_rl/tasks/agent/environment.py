"""Text environments: what a language-model agent acts in, one per trial, turn by turn.

An environment is the task's: its state lives in the trial's sandbox (a directory made fresh for
the trial and removed when it ends) and dies with it. The rollout drives it like this:

    env = spec.make(settings, world, seed, sandbox)   # per trial: its world, its seed, its sandbox
    try:
        observation = env.reset()                     # the first observation: the task, the tools
        while True:
            outcome = env.step(action_text)           # the model's action, as text
            if outcome.done: break                    # else outcome.observation is the next turn's
        verdict = env.verdict()                       # what the judge needs (`success` at least)
    finally:
        env.close()                                   # however the trial ends

What ends an episode, and how it counts:

- the environment says `done` (an answer, a bad action, a rule of the world): a trajectory, judged
  with its `end_reason` and the environment's `verdict()`;
- the experiment's turn budget (`task.episode.max_turns` actions) runs out: a trajectory, ended
  `turn_budget`. An action cut by the per-turn token budget (`task.episode.max_turn_tokens`) is
  given to the environment as it was sampled: the environment decides what it means;
- the environment raises, or the trial outlives `task.episode.trial_timeout_s`: a failed trial
  (retried by the rollout environment, never cached as a result: wall time and crashes are not
  what the policy did).

A user's environment is a settings class (its section of the experiment file, `task.environment`,
with `name`), a `make` factory and optionally `demonstrate` (valid, not necessarily good, action
sequences: what the supervised warm-up imitates), registered with `register_environment(...)` (as
`tests/test_agent_environment.py` does), or shipped in `BUILTIN_ENVIRONMENTS`.
"""

import importlib
import random
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from pydantic import Field

from dagster_rl.base import plugins
from dagster_rl.base.strict import Strict

if TYPE_CHECKING:
    from dagster_rl.tasks.agent.trial_sandbox import TrialSandbox

JudgeValue = str | int | float | bool | None


class EnvironmentSettings(Strict):
    """An environment's section of the experiment file (`task.environment`): its name, and the
    settings its class adds."""

    name: str = Field(
        description="the registered environment (`dagster_rl.tasks.agent.environment`): secret_search, or a plugin's"
    )


S = TypeVar("S", bound=EnvironmentSettings)


@dataclass(frozen=True)
class World:
    """A world an episode plays: its id (`t<step>.<prompt>` for training, `e<index>` held out) and the
    seed its content is drawn from (from the experiment seed and the id). The trials of one world in
    a step are a GRPO group."""

    id: str
    seed: int


@dataclass(frozen=True)
class Outcome:
    """What the environment answers an action: the next observation, whether the episode is over (and
    why), and the tool call it read in the action (for the record and for people)."""

    observation: str
    done: bool = False
    end_reason: str | None = None  # when done: answered, bad_action, ... (the environment's words)
    tool: str | None = None  # the tool the action called (`open`), None when it called none
    argument: str | None = None  # its argument as the action gave it


class TextEnvironment(Protocol):
    def reset(self) -> str:
        """The first observation."""

    def step(self, action: str) -> Outcome:
        """Act: the model's action text (decoded from the ids it sampled; nothing is re-encoded)."""

    def verdict(self) -> dict[str, JudgeValue]:
        """What the judge needs once the episode is over: `success` (bool) at least."""

    def close(self) -> None:
        """Release what it holds (the rollout removes the sandbox after)."""


@dataclass(frozen=True)
class EnvironmentSpec(Generic[S]):
    """A registered environment. `make(settings, world, seed, sandbox)`: a live environment for one
    trial. `demonstrate(settings, world, rng)`: a valid sequence of action texts for the world (the
    supervised warm-up's demonstrations), or None when the environment has none. `code_version`:
    in the rollouts' cache key (a new version of the world is new rollouts). `min_turns`: the fewest
    actions a successful episode takes (an experiment whose warm-up allows fewer is refused)."""

    name: str
    settings: type[S]
    make: Callable[[S, World, int, "TrialSandbox"], TextEnvironment]
    code_version: str
    demonstrate: Callable[[S, World, random.Random], list[str]] | None = None
    description: str = ""
    min_turns: int = 1  # the fewest actions a successful episode takes: a demonstration needs that many turns
    runs_programs: bool = False  # it runs programs in the trial's sandbox: a run checks the sandbox before its first step
    extra: Mapping[str, Any] = field(default_factory=dict)


# The environments that ship with dagster-rl: name -> the module that registers it (imported on first use).
BUILTIN_ENVIRONMENTS = {
    "secret_search": "dagster_rl.tasks.agent.text_world",
    "python_tool": "dagster_rl.tasks.agent.python_tool",
    "textarena": "dagster_rl.tasks.agent.textarena_game",
}
_REGISTERED: dict[str, EnvironmentSpec] = {}
_REGISTERED_BY: dict[str, str] = {}


def register_environment(spec: EnvironmentSpec) -> EnvironmentSpec:
    """Make `spec.name` known; registering the same name again replaces it. The module that calls it
    is remembered (`registered_by`): a trial's environment runs in a process of its own, which imports
    that module to find the environment registered."""
    _REGISTERED[spec.name] = spec
    _REGISTERED_BY[spec.name] = sys._getframe(1).f_globals.get("__name__", "")
    return spec


def registered_by(name: str) -> str:
    """The module whose import registers environment `name` ("" when unknown)."""
    return _REGISTERED_BY.get(name, "")


def environment_names() -> list[str]:
    return sorted(set(BUILTIN_ENVIRONMENTS) | set(_REGISTERED))


def environment_of(name: str) -> EnvironmentSpec:
    if name not in _REGISTERED and name in BUILTIN_ENVIRONMENTS:
        importlib.import_module(BUILTIN_ENVIRONMENTS[name])
    if name not in _REGISTERED:
        failed = plugins.installed_failures()  # installed plugins, imported once per process at the first miss
        if name not in _REGISTERED:
            raise ValueError(
                f"{name!r} is not a text environment; use one of {environment_names()}, or name the file that registers "
                f"yours (register_environment(...)) in the experiment's `plugins`{failed}"
            )
    return _REGISTERED[name]
