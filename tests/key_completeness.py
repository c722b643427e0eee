"""Every key names every input: the machinery of `tests/test_cache_keys.py`.

A *plan* is what one computation starts from: an experiment's settings (raw, as a file holds them)
and the settings of its three environments. `run(plan)` computes everything the plan stores, on a
fresh artifact store of its own: the initial weights, the warm-up, two steps (rollouts, rewards,
weights), the held-out evaluations, the worlds, the LLM judge's journal, whatever the task's loop
stores. `changes(plan)` walks the experiment's pydantic model and the environments' resources and
yields one `Change` per setting: the plan with that one setting changed (a new field is found
without a line here). `findings(change)` runs both plans and says what is wrong:

- an artifact stored under one (kind, key) by both with other bytes: the key leaves the setting
  out (an *omission*), named with the artifact;
- a setting listed in `OUTSIDE_KEYS` that changes a key (the list says it must not);
- a setting not listed there that changes no key and no byte (neither in a key nor said to be out
  of every key, with why).
"""

import json
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from dagster_rl.base.differences import Difference, compare
from dagster_rl.base.hashing import canonical_json, content_hash
from dagster_rl.core.records import STATS
from dagster_rl.core.task import Backends, task_of

STEPS = [0, 1]  # two steps: the second samples from weights the first trained (and, at lag 1, from the initial ones)
ENVIRONMENTS = ("rollout", "judge", "trainer")
WARMUP_FILE = (
    "warmup.json"  # what marks a warm-up's weights (dagster_rl.tasks.lm.train.warmup.WARMUP; not imported: no torch here)
)
Raw = dict[str, Any]


@dataclass(frozen=True)
class Plan:
    experiment: Raw
    environments: Raw  # {"rollout": {...}, "judge": {...}, "trainer": {...}}: the resources' settings

    def key(self) -> str:
        return content_hash([self.experiment, self.environments])


@dataclass(frozen=True)
class Change:
    setting: str  # "task.n_worlds", "policy.device=cpu", "environments.judge.model"
    path: tuple[str, ...]  # where in the plan ("experiment", ...) or ("environments", "judge", ...)
    reference: Plan
    changed: Plan


@dataclass(frozen=True)
class Artifact:
    kind: str
    key: str
    what: str  # e.g. "weights of step 0001", "initial weights"
    files: dict  # file name -> bytes: what must be equal under one key

    def difference(self, other: "Artifact") -> Difference | None:
        return compare(self.files, other.files)


# ---- the settings, walked ----------------------------------------------------------------------


def _strip(annotation: Any) -> Any:
    while get_origin(annotation) is typing.Annotated:
        annotation = get_args(annotation)[0]
    return annotation


def _is_union(annotation: Any) -> bool:
    return get_origin(annotation) in (Union, types.UnionType)


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _fresh(annotation: Any) -> list[Any]:
    """Values of a type where the setting holds none (None, or an empty collection)."""
    a = _strip(annotation)
    if a is bool:
        return [True, False]
    if get_origin(a) is Literal:
        return list(get_args(a))
    if a is int:
        return [1, 2, 3]
    if a is float:
        return [0.5, 0.1, 1.0, 2.0]
    if a is str:
        return ["x", "1"]
    if _is_model(a):
        try:
            return [a().model_dump(mode="json")]
        except ValidationError:
            return []
    if get_origin(a) in (tuple, list):
        return [[v] for v in _fresh(get_args(a)[0])[:1]]
    if get_origin(a) is dict:
        return [{"x": "y"}]
    return []


def _candidates(annotation: Any, value: Any) -> list[Any]:
    """Other values of a setting of type `annotation` that holds `value`, most plausible first."""
    a = _strip(annotation)
    if value is None:
        return [c for arg in get_args(a) if arg is not type(None) for c in _fresh(arg)] if _is_union(a) else _fresh(a)
    if _is_union(a):
        return [None, *(c for arg in get_args(a) if arg is not type(None) for c in _candidates(arg, value))]
    if a is bool:
        return [not value]
    if get_origin(a) is Literal:
        return [v for v in get_args(a) if v != value]
    if a is int and isinstance(value, int):
        return [value + 1, value - 1, value * 2]
    if a is float and isinstance(value, (int, float)):
        return [value * 2, value / 2, value + 0.5, value - 0.5, 0.5, 0.1]
    if a is str and isinstance(value, str):
        return [value + "x", "x", "1"]
    if get_origin(a) in (tuple, list) and isinstance(value, (list, tuple)):
        shorter = [list(value[:-1])] if len(value) > 1 else []
        return shorter + [[*value, v] for v in _fresh(get_args(a)[0]) if v not in value]
    if get_origin(a) is dict and isinstance(value, dict):
        return [{**value, "x": "y"}]
    return []


def _fixed_tuple(annotation: Any) -> tuple | None:
    """The element types of a fixed-length tuple (`tuple[float, float]`), else None."""
    a = _strip(annotation)
    args = get_args(a)
    return args if get_origin(a) is tuple and args and args[-1] is not Ellipsis else None


def _models_of(annotation: Any) -> type[BaseModel] | None:
    """The section type of a list (or `tuple[X, ...]`) of sections (a rubric's reward functions), else None."""
    a = _strip(annotation)
    args = get_args(a)
    if get_origin(a) in (tuple, list) and args and (len(args) == 1 or args[-1] is Ellipsis) and _is_model(_strip(args[0])):
        return _strip(args[0])
    return None


def _set(raw: Raw, path: tuple[str, ...], value: Any) -> Raw:
    """A copy of `raw` with `path` set to `value`."""
    out = json.loads(json.dumps(raw))
    node = out
    for part in path[:-1]:
        node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
    if isinstance(node, list):
        node[int(path[-1])] = value
    else:
        node[path[-1]] = value
    return out


def _get(raw: Raw, path: tuple[str, ...]) -> Any:
    """The value at `path`; None where it or a section above it is not set."""
    node: Any = raw
    for part in path:
        if node is None:
            return None
        node = node[int(part)] if isinstance(node, list) else node.get(part)
    return node


class Walk:
    """The changes of one plan's settings. `valid(plan)` says whether a plan can run (its experiment
    and environments validate); `overrides`: setting -> values to try where no other value can be
    guessed from the type (another base model, another kind of prompt source); `skip`: settings
    whose change is not computed here, with why."""

    def __init__(self, valid: Callable[[Plan], bool], overrides: dict[str, list[Any]], skip: dict[str, str]):
        self.valid, self.overrides, self.skip = valid, overrides, skip
        self.unchangeable: list[str] = []  # settings no value could change (a test failure: add an override)

    def model(self, cls: type[BaseModel], plan: Plan, path: tuple[str, ...]) -> Iterator[Change]:
        """The changes of every field of `cls`, which `plan` holds at `path`."""
        section = _get(_raw(plan), path) or {}
        for name, info in cls.model_fields.items():
            here = (*path, name)
            value = section[name] if name in section else _default(info)  # not in the file: its default
            yield from self.field(info.annotation, plan, here, value)

    def field(self, annotation: Any, plan: Plan, path: tuple[str, ...], value: Any) -> Iterator[Change]:
        a = _strip(annotation)
        name = _name(path)
        if name in self.skip:
            return
        models = [m for m in (get_args(a) if _is_union(a) else (a,)) if _is_model(_strip(m))]
        if models:
            yield from self._section(a, [_strip(m) for m in models], plan, path, value)
            return
        element = _models_of(a)
        if element is not None and isinstance(value, (list, tuple)):  # a list of sections: the list, then each one's fields
            yield from self._first_valid(
                name, plan, path, list(value), [*self.overrides.get(name, []), *_candidates(a, value)], False
            )
            for i in range(len(value)):
                yield from self.model(element, plan, (*path, str(i)))
            return
        fixed = _fixed_tuple(a)
        if fixed is not None and isinstance(value, (list, tuple)):  # each element in turn: (0.9, 0.999) -> betas.0, betas.1
            for i, element in enumerate(fixed):
                others = [[*value[:i], c, *value[i + 1 :]] for c in _candidates(element, value[i])]
                yield from self._first_valid(f"{name}.{i}", plan, path, list(value), others, literal=False)
            return
        if get_origin(a) is Literal and len(get_args(a)) == 1:
            return  # a constant (the `kind` of a task or a prompt source): its section's kinds are walked instead
        literal = get_origin(a) is Literal or a is bool
        yield from self._first_valid(name, plan, path, value, [*self.overrides.get(name, []), *_candidates(a, value)], literal)

    def _first_valid(
        self, name: str, plan: Plan, path: tuple[str, ...], value: Any, candidates: list, literal: bool
    ) -> Iterator[Change]:
        """The change to the first candidate that validates (every one, for a choice among names)."""
        found = False
        for candidate in candidates:
            if candidate == value:
                continue
            setting = f"{name}={candidate}" if literal else name
            if setting in self.skip:
                continue
            changed = _with(plan, path, candidate)
            if self.valid(changed):
                found = True
                yield Change(setting, path, plan, changed)
                if not literal:
                    break
        if not found and not any(s.startswith(f"{name}=") for s in self.skip):
            self.unchangeable.append(name)

    def _section(
        self, annotation: Any, models: list[type[BaseModel]], plan: Plan, path: tuple[str, ...], value: Any
    ) -> Iterator[Change]:
        """A section (a model), optional or one of several kinds (a discriminated union): every kind
        it may be, each with every field of it changed."""
        name = _name(path)
        if value is not None:
            current = _kind_of(models, value)
            yield from self.model(current, plan, path)
            others = [m for m in models if m is not current]
            if _is_union(annotation) and type(None) in get_args(annotation):
                yield from self._changed_to(name, path, plan, None, None)
        else:
            others = models
        for other in others:
            if f"{name}={other.__name__}" in self.skip:
                continue
            for fresh in [*self.overrides.get(name, []), *_fresh(other)]:
                if isinstance(fresh, dict) and _kind_of(models, fresh) is other:
                    made = list(self._changed_to(name, path, plan, fresh, other))
                    if made:
                        yield from made
                        yield from self.model(other, made[0].changed, path)
                        break
            else:
                self.unchangeable.append(f"{name} (as a {other.__name__})")

    def _changed_to(self, name: str, path: tuple[str, ...], plan: Plan, value: Any, kind: type | None) -> Iterator[Change]:
        changed = _with(plan, path, value)
        if self.valid(changed):
            yield Change(f"{name}={'None' if value is None else kind.__name__}", path, plan, changed)


def _default(info: Any) -> Any:
    default = info.get_default(call_default_factory=True)
    return default.model_dump(mode="json") if isinstance(default, BaseModel) else json.loads(canonical_json(default))


def _kind_of(models: list[type[BaseModel]], value: dict) -> type[BaseModel]:
    """Which of the models a section's value is: by its `kind` where they have one, else by its
    constant `name` (an environment's settings); a model with neither takes any value."""
    for m in models:
        tags = [(tag, f) for tag in ("kind", "name") if (f := m.model_fields.get(tag)) is not None]
        tag, constant = next(((t, f) for t, f in tags if t == "kind" or get_origin(f.annotation) is Literal), (None, None))
        if constant is None or constant.default == value.get(tag):
            return m
    return models[0]


def _raw(plan: Plan) -> Raw:
    return {"experiment": plan.experiment, "environments": plan.environments}


def _with(plan: Plan, path: tuple[str, ...], value: Any) -> Plan:
    raw = _set(_raw(plan), path, value)
    return Plan(raw["experiment"], raw["environments"])


def _name(path: tuple[str, ...]) -> str:
    return ".".join(path[1:]) if path[0] == "experiment" else ".".join(path)


def changes(plan: Plan, environments: dict[str, type[BaseModel]], not_settings: set[str], walk: Walk) -> Iterator[Change]:
    """One change per setting of the plan's experiment, then of its environments (`not_settings`:
    fields of an environment that are other resources, not settings)."""
    kind = plan.experiment["task"]["kind"]
    yield from walk.model(task_of(kind).experiment, plan, ("experiment",))
    for tier, cls in environments.items():
        for name, info in cls.model_fields.items():
            if f"environments.{tier}.{name}" in not_settings:
                continue
            value = plan.environments[tier][name] if name in plan.environments[tier] else _default(info)
            yield from walk.field(info.annotation, plan, ("environments", tier, name), value)


# ---- a plan, computed --------------------------------------------------------------------------


def stored(root: Path) -> dict[tuple[str, str], Artifact]:
    """Every artifact of a local store, with what it is and what must be equal under its key."""
    found: dict[tuple[str, str], Artifact] = {}
    weights_by_hash: dict[str, str] = {}
    raw: dict[tuple[str, str], dict[str, bytes]] = {}
    for kind_dir in sorted(p for p in root.iterdir() if p.is_dir() and p.name not in ("quarantine", "partials")):
        for art in sorted(p for p in kind_dir.iterdir() if (p / "manifest.json").is_file()):
            manifest = json.loads((art / "manifest.json").read_text())["files"]
            raw[(kind_dir.name, art.name)] = {n: (art / n).read_bytes() for n in manifest}
            if kind_dir.name == "weights":
                weights_by_hash[content_hash({"files": manifest})] = _what("weights", raw[(kind_dir.name, art.name)], {})
    for (kind, key), files in raw.items():
        if kind == "judge_calls":  # an entry records when it was asked: what must be equal is the question and its score
            entry = json.loads(files["data.json"])
            files = {"data.json": canonical_json({"request": entry["request"], "score": entry["score"]})}
        found[(kind, key)] = Artifact(kind, key, _what(kind, raw[(kind, key)], weights_by_hash), files)
    return found


def _what(kind: str, files: dict[str, bytes], weights: dict[str, str]) -> str:
    data = json.loads(files["data.json"]) if "data.json" in files else {}
    if kind == "weights":
        if STATS in files:
            return f"weights of step {json.loads(files[STATS])['step']:04d}"
        return "the warm-up's weights" if WARMUP_FILE in files else "initial weights"
    if kind in ("rollouts", "rewards") and "step" in data:
        return f"{kind} of step {data['step']:04d}"
    if kind == "evaluations":
        return f"evaluation of the {weights.get(data.get('weights_hash'), 'weights ' + str(data.get('weights_hash'))[:12])}"
    if kind == "judge_calls":
        return f"judge call on trajectory {str(data.get('trajectory_hash'))[:12]}"
    return f"{kind} ({', '.join(sorted(files))[:60]})"


def compute(plan: Plan, root: Path, build: Callable[[Plan, Path], tuple[Any, Backends]]) -> dict[tuple[str, str], Artifact]:
    """Everything the plan stores, computed on a fresh store at `root`: the warm-up (if any), the
    initial weights and steps `STEPS`, through the task's loop. `build(plan, root)` gives the
    experiment and its backends (built by the environments, journaling into that store)."""
    from dagster_rl.store.artifact_store import ArtifactStore

    exp, backends = build(plan, root)
    store = ArtifactStore(f"file://{root}")
    task = task_of(exp.kind)
    warnings: list[str] = []
    try:
        warmup = task.warmup_of(exp)
        if warmup is not None:
            warmup.run(exp, store)
        loop = task.loop()
        for _ in loop.iter_steps(exp, STEPS, loop.initial_weights(exp, store), store, backends, warnings.append):
            pass
    finally:
        backends.close()
    assert not warnings, f"a fresh store warned: {warnings}"
    return stored(root)


@dataclass
class Outcome:
    """How a change of a setting showed in what was stored."""

    omissions: list[str]  # an artifact stored under one key with other bytes, beyond float rounding
    rounding: list[str]  # the same, within float rounding (adopting kinds)
    moved: list[str]  # what is stored under another key


def outcome(setting: str, reference: dict, changed: dict, adopting: frozenset) -> Outcome:
    """Compare what two plans stored: `reference` and `changed` are `stored()` maps."""
    omissions, rounding = [], []
    for where in sorted(reference.keys() & changed.keys()):
        a, b = reference[where], changed[where]
        difference = a.difference(b)
        if difference is None:
            continue
        said = f"{setting}: {a.what} ({a.kind}/{a.key[:12]}) holds other bytes under the same key when {setting} changes"
        if difference.rounding and a.kind in adopting:
            rounding.append(f"{said}: {difference.describe()}")
        else:
            omissions.append(f"{said}: its key leaves this setting out ({difference.describe()})")
    only = [*(reference[k] for k in reference.keys() - changed.keys()), *(changed[k] for k in changed.keys() - reference.keys())]
    return Outcome(omissions, rounding, sorted({a.what for a in only}))


def findings(setting: str, seen: Outcome, outside: dict[str, str], rounding: dict[str, str]) -> list[str]:
    """What is wrong with how a setting enters the keys (see the module doc); [] when nothing.
    `rounding`: the settings whose change may change float bytes within rounding (and so the keys
    of what is computed from them), with why."""
    problems = list(seen.omissions)
    may_round = _listed(setting, rounding)
    if seen.rounding and may_round is None:
        problems += [f"{r} (not listed in ROUNDING: say why this setting changes float bytes)" for r in seen.rounding[:3]]
    listed = _listed(setting, outside)
    if listed is not None and seen.moved and not (seen.rounding and may_round is not None):
        problems.append(
            f"{setting} is in OUTSIDE_KEYS ({listed}), but changing it changes the key of {', '.join(seen.moved[:4])}"
        )
    if listed is None and not seen.moved and not problems:
        problems.append(
            f"{setting} changes no key and no stored byte: put it in the key of what it affects, or in OUTSIDE_KEYS with why it is in none"
        )
    return problems


def _listed(setting: str, reasons: dict[str, str]) -> str | None:
    """The reason a table gives for a setting (`policy.device=cpu`), for it whatever its value
    (`policy.device`), or for a section holding it (`policy`); None when it gives none."""
    parts = setting.split("=")[0].split(".")
    for name in [setting, *(".".join(parts[:n]) for n in range(len(parts), 0, -1))]:
        if name in reasons:
            return reasons[name]
    return None


def combined(base: Plan, group: list[Change]) -> Plan | None:
    """`base` with every change of `group` made at once (one value per setting), or None when the
    changes touch one place twice."""
    paths = [c.path for c in group]
    if len(set(paths)) != len(paths):
        return None
    plan = base
    for c in group:
        plan = _with(plan, c.path, _get(_raw(c.changed), c.path))
    return plan
