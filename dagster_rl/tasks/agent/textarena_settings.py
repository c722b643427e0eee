"""The `textarena` environment's settings: the single-player games verified to run offline, and their options.

Apart from the environment (`textarena_game`), which imports `textarena` (about a second, and
`openai`, `nltk`, `chess` with it): an experiment validates, and the reference documents it, without
that import. `GAMES` holds each verified game with the options textarena registers it with (its
`ta.make` keyword arguments); `tests/test_agent_textarena.py` checks them against textarena's own
registry, so an upgrade that changes a game is seen.

Verified offline, here: `ta.make("<id>-raw")` (the game without textarena's observation wrappers),
`reset(num_players=1, seed=...)`, `step`, `get_observation` and `close` with no network and no file
but the package's own; the game's reward is 1 exactly when the player solved it; its draws come from
Python's `random` alone (which the environment keeps private to each game). Not in the list:
Wordle, Hangman, WordLadder and the other word games (they read NLTK's corpora, which
`nltk.download` fetches at run time), the games of two or more players, and those not checked yet.
"""

from dataclasses import dataclass, field
from typing import Literal

from pydantic import Field, field_validator, model_validator

from dagster_rl.tasks.agent.environment import EnvironmentSettings

Family = Literal["GuessTheNumber", "TowerOfHanoi"]


@dataclass(frozen=True)
class Game:
    """A verified game: its family (what the adapter's demonstrations and brief prompt know) and the
    options textarena registers it with."""

    family: Family
    options: dict[str, int] = field(default_factory=dict)

    @property
    def verb(self) -> str:
        """The tool a turn calls, in the trajectory's record."""
        return "guess" if self.family == "GuessTheNumber" else "move"


GAMES = {
    "GuessTheNumber-v0": Game("GuessTheNumber", {"min_number": 1, "max_number": 20, "max_turns": 10}),
    "GuessTheNumber-v0-hardcore": Game("GuessTheNumber", {"min_number": 1, "max_number": 50, "max_turns": 10}),
    "TowerOfHanoi-v0": Game("TowerOfHanoi", {"num_disks": 3, "max_turns": 14}),
    "TowerOfHanoi-v0-medium": Game("TowerOfHanoi", {"num_disks": 4, "max_turns": 30}),
    "TowerOfHanoi-v0-hard": Game("TowerOfHanoi", {"num_disks": 5, "max_turns": 62}),
}
OPTIONS: dict[Family, tuple[str, ...]] = {  # the settings below that each family takes (None elsewhere)
    "GuessTheNumber": ("min_number", "max_number"),
    "TowerOfHanoi": ("num_disks",),
}
MAX_NUMBER = 1_000_000
MAX_DISKS = 10
MAX_GAME_TURNS = 10_000


class TextArenaSettings(EnvironmentSettings):
    """`task.environment` of `textarena`: a single-player textarena game, seeded by the world."""

    name: Literal["textarena"] = Field("textarena", description="the environment: textarena")
    game: str = Field(
        description=f"the textarena game, one of those verified to run offline: {', '.join(GAMES)}. Each world is one "
        "game, seeded by the world's seed: the trials of a world (a GRPO group) play the same game"
    )
    prompt: Literal["game", "brief"] = Field(
        "game",
        description="the first observation: `game`, the game's own prompt as textarena writes it (its rules, a few "
        "hundred characters); `brief`, one line of the same rules, for a small model. Either way each later observation "
        "is what the game answered the action (a hint, the board, an invalid move's reason), verbatim",
    )
    bracket_actions: bool = Field(
        True,
        description="an action without square brackets is read with them (`5` as `[5]`, `A C` as `[A C]`), as "
        "textarena's own ActionFormattingWrapper does for its registered games (here the action is stripped first)",
    )
    min_number: int | None = Field(
        None, ge=0, le=MAX_NUMBER, description="GuessTheNumber: the lowest number; null: the game's (1)"
    )
    max_number: int | None = Field(
        None, ge=1, le=MAX_NUMBER, description="GuessTheNumber: the highest number; null: the game's (20, or 50 hardcore)"
    )
    num_disks: int | None = Field(
        None, ge=1, le=MAX_DISKS, description="TowerOfHanoi: the disks to move; null: the game's (3, 4 medium, 5 hard)"
    )
    game_turns: int | None = Field(
        None,
        ge=1,
        le=MAX_GAME_TURNS,
        description="the game's own turn limit (textarena's max_turns; textarena ends the game, lost, at the valid move "
        "after it: max_turns + 1 moves); null: the game's. The episode's turn budget (task.episode.max_turns) counts "
        "every action and may end a game first",
    )
    demo_bisect_rate: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="GuessTheNumber's demonstrations: with this probability one bisects (binary search: the middle of "
        "the numbers still possible), else it scans up from the lowest number still possible (valid, and slow). "
        "TowerOfHanoi's demonstrations are the recursive solution",
    )

    @field_validator("game")
    @classmethod
    def _a_verified_game(cls, game: str) -> str:
        if game not in GAMES:
            raise ValueError(
                f"{game!r} is not a textarena game verified to run offline here; use one of {', '.join(GAMES)} "
                "(word games such as Wordle download NLTK data at run time; games of two or more players are not "
                "single-player environments)"
            )
        return game

    @model_validator(mode="after")
    def _options_of_the_game(self) -> "TextArenaSettings":
        family = GAMES[self.game].family
        for other, names in OPTIONS.items():
            for option in names:
                if other != family and getattr(self, option) is not None:
                    raise ValueError(f"{option} is a setting of the {other} games, not of {self.game}: remove it")
        if family == "GuessTheNumber" and self.options["min_number"] >= self.options["max_number"]:
            raise ValueError(f"min_number ({self.options['min_number']}) must be below max_number ({self.options['max_number']})")
        return self

    @property
    def options(self) -> dict[str, int]:
        """The game's keyword arguments: textarena's registered ones, with the settings given."""
        given = {option: getattr(self, option) for option in OPTIONS[GAMES[self.game].family]}
        given["max_turns"] = self.game_turns
        return {**GAMES[self.game].options, **{k: v for k, v in given.items() if v is not None}}
