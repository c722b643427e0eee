"""The experiment-file reference (`docs/experiment-file.md`), written from the pydantic models.

Every field of every experiment class a registered task has, and of the settings they hold: name,
type, default, bounds and description, read from the models themselves, so the reference cannot
drift from what a file is validated against. `make docs` writes it; `tests/test_docs.py` fails
when the checked-in file differs from what this writes now.

    python -m dagster_rl.core.experiment_reference docs/experiment-file.md
"""

import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from dagster_rl.core.experiment import Experiment
from dagster_rl.core.task import BUILTIN_TASKS, task_of

INTRO = """\
# The experiment file

<!-- Written by `make docs` (dagster_rl/core/experiment_reference.py) from the pydantic models; do not
edit by hand: tests/test_docs.py fails when this file differs from what the models say. -->

An experiment is one YAML file in `experiments/` (`*.yaml` or `*.yml`). Its `task.kind` chooses the
experiment class that validates it; its `name` names the asset group `<name>` and the job
`<name>_train`. A file is validated when the code location loads:

- an unknown field is an error, naming it, and so is a key given twice (naming both lines);
- a name is declared by one file: two files that declare one name are both refused, naming both;
- a file is a regular file (not a FIFO, device or socket) of at most 1 MiB;
- numbers are finite and are numbers: `n_steps: "4"` is refused, not coerced; `1e-4` is a number
  (YAML 1.2), as is `5e3`;
- every number has an upper bound (below; `dagster_rl/base/bounds.py` derives each), and products are
  bounded too (`prompts_per_step x n_samples` trials, trials x `sampling.max_new_tokens` tokens,
  `nproc_per_node x threads_per_process` threads, LoRA `alpha / rank`);
- an invalid file leaves the others usable: the UI shows its error as a problem of the code
  location `invalid_experiment_files`, and `dagster-rl` prints it.

To check a file without training, ask for its status (it loads every experiment file, and names
each invalid one with the field, the bound and the value):

<!-- doc-test: expect="experiment demo: " -->
```bash runnable
export DAGSTER_HOME="$PWD/.dagster_home"
.venv/bin/dagster-rl status demo
```

## Forks: `fork_of`

A fork names its parent and only what it changes:

```yaml
name: demo_fast
fork_of: demo
grpo: {learning_rate: 4.0}
```

It starts from the parent's settings (merged section by section: `grpo: {learning_rate: 4.0}` keeps
the parent's other `grpo` fields) and is its own asset group, `demo_fast`, with its own job. Forks
can fork forks; a missing parent or a cycle is an error naming the file. `description` and
`fork_of` are not inherited.

A fork **shares its parent's artifact cache**. Artifacts are stored under keys that hash the
settings that affect them, and trained weights also record their *cache family*, the root of the
chain of forks, which is part of their key. So a fork and its parent (and their other forks) reuse
each other's steps wherever they compute alike: a fork that changes only `n_steps`, `faults` or
`checks` finds every step its parent trained as a cache hit, and a fork that changes the learning
rate computes its own weights from step 0. A range of a fork may start from weights its parent
trained. An experiment that merely has the same settings under another name, without `fork_of`, is
its own family and trains its own weights. Settings in no key: `name`, `description`, `fork_of`,
`plugins`, `n_steps`, `faults`, `checks`, `driver_pod`, and for language models `generation_threads`,
`trainer` (but its world size), `rollout` (but its engine, which is in the rollouts' key) and a
reward function's `timeout_s`; a reward function's file is in the keys of what it scores by its
bytes, not its path.
"""


def _md(text: str) -> str:
    """Text for a table cell: pipes escaped, newlines folded."""
    return " ".join(text.split()).replace("|", "\\|")


def _anchor(model: type[BaseModel]) -> str:
    return model.__name__.lower()


def _submodels(annotation: Any) -> list[type[BaseModel]]:
    """The settings models a field's type holds (directly, in a union, a tuple or a list)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _submodels(arg)]


def type_name(annotation: Any) -> str:
    """A field's type as the reference prints it."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"[{annotation.__name__}](#{_anchor(annotation)})"
    if isinstance(annotation, type):
        return annotation.__name__
    if origin is Literal:
        return " | ".join(f'"{a}"' if isinstance(a, str) else repr(a) for a in args)
    if origin is typing.Annotated:
        inner = type_name(args[0])
        bounds = _bounds(annotation.__metadata__)
        return f"{inner} ({bounds})" if bounds else inner
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list of {type_name(args[0])}"
        return "[" + ", ".join(type_name(a) for a in args) + "]"
    if origin in (list,):
        return f"list of {type_name(args[0])}"
    if origin is dict:
        return f"map of {type_name(args[0])} to {type_name(args[1])}"
    return str(annotation)


def _bounds(metadata: list[Any]) -> str:
    parts = []
    for m in metadata:
        if isinstance(m, FieldInfo):  # Annotated[float, Field(ge=...)]: the bounds are its metadata
            parts.append(_bounds(m.metadata))
            continue
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            value = getattr(m, attr, None)
            if isinstance(m, getattr(annotated_types, attr.capitalize())) and value is not None:
                parts.append(f"{sign} {_number(value)}")
        if isinstance(m, annotated_types.MaxLen):
            parts.append(f"at most {_number(m.max_length)} entries")
        pattern = getattr(m, "pattern", None)
        if pattern:
            parts.append(f"matches `{pattern}`")
    return ", ".join(p for p in parts if p)


def _number(value: Any) -> str:
    if isinstance(value, int) and abs(value) >= 10_000:
        return f"{value:,}"
    return repr(value) if isinstance(value, float) else str(value)


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        several = len(_submodels(field.annotation)) > 1
        return f"{type(value).__name__} with its defaults" if several else "its defaults"
    if value is None:
        return "null"
    if isinstance(value, str):
        return f"`{value!r}`" if value else '`""`'
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)):
        return "`[" + ", ".join(str(v) for v in value) + "]`" if value else "`[]`"
    if isinstance(value, dict):
        return "`{}`" if not value else f"`{value}`"
    return f"`{_number(value)}`"


def _parent(model: type[BaseModel]) -> type[BaseModel] | None:
    """The settings model this one extends (one with fields of its own), if any."""
    return next((b for b in model.__mro__[1:] if isinstance(b, type) and issubclass(b, BaseModel) and b.model_fields), None)


def _own_fields(model: type[BaseModel]) -> dict[str, FieldInfo]:
    """The fields a model adds to, or changes from, the settings model it extends."""
    parent = _parent(model)
    if parent is None:
        return dict(model.model_fields)
    return {
        name: f
        for name, f in model.model_fields.items()
        if name not in parent.model_fields or parent.model_fields[name].annotation is not f.annotation
    }


def _table(model: type[BaseModel]) -> list[str]:
    rows = ["| field | type | default | bounds | description |", "| --- | --- | --- | --- | --- |"]
    for name, field in _own_fields(model).items():
        if not field.description:
            raise ValueError(f"{model.__module__}.{model.__name__}.{name} has no description: add one (Field(description=...))")
        rows.append(
            f"| `{name}` | {_md(type_name(field.annotation))} | {_md(_default(field))} | {_md(_bounds(field.metadata))} "
            f"| {_md(field.description)} |"
        )
    return rows


def _doc(model: type[BaseModel]) -> str:
    own = model.__dict__.get("__doc__")
    return " ".join(own.split()) if own else ""


def reference() -> str:
    """The whole reference, as `docs/experiment-file.md` holds it."""
    out = [INTRO]
    done: set[type[BaseModel]] = {Experiment}

    def section(model: type[BaseModel], level: str) -> None:
        out.append(f"{level} {model.__name__}\n")
        parent = _parent(model)
        note = f"The fields below, and every field of [{parent.__name__}](#{_anchor(parent)})." if parent else ""
        text = " ".join(t for t in (_doc(model), note) if t)
        if text:
            out.append(text + "\n")
        out.extend(_table(model))
        out.append("")

    def nested(model: type[BaseModel]) -> None:
        queue = [m for f in _own_fields(model).values() for m in _submodels(f.annotation)]
        while queue:
            sub = queue.pop(0)
            if sub in done:
                continue
            done.add(sub)
            section(sub, "###")
            queue.extend(m for f in _own_fields(sub).values() for m in _submodels(f.annotation))
            parent = _parent(sub)  # a section that extends another: that one's fields are documented too
            if parent is not None and not issubclass(parent, Experiment):
                queue.append(parent)

    out.append("## Every experiment\n")
    section(Experiment, "###")
    nested(Experiment)
    for kind in sorted(BUILTIN_TASKS):  # the shipped tasks (a task registered at run time is not documented here)
        exp = task_of(kind).experiment
        out.append(f"## Task `{kind}`\n")
        done.add(exp)
        section(exp, "###")
        nested(exp)
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        sys.exit("usage: python -m dagster_rl.core.experiment_reference docs/experiment-file.md")
    Path(argv[0]).write_text(reference())


if __name__ == "__main__":
    main(sys.argv[1:])
