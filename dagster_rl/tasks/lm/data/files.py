"""A local data file of prompts and answers (JSONL, Parquet or CSV), read by Hugging Face `datasets`
with a column mapping: `task.source: {kind: datasets, path: ..., columns: {prompt: ..., answer: ...}}`.

`columns` maps a name on our side to a column of the file: `prompt` (the question, the user's turn)
and `answer` (the reference answer) are required (each defaults to the column of its own name);
`solution` (a worked answer, for the warm-up's demonstrations) is optional (default: the answer);
every other name is a column passed to reward functions under that name (TRL's `**columns`), the
answer too. A file that lacks a mapped column is refused, naming the file, the column and the
columns it has.

The path: absolute, as the GSM8K source takes it, or relative to the experiments folder, and then
inside it (no `..` out of it, no link out of it). Items are keyed by a hash of their prompt, and
split into train and held-out by a hash of that id, as the GSM8K source's are.
"""

import json
import math
import re
import tempfile
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from dagster_rl.base.bounds import MAX_HELDOUT_PROMPTS
from dagster_rl.base.hashing import sha256_hex
from dagster_rl.base.strict import Strict
from dagster_rl.core.experiment import EXPERIMENTS_FOLDER
from dagster_rl.tasks.lm.data.prompts import N_EVAL, TEMPLATE, PromptError, PromptItem, split_heldout

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}  # suffix -> datasets' builder
REQUIRED = ("prompt", "answer")
NOT_A_COLUMN = ("prompts", "completions", "completion_ids")  # TRL's own arguments of a reward function
IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class DataFilePrompts(Strict):
    """Prompts and answers from a local JSONL, Parquet or CSV file, read by Hugging Face `datasets`."""

    kind: Literal["datasets"] = Field("datasets", description="a local JSONL, Parquet or CSV file (Hugging Face datasets)")
    path: str = Field(
        description="the file: relative to the experiments folder (and inside it), or absolute; its suffix says its "
        "format (.jsonl/.json, .parquet, .csv)"
    )
    columns: dict[str, str] = Field(
        default_factory=dict,
        description="name -> the file's column: `prompt` and `answer` (each default: the column of its own name), "
        "`solution` (worked answers for the warm-up; default: the answer), and any other name: a column passed to "
        "reward functions under that name",
    )
    n_eval: int = Field(100, ge=0, le=MAX_HELDOUT_PROMPTS, description=N_EVAL)
    template: str = Field("{question}", description=TEMPLATE)
    _location: Path | None = PrivateAttr(None)  # the file, resolved against the experiments folder

    @field_validator("columns")
    @classmethod
    def _names(cls, columns: dict[str, str]) -> dict[str, str]:
        for name in columns:
            if not IDENTIFIER.match(name) or name in NOT_A_COLUMN:
                raise ValueError(
                    f"columns: {name!r} cannot name a column: a name is an identifier, and not one of {', '.join(NOT_A_COLUMN)} "
                    "(a reward function's own arguments)"
                )
        return columns

    @model_validator(mode="after")
    def _resolve(self, info: ValidationInfo) -> "DataFilePrompts":
        if Path(self.path).suffix.lower() not in FORMATS:
            raise ValueError(f"path {self.path!r}: the suffix says the format: one of {', '.join(FORMATS)}")
        folder = (info.context or {}).get(EXPERIMENTS_FOLDER)
        self._location = resolve_data_path(self.path, Path(folder) if folder is not None else None)
        return self

    @property
    def mapping(self) -> dict[str, str]:
        """name -> column, the required names filled in."""
        return {**{name: name for name in REQUIRED}, **self.columns}

    @property
    def location(self) -> Path:
        """The file this source reads."""
        return self._location if self._location is not None else Path(self.path)

    def items(self) -> list[PromptItem]:
        return load_data_file(self.location, self.mapping)

    def split(self, seed: int) -> tuple[list[PromptItem], list[PromptItem]]:
        return split_heldout(self.items(), self.n_eval)


def resolve_data_path(path: str, folder: Path | None) -> Path:
    """An absolute path as given; a relative one in `folder` (the experiments folder), never out of it."""
    given = Path(path)
    if given.is_absolute():
        return given
    if folder is None:
        raise ValueError(
            f"path {path!r} is relative to the experiments folder, and this experiment was not read from one: give an "
            "absolute path"
        )
    if ".." in given.parts:
        raise ValueError(f"path {path!r} leads out of the experiments folder: name a file inside it, or an absolute path")
    target = folder / given
    if target.exists() and not target.resolve().is_relative_to(folder.resolve()):
        raise ValueError(f"path {path!r} is a link to {target.resolve()}, outside the experiments folder {folder}")
    return target


def load_data_file(path: Path, mapping: dict[str, str]) -> list[PromptItem]:
    """The file's rows as prompt items: its columns checked against `mapping` before any row is read."""
    import datasets

    if not path.is_file():
        raise PromptError(f"{path}: no such file (task.source.path)")
    datasets.disable_progress_bars()
    try:
        with tempfile.TemporaryDirectory(prefix="dagster-rl-datasets-") as cache:  # nothing kept between reads
            table = datasets.load_dataset(
                FORMATS[path.suffix.lower()], data_files=str(path), split="train", cache_dir=cache, keep_in_memory=True
            )
    except Exception as e:  # a file datasets cannot parse: its own error, with the file
        raise PromptError(f"{path}: cannot be read as {FORMATS[path.suffix.lower()]}: {type(e).__name__}: {e}") from None
    has = list(table.column_names)
    for name, column in mapping.items():
        if column not in has:
            raise PromptError(
                f"{path}: no column {column!r} (task.source.columns.{name}); the file's columns are {', '.join(has)}"
            )
    items = []
    for n, row in enumerate(table, start=1):
        prompt, answer = row[mapping["prompt"]], row[mapping["answer"]]
        if not isinstance(prompt, str) or not prompt.strip():
            raise PromptError(f"{path}: row {n}: column {mapping['prompt']!r} (the prompt) holds {prompt!r}, not text")
        if answer is None or (isinstance(answer, float) and not math.isfinite(answer)):
            raise PromptError(f"{path}: row {n}: column {mapping['answer']!r} (the answer) is empty")
        reference = _text(answer)
        solution = row[mapping["solution"]] if "solution" in mapping else reference
        passed = {name: _plain(row[column]) for name, column in mapping.items() if name not in ("prompt", "solution")}
        items.append(
            PromptItem(
                id=f"data-{sha256_hex(prompt.encode())[:16]}",
                question=prompt,
                reference=reference,
                solution=_text(solution) if solution is not None else "",
                columns=passed,  # as the file holds them (the answer too)
            )
        )
    if not items:
        raise PromptError(f"{path}: no rows in the file")
    return items


def _text(value: Any) -> str:
    """An answer as text: a whole number without `.0`, others as JSON writes them."""
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return json.dumps(_plain(value))


def _plain(value: Any) -> Any:
    """A cell as JSON holds it (a key hashes it): no NaN (an empty CSV cell), dates as text."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, int, bool)):
        return value
    return str(value)
