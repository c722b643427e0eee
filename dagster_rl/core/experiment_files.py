"""Experiment files: one YAML file each (`*.yaml` or `*.yml`), validated by the experiment class of
its task kind.

Numbers are read as YAML 1.2 reads them: `1e-4` and `5e3` are numbers (PyYAML's YAML 1.1 reads them
as text), and text is never coerced into a number (`n_steps: "4"` is refused, naming the field).

A fork (`fork_of: parent`) starts from its parent's settings and overrides what it names; it is its
own asset group but shares the artifact cache, since artifacts are keyed by content, not by name.

An experiment's `plugins` (files of its folder, or modules: `dagster_rl.base.plugins`) are imported
before the rest of it is validated, so the task kind or text environment a plugin registers is known
in every process that reads the file (the CLI, the code location, a run's step process). A folder's
files have all their plugins imported before any file is validated: whether a file is valid never
depends on the order the files are read in.

`read_experiments` reads a folder file by file: an invalid file is reported (with its path, the
field and the reason) and the others stay usable; `load_experiments` refuses the folder instead.
"""

import errno
import os
import re
import stat
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from dagster_rl.base.errors import ExperimentError
from dagster_rl.base.plugins import PluginError, import_plugins
from dagster_rl.core.experiment import EXPERIMENTS_FOLDER, Experiment
from dagster_rl.core.task import task_of

SUFFIXES = (".yaml", ".yml")
MAX_FILE_BYTES = 1 << 20  # an experiment file is a page of settings; the largest shipped one is under 2 KiB


class _DuplicateKey(ValueError):
    """A mapping gives one key twice (YAML says keys are unique; PyYAML keeps the last)."""


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, with YAML 1.2's floats (an exponent needs no decimal point: `1e-4`) and
    unique keys: a key given twice in one mapping is refused, not silently the last one."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults`: merged keys may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise _DuplicateKey(f"the key {key!r} is given twice in one mapping (lines {seen[key]} and {line}); keep one")
            seen[key] = line
        return super().construct_mapping(node, deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _files(directory: Path) -> list[Path]:
    """The experiment files of a folder: `*.yaml` and `*.yml`, hidden ones aside; an `ExperimentError`
    naming the folder when it is not one."""
    if not directory.is_dir():
        what = "does not exist" if not directory.exists() else "is not a folder"
        raise ExperimentError(f"{directory}: the experiments folder {what}; experiments are read from a folder of YAML files")
    return sorted(p for p in directory.iterdir() if p.suffix in SUFFIXES and not p.name.startswith("."))


def _kind_of(raw: Any) -> Any:
    task = raw.get("task") if isinstance(raw, dict) else None
    return task.get("kind") if isinstance(task, dict) else None


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in override.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def read_bounded(path: Path, limit: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of a regular file of at most `limit` bytes. Opened without blocking (a FIFO with no
    writer would hang the open, a device read forever) and checked with fstat before any read:
    anything but a regular file, or a larger one, is an `ExperimentError` naming the path."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as e:
        raise ExperimentError(f"{path}: cannot be read: {e.strerror or e}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ExperimentError(
                f"{path}: not a regular file (it is a {_file_type(info.st_mode)}); an experiment file is a plain YAML file"
            )
        if info.st_size > limit:
            raise ExperimentError(f"{path}: {info.st_size} bytes, more than the {limit} an experiment file may hold")
        data = bytearray()
        while len(data) <= limit:
            try:
                chunk = os.read(fd, limit + 1 - len(data))
            except OSError as e:  # EAGAIN cannot happen on a regular file; anything else: unreadable
                name = errno.errorcode.get(e.errno, e.strerror) if e.errno is not None else e.strerror
                raise ExperimentError(f"{path}: cannot be read: {name}") from None
            if not chunk:
                break
            data += chunk
        if len(data) > limit:  # it grew since fstat
            raise ExperimentError(f"{path}: more than the {limit} bytes an experiment file may hold")
        return bytes(data)
    finally:
        os.close(fd)


def _file_type(mode: int) -> str:
    kinds = (
        (stat.S_ISDIR, "folder"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISSOCK, "socket"),
    )
    return next((name for test, name in kinds if test(mode)), "special file")


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = read_bounded(path).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ExperimentError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); save the file as UTF-8") from None
    try:
        raw = yaml.load(text, Loader=_Loader)  # a SafeLoader
    except _DuplicateKey as e:
        raise ExperimentError(f"{path}: {e}") from None
    except yaml.YAMLError as e:
        raise ExperimentError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise ExperimentError(f"{path}: expected a mapping of experiment settings, got {type(raw).__name__}")
    return raw


def parse_experiment(raw: dict[str, Any], folder: Path | None = None) -> Experiment:
    """Import the settings' `plugins` (a file among them is read from `folder`, the experiments
    folder), then validate the settings against the experiment class of their `task.kind`: a task
    kind or text environment that a plugin registers is known by then; a setting that names a file
    beside it (`file.py:function`, a data file) finds it in `folder` (the experiment's `folder`)."""
    import_plugins(raw.get("plugins"), folder)
    exp = task_of(_kind_of(raw)).experiment.model_validate(raw, context={EXPERIMENTS_FOLDER: folder})
    exp._folder = folder
    return exp


def _validate(path: Path, raw: dict[str, Any]) -> Experiment:
    try:
        return parse_experiment(raw, path.parent)
    except PluginError as e:
        raise ExperimentError(_plugin_error(path, e)) from None
    except ValidationError as e:
        problems = "; ".join(f"field '{_field(err['loc'], raw) or '<root>'}': {err['msg']}{_got(err)}" for err in e.errors())
        raise ExperimentError(f"{path}: invalid experiment: {problems}") from None
    except ValueError as e:
        raise ExperimentError(f"{path}: invalid experiment: field 'task.kind': {e}") from None


def _plugin_error(path: Path, error: PluginError) -> str:
    return f"{path}: invalid experiment: field 'plugins': {error}"


BOUNDS = ("less_than_equal", "less_than", "greater_than_equal", "greater_than")


def _field(loc: tuple, raw: Any) -> str:
    """An error's place as the file names it: `rubric.accuracy`, without the tag pydantic adds for the
    member of a union it validated (`rubric.builtin.accuracy`): a step that is the mapping's `kind` there,
    or no key of it with a step after it, is a tag."""
    names, node, tagged = [], raw, False
    for i, step in enumerate(loc):
        mapping = isinstance(node, dict) and isinstance(step, str)
        tag = mapping and (node.get("kind") == step or (step not in node and i < len(loc) - 1))
        if tag and not tagged:
            tagged = True  # one tag at most per mapping: the next step is its field (which may be named as the tag)
            continue
        names.append(str(step))
        tagged = False
        if isinstance(node, dict):
            node = node.get(step)
        elif isinstance(node, list) and isinstance(step, int) and 0 <= step < len(node):
            node = node[step]
        else:
            node = None
    return ".".join(names)


def _got(err: Any) -> str:
    """`(got 1e+308)` after a bound's message: the value the file holds."""
    return f" (got {err['input']!r})" if err["type"] in BOUNDS else ""


def load_experiment(path: Path) -> Experiment:
    """Load one experiment file that is not a fork."""
    return _validate(path, _read_yaml(path))


@dataclass(frozen=True)
class ExperimentFiles:
    experiments: dict[str, Experiment]  # by name: the valid ones
    errors: dict[str, str]  # file path -> what is wrong with it (the message names the file)


def read_experiments(directory: Path) -> ExperimentFiles:
    """Every `*.yaml` and `*.yml` in `directory`, forks resolved against their parents; an invalid
    file (or a fork of one) is reported in `errors` and leaves the others usable."""
    errors: dict[str, str] = {}
    try:
        paths = _files(directory)
    except ExperimentError as e:
        return ExperimentFiles({}, {str(directory): str(e)})
    declared: dict[str, list[tuple[Path, dict[str, Any]]]] = defaultdict(list)
    for path in paths:
        try:
            raw = _read_yaml(path)
            name = raw.get("name")
            if not isinstance(name, str):
                raise ExperimentError(
                    f"{path}: invalid experiment: field 'name': a name (letters, digits, underscores) is required"
                )
        except ExperimentError as e:
            errors[str(path)] = str(e)
            continue
        declared[name].append((path, raw))
    by_name: dict[str, tuple[Path, dict[str, Any]]] = {}
    for name, files in declared.items():
        if len(files) == 1:
            by_name[name] = files[0]
            continue
        named = " and ".join(str(p) for p, _ in files)
        for path, _ in files:  # neither wins: which one a command would train must not depend on file names' order
            errors[str(path)] = (
                f"{path}: experiment name '{name}' is declared by {len(files)} files, {named}; a name is declared by one "
                "file only: give the other a name of its own (its `name:` field), or remove it"
            )

    def resolved(name: str, seen: tuple[str, ...]) -> dict[str, Any]:
        path, raw = by_name[name]
        parent = raw.get("fork_of")
        if parent is None:
            return raw
        if parent not in by_name:
            raise ExperimentError(
                f"{path}: field 'fork_of': no experiment named '{parent}' in {directory} (or its file is invalid)"
            )
        if parent in seen:
            raise ExperimentError(f"{path}: field 'fork_of': forks form a cycle {' -> '.join(seen + (parent,))}")
        inherited = {k: v for k, v in resolved(parent, seen + (parent,)).items() if k not in ("description", "fork_of")}
        return _merge(inherited, raw)

    def root(name: str) -> str:
        parent = by_name[name][1].get("fork_of")
        return name if parent is None else root(parent)  # resolved() refused missing parents and cycles

    raws = {}
    for name, (path, _) in by_name.items():
        try:
            raws[name] = resolved(name, (name,))
        except ExperimentError as e:
            errors[str(path)] = str(e)
    # every file's plugins before any file is validated: what one registers is known to all of them, whatever their order
    for name, raw in raws.items():
        path = by_name[name][0]
        try:
            import_plugins(raw.get("plugins"), directory)
        except PluginError as e:
            errors[str(path)] = _plugin_error(path, e)
    experiments = {}
    for name, raw in raws.items():
        path = by_name[name][0]
        if str(path) in errors:
            continue
        try:
            experiments[name] = _validate(path, raw)
        except ExperimentError as e:
            errors[str(path)] = str(e)
            continue
        experiments[name]._fork_root = root(name)  # its cache family (Experiment.family)
    return ExperimentFiles(experiments, errors)


def load_experiments(directory: Path) -> dict[str, Experiment]:
    """Every `*.yaml` and `*.yml` in `directory`, forks resolved against their parents, keyed by name; an
    `ExperimentError` naming every invalid file when there is one."""
    files = read_experiments(directory)
    if files.errors:
        raise ExperimentError("\n".join(files.errors.values()))
    return files.experiments
