"""Arithmetic questions written in code, in GSM8K's file format: what a small real model is trained on.

    {"question": "What is 13 + 14? Answer with the number only.", "answer": "13 + 14 = 27\\n#### 27"}

A set is every pair of operands in a range with one operator, in a fixed order: the same file on
every machine, no download. `builtin:<name>` as a `task.source.path` names a shipped set
(`ARITHMETIC_SETS`, through `word_problems.resolve_dataset`); the held-out split is by a hash of each
question, as for any GSM8K file. The question asks for the number alone, so that an instruct model
answers in a form the verifier reads (the last number of the answer).

    python -m dagster_rl.tasks.lm.data.arithmetic out.jsonl --op + --low 1 --high 20
"""

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
INSTRUCTION = "Answer with the number only."


@dataclass(frozen=True)
class ArithmeticSet:
    op: str
    low: int  # operands from low to high, both included
    high: int


# name -> set; what a name writes never changes (machines cache the file by name)
ARITHMETIC_SETS = {"addition-1-20": ArithmeticSet("+", 1, 20)}


def problems(spec: ArithmeticSet) -> list[dict[str, str]]:
    """Every `a op b` with a, b in [low, high] (for "-", a >= b: no negative answers), as GSM8K rows."""
    if spec.op not in OPERATIONS:
        raise ValueError(f"operator {spec.op!r}; choose from {', '.join(OPERATIONS)}")
    if spec.low > spec.high:
        raise ValueError(f"low {spec.low} is above high {spec.high}")
    rows = []
    for a in range(spec.low, spec.high + 1):
        for b in range(spec.low, spec.high + 1):
            if spec.op == "-" and b > a:
                continue
            result = OPERATIONS[spec.op](a, b)
            rows.append(
                {
                    "question": f"What is {a} {spec.op} {b}? {INSTRUCTION}",
                    "answer": f"{a} {spec.op} {b} = {result}\n#### {result}",
                }
            )
    return rows


def write_jsonl(path: Path | str, spec: ArithmeticSet) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(p) + "\n" for p in problems(spec)))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write arithmetic questions as GSM8K-format JSONL.")
    parser.add_argument("path")
    parser.add_argument("--op", choices=sorted(OPERATIONS), default="+")
    parser.add_argument("--low", type=int, default=1)
    parser.add_argument("--high", type=int, default=20)
    args = parser.parse_args(argv)
    print(write_jsonl(args.path, ArithmeticSet(args.op, args.low, args.high)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
