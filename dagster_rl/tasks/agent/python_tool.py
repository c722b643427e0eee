"""`python_tool`: questions one line of Python answers, and a Python tool that runs it in the sandbox.

A world (drawn from its seed) is one question a small model cannot answer in its head: the product
of two `digits`-digit numbers, the sum of `terms` of them, or the number of digits of a power. The
agent acts in plain text, one action a turn:

    python: 737 * 361     runs the code in the trial's sandbox (`dagster_rl.sandbox`); the observation
                          is what it printed (an expression alone is printed, as a REPL does), or its
                          error, or how a limit stopped it: `[Timeout after 5 s]`
    answer: 266057        ends the episode (`answered`); it succeeded when the number is right

A fenced block (```python ... ```) is a tool call too. Anything else ends the episode as
`bad_action`. A program that fails, times out or exceeds a limit is the policy's doing: an
observation, and the episode goes on; a sandbox that cannot be made fails the trial (retried,
never cached). With `instructions` on (the default: a pretrained model was never shown the tool),
the first observation says how to call it and how to answer.

The warm-up's demonstrations (`demonstrate`) call the tool with probability `demo_tool_rate` (one
call, then the answer it printed) and otherwise answer at once with the right number: a model that
imitates them mostly guesses (and a small model guesses wrong); GRPO's to make calling the tool the
rule. The verdict holds `success`, the answer, the truth and the number of tool calls.
"""

import ast
import random
import re
from typing import Literal

from pydantic import Field

from dagster_rl.sandbox.calls import MAX_SOURCE_BYTES, Program
from dagster_rl.sandbox.limits import SandboxLimits
from dagster_rl.tasks.agent.environment import (
    EnvironmentSettings,
    EnvironmentSpec,
    JudgeValue,
    Outcome,
    World,
    register_environment,
)
from dagster_rl.tasks.agent.trial_sandbox import TrialSandbox

CODE_VERSION = "python-tool-2"  # 2: a wall-clock timeout reads as one
Kind = Literal["products", "sums", "power_digits"]
INSTRUCTIONS = """You can run Python code. To run code, reply with one line:
python: <code>
and its output comes back. When you know the answer, reply with one line:
answer: <number>"""
FENCE = re.compile(r"^```(?:python|py)?\s*\n(?P<code>.*?)\n?```$", re.DOTALL)
NUMBER = re.compile(r"-?\d+")


class PythonToolSettings(EnvironmentSettings):
    """`task.environment` of `python_tool`: its questions, the sandbox's limits, its demonstrations."""

    name: Literal["python_tool"] = Field("python_tool", description="the environment: python_tool")
    kinds: list[Kind] = Field(
        ["products"],
        min_length=1,
        description="the questions a world draws from: products (a * b), sums (of `terms` numbers), power_digits "
        "(the digits of a^b)",
    )
    digits: int = Field(3, ge=1, le=12, description="digits of each number of a product or a sum")
    terms: int = Field(8, ge=2, le=64, description="numbers of a sum")
    instructions: bool = Field(True, description="the first observation says how to call the tool and how to answer")
    sandbox: SandboxLimits = Field(SandboxLimits(), description="what one program may use (its CPU seconds are its timeout)")
    demo_tool_rate: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="the warm-up's demonstrations call the tool (then answer what it printed) with this probability, "
        "and otherwise answer at once",
    )


def _product(settings: "PythonToolSettings", rng: random.Random) -> tuple[str, str, int]:
    low, high = 10 ** (settings.digits - 1), 10**settings.digits - 1
    a, b = rng.randint(low, high), rng.randint(low, high)
    return f"What is {a} * {b}?", f"{a} * {b}", a * b


def _sum(settings: "PythonToolSettings", rng: random.Random) -> tuple[str, str, int]:
    low, high = 10 ** (settings.digits - 1), 10**settings.digits - 1
    terms = ", ".join(str(rng.randint(low, high)) for _ in range(settings.terms))
    return f"What is the sum of {terms}?", f"sum([{terms}])", sum(map(int, terms.split(", ")))


def _power_digits(settings: "PythonToolSettings", rng: random.Random) -> tuple[str, str, int]:
    base, power = rng.randint(2, 99), rng.randint(20, 400)
    return f"How many digits does {base}**{power} have?", f"len(str({base}**{power}))", len(str(base**power))


QUESTIONS = {"products": _product, "sums": _sum, "power_digits": _power_digits}


class Question:
    """A world's question, the one line of Python that answers it, and the answer: drawn from its seed alone."""

    def __init__(self, settings: "PythonToolSettings", world: World):
        rng = random.Random(world.seed)
        self.shape = rng.choice(settings.kinds)
        self.text, self.code, self.answer = QUESTIONS[self.shape](settings, rng)


def program_of(code: str) -> Program:
    """The code as a program: an expression alone is printed (as a REPL shows it); statements run as they are."""
    try:
        ast.parse(code, mode="eval")
        return Program(python=f"print({code})")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return Program(python=code)


def tool_code(action: str) -> str | None:
    """The code of a tool call (`python: <code>`, or a fenced block), or None when the action is not one."""
    text = action.strip()
    fenced = FENCE.match(text)
    if fenced:
        return fenced.group("code").strip()
    verb, sep, rest = text.partition(":")
    return rest.strip() if sep and verb.strip().lower() == "python" else None


class PythonTool:
    """One trial: its question, and its sandbox for the programs it runs."""

    def __init__(self, settings: PythonToolSettings, world: World, seed: int, sandbox: TrialSandbox):
        self.settings, self.sandbox = settings, sandbox
        self.question = Question(settings, world)
        self.calls = 0
        self.answer: str | None = None

    def reset(self) -> str:
        question = f"Question: {self.question.text}"
        return f"{INSTRUCTIONS}\n\n{question}" if self.settings.instructions else question

    def step(self, action: str) -> Outcome:
        code = tool_code(action)
        if code is not None:
            if not code or len(code.encode()) > MAX_SOURCE_BYTES - 16:
                return Outcome("", done=True, end_reason="bad_action", tool="python", argument=code[:200])
            self.calls += 1
            call = self.sandbox.run(program_of(code), self.settings.sandbox)
            text = call.text(self.settings.sandbox)
            return Outcome(text if text.strip() else "(no output)", tool="python", argument=code)
        verb, sep, rest = action.strip().partition(":")
        if sep and verb.strip().lower() == "answer" and rest.strip():
            self.answer = rest.strip()
            return Outcome("", done=True, end_reason="answered", tool="answer", argument=self.answer)
        return Outcome(
            "", done=True, end_reason="bad_action", tool=verb.strip()[:40] or None, argument=rest.strip()[:200] or None
        )

    def verdict(self) -> dict[str, JudgeValue]:
        given = (self.answer or "").replace(",", "").rstrip(".")
        return {
            "success": NUMBER.fullmatch(given) is not None and int(given) == self.question.answer,
            "answer": self.answer,
            "truth": str(self.question.answer),
            "question": self.question.shape,
            "tool_calls": self.calls,
            "called_tool": self.calls > 0,
        }

    def close(self) -> None:
        pass


def demonstrate(settings: PythonToolSettings, world: World, rng: random.Random) -> list[str]:
    """One tool call then its answer (with probability `demo_tool_rate`), or the answer at once."""
    question = Question(settings, world)
    answer = f"answer: {question.answer}"
    return [f"python: {question.code}", answer] if rng.random() < settings.demo_tool_rate else [answer]


SPEC = register_environment(
    EnvironmentSpec(
        name="python_tool",
        settings=PythonToolSettings,
        make=PythonTool,
        code_version=CODE_VERSION,
        demonstrate=demonstrate,
        description="answer a question that one line of Python answers, with a Python tool that runs in the sandbox",
        min_turns=1,
        runs_programs=True,
    )
)
