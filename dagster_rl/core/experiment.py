"""What every experiment has, whatever its task: name, seed, steps, trials, faults and checks.

Each task subclasses `Experiment` with its own `task`, rubric and training settings (see
`dagster_rl.core.task`); `dagster_rl.core.experiment_files` reads the YAML files into those classes.
"""

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from pydantic import Field, PrivateAttr, field_validator, model_validator

from dagster_rl.base import bounds
from dagster_rl.base.hashing import content_hash
from dagster_rl.base.plugins import check_reference
from dagster_rl.base.strict import Strict
from dagster_rl.runtime.pods import PodResources

IDENTIFIER = r"^[A-Za-z_][A-Za-z0-9_]*$"
ADVANTAGE_EPS = "added to a group's reward std before dividing: advantage = (r - mean) / (std + eps)"  # a field description
# The key of the validation context that holds the folder an experiment file was read from (`experiment_files`):
# settings that name a file beside the experiment (a reward function, a data file) resolve it there.
EXPERIMENTS_FOLDER = "experiments_folder"
MAX_TRIALS_PER_STEP = 65_536  # planned work a step may hold: prompts_per_step x n_samples (see `dagster_rl.base.bounds`)


class Faults(Strict):
    """Seeded fault injection, active on the first attempt only."""

    crash_driver_at_step: int = Field(
        -1,
        ge=-1,
        le=bounds.MAX_STEPS,
        description="the driver crashes after finishing this step, on the run's first attempt only; -1: never",
    )
    flaky_trial_rate: float = Field(0.0, ge=0.0, lt=1.0, description="chance that a trial's first attempt fails (seeded)")
    judge_flake_rate: float = Field(0.0, ge=0.0, lt=1.0, description="chance that a judgement's first attempt fails (seeded)")
    step_delay_s: float = Field(
        0.0, ge=0.0, le=600.0, description="sleep before each step's update (computed steps only): a slow step to kill"
    )
    generation_delay_s: float = Field(
        0.0,
        ge=0.0,
        le=600.0,
        description="language models: sleep before a step's trials generate (only when some are to be generated): "
        "rollouts in flight long enough to be killed half-done",
    )


class Checks(Strict):
    """Thresholds of the per-step asset checks on `<exp>/weights` (blocking: a failure stops the range)."""

    min_usable_fraction: float = Field(0.5, ge=0.0, le=1.0, description="usable trials / planned trials")


class TaskSection(Protocol):
    """What the generic layer reads of a task's `task` section: its kind."""

    @property
    def kind(self) -> str: ...


class Rubric(Protocol):
    """What the generic layer reads of a task's rubric: the top of its reward scale, and its settings."""

    @property
    def max_reward(self) -> float: ...

    def model_dump(self) -> dict[str, Any]: ...


class Experiment(Strict):
    """The settings every task's experiment class has; the task adds `task` and its own sections."""

    if TYPE_CHECKING:  # each task's experiment declares these as fields of its own types
        task: TaskSection
        rubric: Rubric

    name: str = Field(pattern=IDENTIFIER, description="names the asset group and the jobs")
    description: str = Field("", description="free text, shown in the UI on the driver asset; in no cache key")
    fork_of: str | None = Field(
        None,
        pattern=IDENTIFIER,
        description="the experiment this one starts from: its settings, overridden by what this file names; it shares "
        "the parent's artifact cache",
    )
    plugins: list[str] = Field(
        [],
        max_length=bounds.MAX_PLUGINS,
        description="user code imported before the rest of this file is read, in every process that reads it: "
        "`file.py` (a file in the experiments folder) or `package.module` (on the Python path), each registering "
        "what the file names (a task kind, a text environment: docs/agents.md); a fork inherits its parent's list "
        "unless it gives its own. In no cache key: what a plugin computes is keyed by its own code version",
    )
    seed: int = Field(0, ge=bounds.SEED_MIN, le=bounds.SEED_MAX, description="64-bit")
    n_steps: int = Field(ge=1, le=bounds.MAX_STEPS, description="training steps: the partitions 0000 to n_steps - 1")
    prompts_per_step: int = Field(
        ge=1, le=MAX_TRIALS_PER_STEP // 2, description="prompts a step samples, n_samples times each (a trial per sample)"
    )
    n_samples: int = Field(description="samples per prompt: the GRPO group size", le=MAX_TRIALS_PER_STEP // 2)
    min_trials_per_step: int = Field(
        1, ge=1, description="a step left with fewer usable trials (after retries) fails; at most prompts_per_step x n_samples"
    )
    faults: Faults = Field(Faults(), description="seeded fault injection, for tests and demos")
    checks: Checks = Field(Checks(), description="thresholds of the blocking checks on each step")
    driver_pod: PodResources | None = Field(
        None, description="on Kubernetes (k8s_job_executor): what the driver's step pod needs (and in-process rollouts)"
    )
    _fork_root: str | None = PrivateAttr(None)  # set by `experiment_files` when it resolves a chain of forks
    _folder: Path | None = PrivateAttr(None)  # set by `experiment_files`: the folder the file was read from

    def plugin_files(self) -> tuple[tuple[str, str | None], ...]:
        """Its plugins as another process imports them: (reference, the experiments folder) each."""
        return tuple((p, str(self._folder) if self._folder else None) for p in self.plugins)

    @field_validator("plugins")
    @classmethod
    def _plugin_references(cls, v: list[str]) -> list[str]:
        for reference in v:
            check_reference(reference)  # a PluginError (a ValueError) saying what to write
        return v

    @field_validator("n_samples")
    @classmethod
    def _groups_need_two(cls, v: int) -> int:
        if v < 2:
            raise ValueError("GRPO normalizes rewards within a group of samples of one prompt; set n_samples >= 2")
        return v

    @model_validator(mode="after")
    def _counts_agree(self) -> "Experiment":
        planned = self.prompts_per_step * self.n_samples
        if planned > MAX_TRIALS_PER_STEP:
            raise ValueError(
                f"prompts_per_step x n_samples = {self.prompts_per_step} x {self.n_samples} = {planned} trials per step, "
                f"more than the {MAX_TRIALS_PER_STEP} a step may plan; use fewer prompts per step or fewer samples"
            )
        if self.min_trials_per_step > planned:
            raise ValueError(
                f"min_trials_per_step={self.min_trials_per_step} is more than the {planned} trials a step plans "
                f"(prompts_per_step x n_samples): no step could pass; lower it to at most {planned}"
            )
        return self

    @property
    def kind(self) -> str:
        """The task kind (`task.kind` in the file): what `dagster_rl.core.task.task_of` looks up."""
        return self.task.kind

    @property
    def max_reward(self) -> float:
        """The top of the reward scale: each task's rubric says it."""
        return self.rubric.max_reward

    @property
    def min_reward(self) -> float:
        """The bottom of the reward scale: 0, unless the task says otherwise (a rubric of reward functions)."""
        return 0.0

    @property
    def folder(self) -> Path | None:
        """The experiments folder the file was read from (None: built in code); a setting that names a
        file beside the experiment resolves it there."""
        return self._folder

    def backends(self) -> dict[str, str]:
        """The backend this experiment runs in the rollout and trainer environments, by name."""
        return {"rollout": "in_process", "trainer": "in_process"}

    @property
    def family(self) -> str:
        """The experiment whose artifact cache this one shares: the root of its chain of forks (itself
        when it is no fork). Trained weights record it, and it is in their key, so a fork and its
        parent (and their forks) reuse each other's steps, the driver refuses the weights of any
        other experiment, and an experiment that merely has the same settings under another name
        computes its own weights. (Built directly rather than read from files, a fork's family is
        its `fork_of`.)"""
        return self._fork_root or self.fork_of or self.name

    @property
    def n_trials_planned(self) -> int:
        return self.prompts_per_step * self.n_samples

    @property
    def step_keys(self) -> list[str]:
        return [step_key(i) for i in range(self.n_steps)]

    NOT_TRAINING: ClassVar[frozenset[str]] = frozenset(
        {"name", "description", "fork_of", "plugins", "n_steps", "faults", "checks", "driver_pod"}
    )

    def training_inputs(self) -> dict[str, Any]:
        """Every setting that changes what the steps compute (not names, steps, faults or checks)."""
        return self.model_dump(mode="json", exclude=set(self.NOT_TRAINING))

    def training_hash(self) -> str:
        return content_hash(self.training_inputs())


def step_key(step: int) -> str:
    return f"{step:04d}"
