"""`secret_search` as a text environment: find the document the clue names, open it, answer its digest.

A world (drawn from its seed) has `n_docs` documents, each titled by a distinct word of `TITLES`;
one of them, the one whose title the clue names, holds the secret's digest (`digest_chars`
upper-case hex characters); the others hold nothing. The first observation gives the clue and the
titles:

    find memo
    docs: ledger memo budget roster archive invoice

The agent acts in plain text, one action a turn:

    open <title>       the observation is that document's text: `digest 3FA9C1`, or `nothing`
    next               the same for the next document of the list (browsing from the top)
    answer <digest>    ends the episode (`answered`); it succeeded when the digest is the secret's

With `instructions` on (for a pretrained model that was never shown the tools), the first
observation starts with `INSTRUCTIONS`: the task, the three actions and a worked example.

Anything else (another verb, a title that is not listed, `next` past the end of the list, an empty
action) ends the episode as `bad_action`. Opening a document again is allowed (it costs a turn). The skill generalizes to
worlds never trained on: open the document the clue names first, then copy its digest exactly.
The warm-up's demonstrations are valid but mostly inefficient: they browse the documents from the
top of the list (`next`) until the digest shows, except that at each turn, with probability
`demo_clue_rate` (0.25), they open the document the clue names instead; then they answer. A model
that imitates them browses (greedily, always), and opens the clue's document only now and then:
GRPO's to make it the rule.

Sandbox: the world's documents are written into the trial's own folder (`TrialSandbox.folder`) when the
environment is made, and `open` reads them from there; a title reaches a path only after it is
found among the world's titles (the model's text is never a path). Nothing of a trial reaches the
world or another trial.
"""

import random
from typing import Literal

from pydantic import Field, model_validator

from dagster_rl.tasks.agent.environment import (
    EnvironmentSettings,
    EnvironmentSpec,
    JudgeValue,
    Outcome,
    World,
    register_environment,
)
from dagster_rl.tasks.agent.trial_sandbox import TrialSandbox

CODE_VERSION = "secret-search-text-1"
TITLES = (
    "ledger", "archive", "memo", "draft", "budget", "roster", "minutes", "invoice", "summary", "appendix", "notes", "index",
    "report", "letter", "receipt", "contract", "manual", "agenda", "journal", "catalog", "diary", "atlas", "permit", "census",
)  # fmt: skip
HEX = "0123456789ABCDEF"
INSTRUCTIONS = """Search the documents for the secret digest. Reply with one action only, one of:
open <title>
next
answer <digest>
Example:
user: find memo / docs: budget memo
assistant: open memo
user: digest 12AB
assistant: answer 12AB"""  # the first observation's head with `instructions` on
VERBS = ("find", "docs", "open", "next", "answer", "digest", "nothing")  # the words the environment writes or reads


class SecretSearchTextSettings(EnvironmentSettings):
    """`task.environment` of the `secret_search` text world: its size, its digests, its demonstrations."""

    name: Literal["secret_search"] = Field("secret_search", description="the environment: secret_search")
    n_docs: int = Field(
        6, ge=2, le=len(TITLES), description=f"documents per world, each titled by a distinct word (at most {len(TITLES)})"
    )
    titles: int = Field(
        len(TITLES),
        ge=2,
        le=len(TITLES),
        description=f"the first this many words of the {len(TITLES)} title words are what worlds draw their titles from "
        "(at least n_docs): fewer is easier, down to n_docs, where every world lists the same titles in its own order",
    )

    demo_search: Literal["browse", "random"] = Field(
        "browse",
        description="how the warm-up's demonstrations search: browse from the top of the list (`next`), opening the "
        "clue's document now and then (demo_clue_rate); or open documents by title in a random order until the digest shows",
    )
    demo_clue_rate: float = Field(
        0.25,
        ge=0.0,
        le=1.0,
        description="the warm-up's demonstrations browse the documents from the top of the list (`next`) until the digest "
        "shows, but at each turn, with this probability, open the document the clue names instead (valid searches, "
        "mostly inefficient below 0.5)",
    )

    @model_validator(mode="after")
    def _enough_titles(self) -> "SecretSearchTextSettings":
        if self.titles < self.n_docs:
            raise ValueError(
                f"titles ({self.titles}) must be at least n_docs ({self.n_docs}): each document has a title of its own"
            )
        return self

    digest_chars: int = Field(6, ge=1, le=64, description="upper-case hex characters of the secret's digest the agent must copy")
    instructions: bool = Field(
        False,
        exclude_if=lambda on: not on,  # off, the settings (and every key holding them) read as they do without the field
        description="the first observation starts with a short description of the task and of the three actions "
        "(`INSTRUCTIONS`): for a pretrained model that was never shown the tools; off, a warm-up on demonstrations teaches them",
    )


class Contents:
    """A world's content, drawn from its seed alone."""

    def __init__(self, settings: SecretSearchTextSettings, world: World):
        rng = random.Random(world.seed)
        self.titles = rng.sample(TITLES[: settings.titles], settings.n_docs)
        self.holder = rng.randrange(settings.n_docs)
        self.digest = "".join(rng.choice(HEX) for _ in range(settings.digest_chars))

    @property
    def clue(self) -> str:
        return self.titles[self.holder]

    def text(self, index: int) -> str:
        return f"digest {self.digest}" if index == self.holder else "nothing"


class SecretSearchText:
    """One trial's environment: the world's documents in the trial's sandbox."""

    def __init__(self, settings: SecretSearchTextSettings, world: World, seed: int, sandbox: TrialSandbox):
        self.world = Contents(settings, world)
        self.sandbox = sandbox.folder
        for title in self.world.titles:
            (sandbox / f"{title}.txt").write_text(self.world.text(self.world.titles.index(title)) + "\n")
        self.opened: list[str] = []
        self.browsed = 0  # documents `next` has opened: it opens titles[browsed]
        self.answer: str | None = None
        self.instructions = settings.instructions

    def reset(self) -> str:
        observation = f"find {self.world.clue}\ndocs: {' '.join(self.world.titles)}"
        return f"{INSTRUCTIONS}\n\n{observation}" if self.instructions else observation

    def step(self, action: str) -> Outcome:
        verb, _, argument = action.strip().partition(" ")
        argument = argument.strip()
        if verb == "open" and argument in self.world.titles:
            return self._open(argument, "open")
        if verb == "next" and not argument and self.browsed < len(self.world.titles):
            self.browsed += 1
            return self._open(self.world.titles[self.browsed - 1], "next")
        if verb == "answer" and argument:
            self.answer = argument
            return Outcome("", done=True, end_reason="answered", tool="answer", argument=argument)
        return Outcome("", done=True, end_reason="bad_action", tool=verb or None, argument=argument or None)

    def _open(self, title: str, tool: str) -> Outcome:
        """A listed document's text, read from the sandbox (`title` is one of the world's: never the model's text)."""
        self.opened.append(title)
        return Outcome((self.sandbox / f"{title}.txt").read_text().strip(), tool=tool, argument=title)

    def verdict(self) -> dict[str, JudgeValue]:
        first = self.opened[0] if self.opened else None
        return {
            "success": self.answer == self.world.digest,
            "answer": self.answer,
            "digest": self.world.digest,
            "clue": self.world.clue,
            "opened": len(self.opened),
            "first_open_right": first == self.world.clue,
        }

    def close(self) -> None:
        pass


def demonstrate(settings: SecretSearchTextSettings, world: World, rng: random.Random) -> list[str]:
    """A valid search, then the answer. `browse`: the documents from the top of the list (`next`)
    until the digest shows, except that at each turn, with probability `demo_clue_rate`, the document
    the clue names instead. `random`: documents opened by title in a random order until the digest
    shows (the clue's document among them by chance only)."""
    contents = Contents(settings, world)
    actions = []
    if settings.demo_search == "random":
        for title in rng.sample(contents.titles, len(contents.titles)):
            actions.append(f"open {title}")
            if title == contents.clue:
                break
        return [*actions, f"answer {contents.digest}"]
    for index in range(len(contents.titles)):
        if rng.random() < settings.demo_clue_rate:
            actions.append(f"open {contents.clue}")
            break
        actions.append("next")
        if index == contents.holder:
            break
    return [*actions, f"answer {contents.digest}"]


SPEC = register_environment(
    EnvironmentSpec(
        name="secret_search",
        settings=SecretSearchTextSettings,
        make=SecretSearchText,
        code_version=CODE_VERSION,
        demonstrate=demonstrate,
        description="find the document the clue names among the listed titles, open it, answer its digest",
        min_turns=2,  # open, answer
    )
)
