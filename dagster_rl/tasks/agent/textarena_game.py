"""`textarena`: a single-player textarena game (GuessTheNumber, TowerOfHanoi) as a text environment.

    task:
      environment: {name: textarena, game: GuessTheNumber-v0, prompt: brief}

Each world is one game: `ta.make("<game>-raw")` (the game without textarena's observation wrappers)
reset with `reset(num_players=1, seed=<the world's seed>)`. The world's seed, not the trial's: the
trials of one world are a GRPO group and must play the same game, and the held-out evaluation's
trials all have seed 0 while their worlds differ. The mapping to the protocol:

- the first observation: the game's prompt (or, with `prompt: brief`, one line of the same rules)
  and what else the game shows at the start (TowerOfHanoi's board);
- a turn: the model's text, with square brackets added when it has none (`bracket_actions`), is
  the game's `step(action)`; the observation is what the game said to the player during that step,
  verbatim (`get_observation()`'s messages but the player's own action, which the trajectory already
  holds: "The target number is higher.", the board, an invalid move's reason). Not the wrappers'
  whole history each turn: the conversation is the history;
- the episode ends when the game does: `won` (its reward is 1), `invalid_move` (textarena forgives
  one invalid move with a message, and ends the game at the second in a row), `lost` (its own turn
  limit); or at the episode's turn budget, before the game is over;
- the verdict: `success` (the game's reward says the player won), `reward` (the game's raw reward:
  1 for a win, else its partial credit, e.g. how close the last guess was; null when the game is
  not over), `reason` (the game's words for how it ended), `game_over`, `moves` (the valid moves it
  counted) and `game`.

Isolation: textarena draws from Python's global `random` and seeds it in `reset` (`ta.State`). Each
trial's environment runs in a process of its own (`environment_process`), so no other trial shares
it; and within one process each game keeps a private state of `random`: every call into textarena
runs with `random`'s global state set to the game's own, which is saved after the call and the
caller's restored. A game's observations depend on its seed alone, whatever else the process draws
or plays (`tests/test_agent_textarena.py` interleaves two games in one process).

Demonstrations (`demonstrate`, the warm-up's): GuessTheNumber bisects with probability
`demo_bisect_rate`, else scans up from the lowest number still possible, reading each hint from the
game itself; TowerOfHanoi plays the recursive solution (2^n - 1 moves).
"""

import random
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import textarena as ta

from dagster_rl.tasks.agent.environment import EnvironmentSpec, JudgeValue, Outcome, World, register_environment
from dagster_rl.tasks.agent.textarena_settings import GAMES, TextArenaSettings

CODE_VERSION = f"textarena-game-1+textarena-{ta.__version__}"
PLAYER = 0
BRIEF = {
    "GuessTheNumber": "Guess the number from {min_number} to {max_number} within {max_turns} turns. Reply with a guess in "
    "square brackets, like [5].",
    "TowerOfHanoi": "Move the {num_disks} disks from tower A to tower C, one disk a turn, never a bigger disk onto a "
    "smaller one. Reply with a move, like [A C].",
}
HINT = re.compile(r"The target number is (higher|lower)\.")  # GuessTheNumber's hint, as it writes it
T = TypeVar("T")


class PrivateRandom:
    """Python's `random` as one game's own: calls run with the global state set to the game's, which
    is kept after the call, and the caller's state put back."""

    def __init__(self, seed: int):
        self.state = random.Random(seed).getstate()

    @contextmanager
    def active(self) -> Iterator[None]:
        outer = random.getstate()
        random.setstate(self.state)
        try:
            yield
        finally:
            self.state = random.getstate()
            random.setstate(outer)

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        with self.active():
            return fn(*args, **kwargs)


class TextArenaGame:
    """One trial: one game, seeded by its world."""

    def __init__(self, settings: TextArenaSettings, world: World, seed: int, sandbox: Any):
        self.settings, self.spec = settings, GAMES[settings.game]
        self.random = PrivateRandom(world.seed)
        self.game = self.random.call(ta.make, f"{settings.game}-raw", **settings.options)
        self.random.call(self.game.reset, num_players=1, seed=world.seed)

    def _said(self) -> list[tuple[str, Any]]:
        """What the game said to the player since the last look, but the player's own actions."""
        _, messages = self.random.call(self.game.get_observation)
        return [(text, kind) for sender, text, kind in messages if kind != ta.ObservationType.PLAYER_ACTION]

    def reset(self) -> str:
        said = self._said()
        if self.settings.prompt == "brief":
            brief = BRIEF[self.spec.family].format(**self.settings.options)
            said = [(brief, kind) if kind == ta.ObservationType.PROMPT else (text, kind) for text, kind in said]
        return "\n".join(text for text, _ in said)

    def action(self, text: str) -> str:
        """The model's text as the game reads it: with square brackets added when it has none (`bracket_actions`)."""
        if self.settings.bracket_actions and "[" not in text and "]" not in text:
            return f"[{text.strip()}]"
        return text

    def step(self, action: str) -> Outcome:
        move = self.action(action)
        done, _ = self.random.call(self.game.step, move)
        observation = "\n".join(text for text, _ in self._said())
        argument = move.strip()[:200] or None
        if not done:
            return Outcome(observation, tool=self.spec.verb, argument=argument)
        return Outcome(observation, done=True, end_reason=self.end_reason(), tool=self.spec.verb, argument=argument)

    def _result(self) -> tuple[float | None, dict[str, Any]]:
        rewards, info = self.random.call(self.game.close)  # textarena's close(): the rewards and game info, nothing freed
        return (None if rewards is None else float(rewards[PLAYER])), info[PLAYER]

    def end_reason(self) -> str:
        reward, info = self._result()
        if info.get("invalid_move"):
            return "invalid_move"
        return "won" if reward is not None and reward >= 1.0 else "lost"

    def verdict(self) -> dict[str, JudgeValue]:
        reward, info = self._result()
        over = bool(self.game.state.done)
        return {
            "success": over and not info.get("invalid_move") and reward is not None and reward >= 1.0,
            "reward": reward,
            "reason": info.get("reason"),
            "game_over": over,
            "moves": int(info.get("turn_count", 0)),
            "game": self.settings.game,
        }

    def close(self) -> None:
        pass


def hanoi(disks: int, source: str = "A", target: str = "C", spare: str = "B") -> list[str]:
    """The recursive solution: the moves of `disks` disks from `source` to `target`, 2^disks - 1 of them."""
    if disks == 0:
        return []
    return [*hanoi(disks - 1, source, spare, target), f"[{source} {target}]", *hanoi(disks - 1, spare, target, source)]


def demonstrate(settings: TextArenaSettings, world: World, rng: random.Random) -> list[str]:
    """TowerOfHanoi: the recursive solution. GuessTheNumber: a search played against the world's game,
    reading its hints: binary search with probability `demo_bisect_rate`, else a scan up from the lowest
    number still possible."""
    options = settings.options
    if GAMES[settings.game].family == "TowerOfHanoi":
        return hanoi(options["num_disks"])
    game = TextArenaGame(settings, world, 0, None)
    game.reset()  # the prompt read: a hint is what a step answers
    bisect = rng.random() < settings.demo_bisect_rate
    low, high = options["min_number"], options["max_number"]
    actions: list[str] = []
    while low <= high and len(actions) <= options["max_turns"]:  # textarena ends the game after max_turns + 1 guesses
        guess = (low + high) // 2 if bisect else low
        actions.append(f"[{guess}]")
        outcome = game.step(actions[-1])
        hint = HINT.search(outcome.observation)
        if outcome.done or hint is None:
            break
        low, high = (guess + 1, high) if hint.group(1) == "higher" else (low, guess - 1)
    return actions


SPEC = register_environment(
    EnvironmentSpec(
        name="textarena",
        settings=TextArenaSettings,
        make=TextArenaGame,
        code_version=CODE_VERSION,
        demonstrate=demonstrate,
        description="a single-player textarena game (GuessTheNumber, TowerOfHanoi), seeded by the world; its reward is the verdict",
        min_turns=1,
    )
)
