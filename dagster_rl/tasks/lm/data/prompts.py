"""Prompts with verifiable answers: GSM8K-format JSONL, or a built-in synthetic set (and, in their
own modules, a data file read by Hugging Face `datasets`, and reasoning-gym's procedural tasks).

A file's prompt set is split once into train and held-out eval by a hash of each item's id (not by
the experiment seed, so every experiment on a set evaluates on the same items); reasoning-gym draws
both from the experiment seed, disjoint. Training draws only from train. The prompts of step k are
a pure function of (experiment seed, step).
"""

import json
import random
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import Field

from dagster_rl.base.bounds import MAX_HELDOUT_PROMPTS
from dagster_rl.base.errors import DagsterRLError
from dagster_rl.base.hashing import canonical_json, seed_of, sha256_hex
from dagster_rl.base.strict import Strict
from dagster_rl.core.records import Record
from dagster_rl.tasks.lm.data.word_problems import resolve_dataset

if TYPE_CHECKING:  # transformers is imported where a tokenizer is built, not where prompts are read
    from transformers import PreTrainedTokenizerBase

# a number: thousands separated by commas in groups of three, or plain digits; a decimal part; a
# minus sign only where it cannot be a hyphen or an operator between two numbers ("5-3" is 5 and 3)
NUMBER = re.compile(r"(?<![\w.-])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|(?<=[\w.-])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
GSM8K_MARK = "####"
# GSM8K's final-answer mark: `#### <number>` (a currency sign may precede the number, a unit follow it)
GSM8K_ANSWER = re.compile(r"####[ \t]*\$?[ \t]*(-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)")
SYNTHETIC_OPS = ("copy", "add", "last")


class PromptItem(Record):
    id: str
    question: str
    reference: str  # the verified answer, normalized by `normalize_number`
    solution: str = ""  # a demonstration: the worked answer (GSM8K's `answer`), what a warm-up trains on
    # the row's other fields, passed to reward functions by name (a data file's mapped columns, reasoning-gym's
    # metadata); in no dump when empty, so the items of the sources that have none hash as they always did
    columns: dict[str, Any] = Field(default_factory=dict, exclude_if=lambda columns: not columns)


class PromptSet(Record):
    train: list[PromptItem]
    eval: list[PromptItem]
    template: str


N_EVAL = "held-out prompts: never trained on, each step's evaluation measures greedy accuracy on them"
TEMPLATE = "how a question becomes a prompt ({question}); unused when the tokenizer has a chat template"


class SyntheticPrompts(Strict):
    """Tiny tasks with a one-digit answer that a tiny model learns on the CPU.

    copy: "copy 7 :" -> 7; add: "3 + 4 =" -> 7 (sums below 10); last: "last 3 8 5 :" -> 5.
    """

    kind: Literal["synthetic"] = Field("synthetic", description="prompts generated in code")
    ops: tuple[Literal["copy", "add", "last"], ...] = Field(("copy",), description="which tasks the prompts mix")
    n_eval: int = Field(2, ge=0, le=MAX_HELDOUT_PROMPTS, description=N_EVAL)
    template: str = Field("{question}", description=TEMPLATE)

    def items(self) -> list["PromptItem"]:
        return synthetic_items(self.ops)

    def split(self, seed: int) -> tuple[list["PromptItem"], list["PromptItem"]]:
        return split_heldout(self.items(), self.n_eval)


class GSM8KPrompts(Strict):
    """A JSONL file of {"question": ..., "answer": "... #### <number>"} lines; `builtin:word-problems`
    names the word problems written in code (`tasks.lm.data.word_problems`)."""

    kind: Literal["gsm8k"] = Field("gsm8k", description="a GSM8K-format JSONL file")
    path: str = Field(description="the JSONL file, or builtin:word-problems (generated in code)")
    n_eval: int = Field(100, ge=0, le=MAX_HELDOUT_PROMPTS, description=N_EVAL)
    template: str = Field("Question: {question}\nAnswer:", description=TEMPLATE)

    def items(self) -> list["PromptItem"]:
        return load_gsm8k_jsonl(resolve_dataset(self.path))

    def split(self, seed: int) -> tuple[list["PromptItem"], list["PromptItem"]]:
        return split_heldout(self.items(), self.n_eval)


class Source(Protocol):
    """What every kind of prompt source provides (`data.sources.PromptSource` lists the kinds)."""

    @property
    def n_eval(self) -> int: ...

    @property
    def template(self) -> str: ...

    def split(self, seed: int) -> tuple[list["PromptItem"], list["PromptItem"]]:
        """(train, held-out): disjoint; `seed`, the experiment's, for a source that draws its items."""
        ...


class PromptError(DagsterRLError):
    """A prompt file or prompt setting is invalid."""


def normalize_number(text: str) -> str:
    """'1,234' -> '1234', '5.50' -> '5.5', '7.0' -> '7', '7.' -> '7'."""
    s = text.replace(",", "").strip().rstrip(".")
    if "." in s:
        s = s.rstrip("0").rstrip(".")
    return "0" if s in ("-0", "") else s


def extract_answer(completion: str) -> str | None:
    """The number after the completion's last `#### <number>` mark; without one, its last number
    (commas stripped, see `normalize_number`); None when there is no number at all."""
    marked = GSM8K_ANSWER.findall(completion)
    if marked:
        return normalize_number(marked[-1])
    found = NUMBER.findall(completion)
    return normalize_number(found[-1]) if found else None


def has_answer_mark(completion: str) -> bool:
    """Whether the completion gives its final answer GSM8K's way, `#### <number>`."""
    return GSM8K_ANSWER.search(completion) is not None


def extract_reference(answer: str) -> str:
    """The number after the last '####' of a GSM8K reference answer."""
    if GSM8K_MARK not in answer:
        raise PromptError(f"reference answer has no '{GSM8K_MARK} <number>' line: {answer[-80:]!r}")
    tail = answer.rsplit(GSM8K_MARK, 1)[1]
    found = NUMBER.findall(tail)
    if not found:
        raise PromptError(f"no number after '{GSM8K_MARK}' in reference answer: {tail.strip()[:80]!r}")
    return normalize_number(found[0])


def load_gsm8k_jsonl(path: Path | str) -> list[PromptItem]:
    """Items keyed by a hash of their question, so reordering the file changes no id."""
    path = Path(path)
    items: list[PromptItem] = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            question, answer = row["question"], row["answer"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise PromptError(
                f"{path}:{n}: expected a JSON object with 'question' and 'answer' fields ({type(e).__name__}: {e})"
            ) from None
        try:
            reference = extract_reference(answer)
        except PromptError as e:
            raise PromptError(f"{path}:{n}: {e}") from None
        items.append(
            PromptItem(id=f"gsm8k-{sha256_hex(question.encode())[:16]}", question=question, reference=reference, solution=answer)
        )
    if not items:
        raise PromptError(f"{path}: no prompts in the file")
    return items


def synthetic_items(ops: Sequence[str] = SYNTHETIC_OPS) -> list[PromptItem]:
    """Every item of the named synthetic tasks, in a fixed order."""
    items: list[PromptItem] = []
    for op in ops:
        if op == "copy":
            items += [PromptItem(id=f"copy-{a}", question=f"copy {a} :", reference=str(a), solution=str(a)) for a in range(10)]
        elif op == "add":
            items += [
                PromptItem(id=f"add-{a}-{b}", question=f"{a} + {b} =", reference=str(a + b), solution=str(a + b))
                for a in range(10)
                for b in range(10 - a)
            ]
        elif op == "last":
            items += [
                PromptItem(id=f"last-{a}{b}{c}", question=f"last {a} {b} {c} :", reference=str(c), solution=str(c))
                for a in range(10)
                for b in range(10)
                for c in range(10)
            ]
        else:
            raise PromptError(f"unknown synthetic op {op!r}; choose from {', '.join(SYNTHETIC_OPS)}")
    return items


def split_heldout(items: Sequence[PromptItem], n_eval: int) -> tuple[list[PromptItem], list[PromptItem]]:
    """(train, eval): eval is the n_eval items of lowest hash(id); both keep the input order."""
    if n_eval >= len(items):
        raise PromptError(f"n_eval={n_eval} leaves no training prompts out of {len(items)}; lower n_eval")
    held = {it.id for it in sorted(items, key=lambda it: sha256_hex(f"heldout:{it.id}".encode()))[:n_eval]}
    return [it for it in items if it.id not in held], [it for it in items if it.id in held]


def load_prompt_set(source: Source, seed: int = 0) -> PromptSet:
    """The source's prompts, split; `seed` (the experiment's) is read by a source that draws its items."""
    train, held = source.split(seed)
    return PromptSet(train=train, eval=held, template=source.template)


_BY_ID: dict[tuple, dict[str, PromptItem]] = {}
_BY_ID_LOCK = threading.Lock()


def items_by_id(source: Source, seed: int) -> dict[str, PromptItem]:
    """Every item of the source's prompt set by id (a judge looks a rollout's question up), read once
    per process for each source, seed and file (its settings, which name it, and where it is)."""
    key = (canonical_json(source), str(getattr(source, "location", "")), seed)
    with _BY_ID_LOCK:
        found = _BY_ID.get(key)
        if found is None:
            ps = load_prompt_set(source, seed)
            found = _BY_ID[key] = {it.id: it for it in [*ps.train, *ps.eval]}
            while len(_BY_ID) > 16:
                _BY_ID.pop(next(iter(_BY_ID)))
        return found


def prompts_for_step(train: Sequence[PromptItem], seed: int, step: int, n: int) -> list[PromptItem]:
    """The n training prompts of a step: distinct items drawn from (seed, step) alone."""
    if n > len(train):
        raise PromptError(f"{n} prompts per step asked of a training split of {len(train)}; lower prompts_per_step")
    return random.Random(seed_of(seed, "prompts", step)).sample(list(train), n)


def render(item: PromptItem, template: str) -> str:
    return template.format(question=item.question)


def encode_prompt(tokenizer, item: PromptItem, template: str) -> list[int]:
    """The prompt's token ids: the question as the user's turn of the tokenizer's chat template,
    ready for the assistant's answer, when the tokenizer has a chat template; else `template`."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": item.question}], add_generation_prompt=True, tokenize=False
        )
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(render(item, template))["input_ids"])


def decode_completion(tokenizer: "PreTrainedTokenizerBase", token_ids: list[int]) -> str:
    """A completion's text: its tokens decoded, special tokens (the eos) left out."""
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    assert isinstance(text, str)  # one sequence decodes to one string (a batch of them to a list)
    return text
