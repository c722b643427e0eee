"""Experiment files: one YAML file each, validated by the experiment class of its task kind.

A fork (`fork_of: parent`) starts from its parent's settings and overrides what it names; it is its
own asset group but shares the artifact cache, since artifacts are keyed by content, not by name.
"""

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from dagster_rl.errors import ExperimentError
from dagster_rl.experiment import Experiment
from dagster_rl.task import task_of


def _kind_of(raw: Any) -> Any:
    task = raw.get("task") if isinstance(raw, dict) else None
    return task.get("kind") if isinstance(task, dict) else None


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in override.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ExperimentError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise ExperimentError(f"{path}: expected a mapping of experiment settings, got {type(raw).__name__}")
    return raw


def parse_experiment(raw: dict[str, Any]) -> Experiment:
    """Validate settings against the experiment class of their `task.kind`."""
    return task_of(_kind_of(raw)).experiment.model_validate(raw)


def _validate(path: Path, raw: dict[str, Any]) -> Experiment:
    try:
        return parse_experiment(raw)
    except ValidationError as e:
        problems = "; ".join(
            f"field '{'.'.join(str(p) for p in err['loc']) or '<root>'}': {err['msg']}" for err in e.errors()
        )
        raise ExperimentError(f"{path}: invalid experiment: {problems}") from None
    except ValueError as e:
        raise ExperimentError(f"{path}: invalid experiment: field 'task.kind': {e}") from None


def load_experiment(path: Path) -> Experiment:
    """Load one experiment file that is not a fork."""
    return _validate(path, _read_yaml(path))


def load_experiments(directory: Path) -> dict[str, Experiment]:
    """Every `*.yaml` in `directory`, forks resolved against their parents, keyed by name."""
    raws = {p: _read_yaml(p) for p in sorted(directory.glob("*.yaml"))}
    by_name: dict[str, tuple[Path, dict[str, Any]]] = {}
    for path, raw in raws.items():
        name = raw.get("name")
        if name in by_name:
            raise ExperimentError(f"{path}: experiment name '{name}' is already used by {by_name[name][0]}")
        by_name[str(name)] = (path, raw)

    def resolved(name: str, seen: tuple[str, ...]) -> dict[str, Any]:
        path, raw = by_name[name]
        parent = raw.get("fork_of")
        if parent is None:
            return raw
        if parent not in by_name:
            raise ExperimentError(f"{path}: field 'fork_of': no experiment named '{parent}' in {directory}")
        if parent in seen:
            raise ExperimentError(f"{path}: field 'fork_of': forks form a cycle {' -> '.join(seen + (parent,))}")
        inherited = {k: v for k, v in resolved(parent, seen + (parent,)).items() if k not in ("description", "fork_of")}
        return _merge(inherited, raw)

    return {name: _validate(path, resolved(name, (name,))) for name, (path, _) in by_name.items()}
