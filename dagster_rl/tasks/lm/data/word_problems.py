"""GSM8K-format word problems written in code: multi-step arithmetic in words, reasoning in the answers.

    {"question": "Mia has 7 pens. She buys 5 more pens and gives 3 pens to Tom. How many pens does Mia have now?",
     "answer": "Mia has 7 + 5 = 12 pens. Then 12 - 3 = 9 pens.\n#### 9"}

Every problem is a pure function of (seed, index): `word_problems(n, seed)` is the same list on every
machine, so tests and the demo have a data set without a download. `write_jsonl(path, n, seed)`
writes it as a GSM8K JSONL file (`{"question", "answer"}` per line, the answer ending in
`#### <number>`), the format `lm.prompts.load_gsm8k_jsonl` reads; `builtin:word-problems` as a
`task.source.path` names the shipped set (`resolve_dataset`), written once per machine:

    python -m dagster_rl.tasks.lm.data.word_problems out.jsonl --n 2000 --seed 0 --max-operand 5

The words come from a fixed vocabulary (`vocabulary()`), so a tokenizer can make each word one token
(the `builtin:tiny-qwen2-gsm8k` model's does). Numbers stay small (by default operands up to 5,
results 1..10), so a tiny model can learn the arithmetic facts; which facts a held-out problem
needs, training problems need too, with other names, objects and numbers around them.
"""

import argparse
import json
import os
import random
import tempfile
from collections.abc import Callable
from pathlib import Path

from dagster_rl.base.hashing import seed_of

NAMES = {  # name -> pronoun
    "Tom": "He",
    "Sam": "He",
    "Ben": "He",
    "Max": "He",
    "Leo": "He",
    "Jack": "He",
    "Mia": "She",
    "Ann": "She",
    "Lily": "She",
    "Emma": "She",
    "Zoe": "She",
    "Ava": "She",
}
OBJECTS = ("apples", "pens", "books", "cards", "eggs", "cookies", "stamps", "shells", "marbles", "stickers")
CONTAINERS = ("bags", "boxes", "packs", "jars")
OPERATORS = ("+", "-", "*", "=")
FUNCTION_WORDS = (
    "has",
    "buy",
    "buys",
    "and",
    "more",
    "How",
    "many",
    "does",
    "have",
    "now",
    "gives",
    "to",
    "Then",
    "of",
    "Each",
    "the",
    "with",
    "in",
    "each",
    "a",
    "friend",
    "left",
)


def _buy(r: random.Random, m: int, name: str, he: str, obj: str) -> tuple[str, str, int]:
    a, b = r.randint(1, m), r.randint(1, m)
    q = f"{name} has {a} {obj}. {he} buys {b} more {obj}. How many {obj} does {name} have now?"
    return q, f"{name} has {a} + {b} = {a + b} {obj}.", a + b


def _give(r: random.Random, m: int, name: str, he: str, obj: str) -> tuple[str, str, int]:
    a = r.randint(2, m + 1)
    b = r.randint(1, a - 1)
    friend = r.choice([n for n in NAMES if n != name])
    q = f"{name} has {a} {obj}. {he} gives {b} {obj} to {friend}. How many {obj} does {name} have now?"
    return q, f"{name} has {a} - {b} = {a - b} {obj}.", a - b


def _buy_then_give(r: random.Random, m: int, name: str, he: str, obj: str) -> tuple[str, str, int]:
    a, b = r.randint(1, m), r.randint(1, m)
    c = r.randint(1, a + b - 1)
    friend = r.choice([n for n in NAMES if n != name])
    q = f"{name} has {a} {obj}. {he} buys {b} more {obj} and gives {c} {obj} to {friend}. How many {obj} does {name} have now?"
    return q, f"{name} has {a} + {b} = {a + b} {obj}. Then {a + b} - {c} = {a + b - c} {obj}.", a + b - c


def _groups(r: random.Random, m: int, name: str, he: str, obj: str) -> tuple[str, str, int]:
    a, b = r.randint(2, max(2, m - 1)), r.randint(2, max(2, m - 1))
    box = r.choice(CONTAINERS)
    q = f"{name} buys {a} {box} of {obj}. Each of the {box} has {b} {obj}. How many {obj} does {name} buy?"
    return q, f"{name} buys {a} * {b} = {a * b} {obj}.", a * b


def _groups_then_give(r: random.Random, m: int, name: str, he: str, obj: str) -> tuple[str, str, int]:
    a, b = r.randint(2, max(2, (m + 1) // 2)), r.randint(2, max(2, (m + 1) // 2))
    c = r.randint(1, a * b - 1)
    box = r.choice(CONTAINERS)
    q = f"{name} buys {a} {box} with {b} {obj} in each. {he} gives {c} {obj} to a friend. How many {obj} does {name} have left?"
    return q, f"{name} buys {a} * {b} = {a * b} {obj}. Then {a * b} - {c} = {a * b - c} {obj}.", a * b - c


KINDS: dict[str, Callable[[random.Random, int, str, str, str], tuple[str, str, int]]] = {
    "buy": _buy,
    "give": _give,
    "buy_then_give": _buy_then_give,
    "groups": _groups,
    "groups_then_give": _groups_then_give,
}


def word_problem(seed: int, index: int, max_operand: int = 5) -> dict[str, str]:
    """Problem `index` of the set drawn from `seed`: {"question", "answer"} in GSM8K's format.
    Sums and differences take operands up to `max_operand`, products smaller ones; every
    intermediate and final result is at least 1."""
    if max_operand < 2:
        raise ValueError(f"max_operand={max_operand}: word problems need operands up to at least 2")
    r = random.Random(seed_of(seed, "word-problem", index))
    kind = r.choice(sorted(KINDS))
    name = r.choice(sorted(NAMES))
    question, reasoning, result = KINDS[kind](r, max_operand, name, NAMES[name], r.choice(OBJECTS))
    return {"question": question, "answer": f"{reasoning}\n#### {result}"}


def word_problems(n: int, seed: int = 0, max_operand: int = 5) -> list[dict[str, str]]:
    """n distinct problems (a repeated question is drawn again), in a fixed order."""
    seen: set[str] = set()
    out: list[dict[str, str]] = []
    index = 0
    while len(out) < n:
        if index > 50 * n + 1000:
            raise ValueError(f"cannot draw {n} distinct word problems; ask for fewer")
        p = word_problem(seed, index, max_operand)
        index += 1
        if p["question"] not in seen:
            seen.add(p["question"])
            out.append(p)
    return out


def vocabulary() -> list[str]:
    """Every word and sign the problems and their answers use (numbers are digits)."""
    return sorted({*FUNCTION_WORDS, *NAMES, *NAMES.values(), *OBJECTS, *CONTAINERS, *OPERATORS, ".", "?", "####"})


def write_jsonl(path: Path | str, n: int, seed: int = 0, max_operand: int = 5) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(p) + "\n" for p in word_problems(n, seed, max_operand)))
    return path


BUILTIN_PREFIX = "builtin:"
BUILTIN_DATASETS = {"word-problems": (2000, 0, 5)}  # name -> (problems, seed, max_operand); never change one


def data_cache_dir() -> Path:
    return Path(os.environ.get("DAGSTER_RL_DATA_CACHE", Path.home() / ".cache" / "dagster_rl" / "data"))


def resolve_dataset(path: str) -> str:
    """`builtin:word-problems` (or an arithmetic set, `lm.arithmetic`) -> a JSONL file written once per
    machine; any other path as given."""
    if not path.startswith(BUILTIN_PREFIX):
        return path
    from dagster_rl.tasks.lm.data.arithmetic import ARITHMETIC_SETS
    from dagster_rl.tasks.lm.data.arithmetic import write_jsonl as write_arithmetic

    name = path[len(BUILTIN_PREFIX) :]
    if name not in BUILTIN_DATASETS and name not in ARITHMETIC_SETS:
        raise ValueError(f"no built-in data set {name!r}; built-in data sets: {', '.join([*BUILTIN_DATASETS, *ARITHMETIC_SETS])}")
    target = data_cache_dir() / f"{name}.jsonl"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{name}-", dir=target.parent)
        os.close(fd)
        if name in ARITHMETIC_SETS:
            write_arithmetic(tmp, ARITHMETIC_SETS[name])
        else:
            write_jsonl(tmp, *BUILTIN_DATASETS[name])
        os.replace(tmp, target)  # atomic: readers see the whole file or none
    return str(target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write GSM8K-format word problems as JSONL.")
    parser.add_argument("path")
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-operand", type=int, default=5, help="largest operand of a sum or difference")
    args = parser.parse_args(argv)
    print(write_jsonl(args.path, args.n, args.seed, args.max_operand))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
