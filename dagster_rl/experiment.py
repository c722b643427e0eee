"""Experiments: one YAML file each, validated into pydantic models.

An experiment names its task, rubric, GRPO settings, steps and fault injection. A fork
(`fork_of: parent`) starts from its parent's settings and overrides what it names; it is its own
asset group but shares the artifact cache, since artifacts are keyed by content, not by name.
"""

from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from dagster_rl.errors import ExperimentError
from dagster_rl.hashing import content_hash

IDENTIFIER = r"^[A-Za-z_][A-Za-z0-9_]*$"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SecretSearchTask(Strict):
    """The agentic sandbox world: find the document holding the digest of the world's secret."""

    kind: Literal["secret_search"] = "secret_search"
    n_worlds: int = Field(3, ge=1, le=1000)
    n_docs: int = Field(8, ge=2, le=1000)
    max_turns: int = Field(4, ge=1)
    scratch_rate: float = Field(0.3, ge=0.0, le=1.0, description="chance an agent leaves a scratch file")


class Rubric(Strict):
    """How the judge scores a trajectory on top of the verifier: reward = verified + score."""

    name: str = "default"
    correctness: float = Field(1.0, ge=0.0)
    efficiency: float = Field(0.5, ge=0.0)
    tidiness: float = Field(0.2, ge=0.0)

    @property
    def weight_total(self) -> float:
        """The most the rubric's score can add to the verifier's 1."""
        return self.correctness + self.efficiency + self.tidiness

    @property
    def max_reward(self) -> float:
        return 1.0 + self.weight_total


class GRPOSettings(Strict):
    learning_rate: float = Field(1.0, gt=0.0)
    advantage_eps: float = Field(1e-4, gt=0.0)


class Faults(Strict):
    """Seeded fault injection, active on the first attempt only."""

    crash_driver_at_step: int = Field(-1, ge=-1, description="-1: never")
    flaky_trial_rate: float = Field(0.0, ge=0.0, lt=1.0)
    judge_flake_rate: float = Field(0.0, ge=0.0, lt=1.0)
    step_delay_s: float = Field(
        0.0, ge=0.0, le=600.0, description="sleep before each step's update (computed steps only): a slow step to kill"
    )


class Checks(Strict):
    """Thresholds of the per-step asset checks on `<exp>/weights` (blocking: a failure stops the range)."""

    min_usable_fraction: float = Field(0.5, ge=0.0, le=1.0, description="usable trials / planned trials")


class ExperimentBase(Strict):
    """What every experiment has, whatever its task."""

    name: str = Field(pattern=IDENTIFIER, description="names the asset group and the jobs")
    description: str = ""
    fork_of: str | None = Field(None, pattern=IDENTIFIER)
    seed: int = 0
    n_steps: int = Field(ge=1, le=9999)
    prompts_per_step: int = Field(ge=1)
    n_samples: int = Field(description="samples per prompt: the GRPO group size")
    min_trials_per_step: int = Field(1, ge=1)
    faults: Faults = Faults()
    checks: Checks = Checks()

    @field_validator("n_samples")
    @classmethod
    def _groups_need_two(cls, v: int) -> int:
        if v < 2:
            raise ValueError("GRPO normalizes rewards within a group of samples of one prompt; set n_samples >= 2")
        return v

    @property
    def kind(self) -> str:
        return self.task.kind  # type: ignore[attr-defined]

    @property
    def n_trials_planned(self) -> int:
        return self.prompts_per_step * self.n_samples

    @property
    def step_keys(self) -> list[str]:
        return [step_key(i) for i in range(self.n_steps)]

    NOT_TRAINING: ClassVar[frozenset[str]] = frozenset({"name", "description", "fork_of", "n_steps", "faults", "checks"})

    def training_inputs(self) -> dict[str, Any]:
        """Every setting that changes what the steps compute (not names, steps, faults or checks)."""
        return self.model_dump(mode="json", exclude=set(self.NOT_TRAINING))

    def training_hash(self) -> str:
        return content_hash(self.training_inputs())


class SecretSearchExperiment(ExperimentBase):
    """The agentic loop: sandboxed episodes, verifier + rubric judge, tabular document priors."""

    task: SecretSearchTask
    rubric: Rubric = Rubric()
    grpo: GRPOSettings = GRPOSettings()


def experiment_kinds() -> dict[str, type[ExperimentBase]]:
    from dagster_rl.lm.experiment import LMExperiment  # imports this module: load it late

    return {"secret_search": SecretSearchExperiment, "verifiable_prompts": LMExperiment}


def _kind_of(raw: Any) -> str | None:
    task = raw.get("task") if isinstance(raw, dict) else None
    return task.get("kind") if isinstance(task, dict) else None


def step_key(step: int) -> str:
    return f"{step:04d}"


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


def parse_experiment(raw: dict[str, Any]) -> ExperimentBase:
    """Validate settings against the experiment class of their `task.kind`."""
    kind, kinds = _kind_of(raw), experiment_kinds()
    if kind not in kinds:
        raise ValueError(f"field 'task.kind': {kind!r} is not a task kind; use one of {sorted(kinds)}")
    return kinds[kind].model_validate(raw)


def _validate(path: Path, raw: dict[str, Any]) -> ExperimentBase:
    try:
        return parse_experiment(raw)
    except ValidationError as e:
        problems = "; ".join(
            f"field '{'.'.join(str(p) for p in err['loc']) or '<root>'}': {err['msg']}" for err in e.errors()
        )
        raise ExperimentError(f"{path}: invalid experiment: {problems}") from None
    except ValueError as e:
        raise ExperimentError(f"{path}: invalid experiment: {e}") from None


def load_experiment(path: Path) -> ExperimentBase:
    """Load one experiment file that is not a fork."""
    return _validate(path, _read_yaml(path))


def load_experiments(directory: Path) -> dict[str, ExperimentBase]:
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
