"""What a task is: the one record a task registers, and the types its parts exchange.

A *task* is one kind of problem the loop trains on: the agentic `secret_search` world
(`dagster_rl.tasks.secret_search`), prompts with verifiable answers for language models
(`dagster_rl.tasks.lm`), or whatever comes next. It lives in its own package and declares itself once,
as a `Task`, registered by one line in `BUILTIN_TASKS` (or by `register(...)` at run time, as
`tests/test_task_plugin.py` does for a bandit). The generic layer (experiment files, the Dagster
driver, resources, CLI) finds a task with `task_of(kind)` and never imports a task's package.

A task provides, in its own package:

1. `experiment`: its `Experiment` subclass (the YAML settings, `task.kind` among them, and
   `max_reward`, the top of the reward scale the checks hold rewards to).
2. `loop`: a factory of its `TaskLoop`, which makes the initial weights, loads stored weights and
   walks a range of steps, yielding a `StepResult` per step (and a `StepAsset` per extra asset).
   It stores a step's rollouts and rewards with `dagster_rl.core.steps.trial_set` (trial by trial: a
   failed trial is never cached as a result, a re-run attempts only the failed ones), a step's
   trained weights under `steps.weights_key` with their `TrainedFrom` record (`records.STATS`,
   from `steps.trained_from`: the step and experiment the driver checks before a range starts
   from them), and reports trials generated and judged into `backends.progress`.
3. `score`: the in-process verifier + rubric, `(exp, trajectory) -> reward`. The judge
   environment's `in_process` backend runs it; the `openai` backend (an LLM judge) asks `grading`
   for its prompt and keeps the verifier's verdict.
4. `rollout` and `trainer`: its backends of those environments, by name; the experiment's
   `backends()` picks one of each.
5. `step_assets`: per-step assets beyond rollouts -> rewards -> weights (the language models'
   `evaluation`).
6. `warmup`: optionally, an asset computed once per experiment before step 0 (the language models'
   supervised warm-up, `<exp>/sft`): unpartitioned, upstream of the step chain in the asset graph,
   and step 0's weights are its weights. The loop's `initial_weights` returns them (computing them
   through the artifact cache when the asset has not run); the Dagster layer builds the asset.
7. `commands`: subcommands it adds to the `dagster-rl` CLI (the language models' `serve`).
8. `checks`: blocking checks of `<exp>/weights` beyond the generic ones (the language models'
   `on_policy`); its loop puts each one's outcome in every `StepResult.checks`.
9. `status_columns`: the columns it adds to `dagster-rl status` (column -> a metadata key of the
   step's weights or of its step assets, and of the warm-up on the warm-up's row): the agentic
   task's `mean_turns`, a language model's held-out accuracy.

Every artifact a task stores is keyed by every input that changes its bytes (its settings, the
content of what it reads, and the key and content hash of each artifact it reads):
`tests/test_cache_keys.py` proves it for every setting of every shipped task.

Words, one per idea:
    experiment   one YAML file's settings, validated by the task's `Experiment` subclass
    step         one training iteration: a partition of `<exp>/rollouts -> rewards -> weights`
    trial        one sampled episode or completion of a step (`s{step}-p{prompt}-n{sample}`)
    weights      a policy as stored by a step (`Weights`); a live language model is a `Policy`
    loop         a task's walk over a range of steps (`TaskLoop`)
    environment  a tier of the loop (rollout, judge, trainer): a Dagster resource with its own
                 retries, timeout and concurrency (`resources/`)
    backend      the named implementation an environment runs (`sandbox`, `hf`, `torchrun`, ...)
"""

import argparse
import importlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Literal, Protocol, TypeVar, overload

from pydantic import BaseModel

from dagster_rl.base import plugins
from dagster_rl.base.retries import Limits
from dagster_rl.core.checks import CheckOutcome
from dagster_rl.core.experiment import Experiment
from dagster_rl.core.progress import Progress
from dagster_rl.runtime.pods import PodLauncher
from dagster_rl.runtime.workers import Start
from dagster_rl.store.artifact_store import ArtifactRef, ArtifactStore

E = TypeVar("E", bound=Experiment)
E_in = TypeVar("E_in", bound=Experiment, contravariant=True)  # a loop takes its task's experiments
P = TypeVar("P")  # what a task's weights hold in memory (a tabular prior, checkpoint files, ...)
Warn = Callable[[str], None]
Tier = Literal["rollout", "judge", "trainer"]


@dataclass(frozen=True)
class Weights(Generic[P]):
    """A policy as a step stored it: the weights a step starts from, and where they came from."""

    partition: str  # "initial" or the step key that produced them
    ref: ArtifactRef
    payload: P
    version: int

    def lineage(self) -> dict[str, str | int]:
        return {"partition": self.partition, "key": self.ref.key, "content_hash": self.ref.content_hash, "version": self.version}


class StepResult(BaseModel):
    """What the driver materializes for one step: numbers, artifacts, cache hits, checks."""

    step: int
    n_trials: int
    n_trials_planned: int
    mean_reward: float
    success_rate: float
    weights_version: int
    cache: dict[str, str]  # asset -> hit | miss
    refs: dict[str, ArtifactRef]
    behavior_policy: dict[str, str | int]
    skipped_trials: list[str]  # failed after their retries: the step is partial, a re-run attempts them again
    recovered_trials: list[str] = []  # failed in an earlier attempt of the step, succeeded now
    trials_executed: int
    judge_calls: int
    metrics: dict[str, float]  # the task's own numbers, drawn as plots
    timings: dict[str, float]
    checks: list[CheckOutcome]


class StepAsset(BaseModel):
    """One step's partition of an extra asset (see `Task.step_assets`), e.g. its evaluation."""

    asset: str
    step: int
    cache: str  # hit | miss
    ref: ArtifactRef
    metadata: dict[str, float | int | str]  # floats draw as plots


class WarmupResult(BaseModel):
    """What an experiment's warm-up asset (see `Task.warmup`) materializes: its artifact and numbers."""

    cache: str  # hit | miss
    ref: ArtifactRef
    metadata: dict[str, float | int | str]


class TaskLoop(Protocol[E_in, P]):
    def initial_weights(self, exp: E_in, store: ArtifactStore) -> Weights[P]:
        """The weights of step 0's rollouts: deterministic, so step 0 hashes the same in every run."""

    def load_weights(self, exp: E_in, store: ArtifactStore, partition: str, key: str) -> Weights[P]:
        """The weights stored under `key` by step `partition`."""

    def iter_steps(
        self, exp: E_in, steps: Sequence[int], start: Weights[P], store: ArtifactStore, backends: "Backends[Any, Any]", warn: Warn
    ) -> Iterator[StepResult | StepAsset]:
        """Walk `steps` in order from `start`, yielding each step's result as soon as it is stored."""


class JudgeBackend(Protocol):
    """Scores one trajectory: `reward = verified + score`. `cache_version` (or None) names a judge
    other than the task's own rubric in the rewards' cache key."""

    @property
    def limits(self) -> Limits: ...

    @property
    def cache_version(self) -> str | None: ...

    def judge(self, exp: Any, trajectory: Any) -> Any: ...


class RolloutBackend(Protocol):
    """Generates a step's trials: what every rollout backend provides, its environment's limits
    (retries, timeout, concurrency). Its methods are its task's, declared by the task as a protocol
    that extends this one and that its loop calls: `LMRolloutBackend.generate` (a step's requests
    in one call), `SecretSearchRolloutBackend.run` (one trial per call)."""

    @property
    def limits(self) -> Limits: ...


class TrainerBackend(Protocol):
    """Trains a step's weights on its rewards: what every trainer backend provides, its environment's
    limits. Its `train` is its task's (`LMTrainerBackend`, `SecretSearchTrainerBackend`). A backend
    that holds something for a range of steps (a trainer session's workers) has a `close()`, which
    the driver calls when the range ends, however it ends (`Backends.closed_at_end`)."""

    @property
    def limits(self) -> Limits: ...


RB = TypeVar("RB", bound=RolloutBackend)
TB = TypeVar("TB", bound=TrainerBackend)


@dataclass(frozen=True)
class Backends(Generic[RB, TB]):
    """The backends one loop calls, built by the environments (or directly in a plain loop), and
    where the loop reports how far its running steps are (trials generated and judged). A loop
    names the backends it calls, e.g. `Backends[LMRolloutBackend, LMTrainerBackend]`."""

    rollout: RB
    judge: JudgeBackend
    trainer: TB
    progress: Progress = field(default_factory=Progress)

    def close(self) -> None:
        """Close every backend that holds something for the range (each one, whatever the others raise)."""
        errors = []
        for backend in (self.rollout, self.judge, self.trainer):
            close = getattr(backend, "close", None)
            if callable(close):
                try:
                    close()
                except Exception as e:  # the others are closed all the same
                    errors.append(e)
        if errors:
            raise errors[0]

    @contextmanager
    def closed_at_end(self, warn: Warn) -> Iterator[None]:
        """The range's backends, closed when the block ends, however it ends (a trainer session's
        workers stop). A failure to close is reported, never raised over the error that ended the range."""
        try:
            yield
        except BaseException:
            try:
                self.close()
            except Exception as e:  # the error that ended the range is the one to report
                warn(f"closing the backends after a failed range: {e!r}")
            raise
        self.close()


Launch = Callable[[list[str], dict[str, str]], None]  # run a command (the trainer's torchrun) with extra env


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible inference server (vLLM, or `dagster-rl serve`) a rollout backend calls.

    `adapter_dir`: where a backend writes adapters for the server to load, a folder both the driver
    and the server read at the same path; empty: the server reads them in the artifact store itself
    (a local or mounted store)."""

    base_url: str  # e.g. http://vllm:8000/v1
    api_key: str | None = None
    request_timeout_s: float = 60.0
    adapter_dir: str = ""
    # starts the server when the environment manages one; call before use, with the folders its adapters
    # will be loaded from (a `dagster-rl serve` it starts loads adapters from those alone)
    start: Callable[[list[str]], None] | None = None


@dataclass(frozen=True)
class RolloutEnv:
    """What the rollout environment gives a backend: its limits, a folder for trials' scratch, the
    inference server it runs against (none: the backend generates in this process), and the sandbox
    tier's placement, where programs an environment runs go (`dagster_rl.sandbox.placement.Sandboxes`;
    none: the default, bubblewrap on this machine)."""

    limits: Limits
    scratch_dir: Path
    endpoint: Endpoint | None = None
    sandboxes: Any = None


@dataclass(frozen=True)
class TrainerEnv:
    """What the trainer environment gives a backend: its limits, how to launch a command on this
    machine (to its end, or started to live beside the driver: `dagster_rl.runtime.workers`), and how to
    launch a set of pods on a cluster (`dagster_rl.runtime.pods`)."""

    limits: Limits
    launch: Launch | None = None
    pods: PodLauncher | None = None
    start: Start | None = None


class LLMGrading(Protocol):
    """What the LLM judge needs of a task: the prompt for a trajectory, and the reward for a grade."""

    prompt_version: str  # in the journal's and the rewards' keys: a new prompt is a new judgement

    def messages(self, exp: Any, trajectory: Any) -> list[dict[str, str]]:
        """The chat messages asking for `SCORE: <0..1>` about `trajectory`."""

    def reward(self, exp: Any, trajectory: Any, grade: float) -> Any:
        """The verifier's verdict, with the LLM's grade in [0, 1] (scaled by the rubric) as its score."""


@dataclass(frozen=True)
class StepAssetSpec:
    name: str
    description: str


@dataclass(frozen=True)
class CheckSpec:
    """A blocking check of `<exp>/weights` a task adds, evaluated on every step."""

    name: str
    description: str


@dataclass(frozen=True)
class WarmupSpec:
    """An unpartitioned asset `<exp>/<name>` computed once per experiment before step 0 (a supervised
    warm-up): the step chain depends on it, and step 0 starts from its weights.

    `applies(exp)`: whether the experiment has one (a task may make it optional). `run(exp, store)`:
    compute it, or find it in the artifact store (the same content key the loop's `initial_weights`
    uses, so the asset and the steps agree), and say what it holds.
    """

    name: str
    description: str
    applies: Callable[[Any], bool]
    run: Callable[[Any, ArtifactStore], WarmupResult]


@dataclass(frozen=True)
class Command:
    """A `dagster-rl <name>` subcommand a task adds (see `Task.commands`)."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], None]


@dataclass(frozen=True)
class Task(Generic[E]):
    kind: str
    experiment: type[E]
    loop: Callable[[], TaskLoop]
    score: Callable[[Any, Any], Any]
    rollout: Mapping[str, Callable[[E, RolloutEnv], RolloutBackend]]
    trainer: Mapping[str, Callable[[E, TrainerEnv], TrainerBackend]]
    grading: LLMGrading | None = None
    step_assets: tuple[StepAssetSpec, ...] = field(default=())
    warmup: WarmupSpec | None = None
    commands: Mapping[str, Command] = field(default_factory=dict)
    checks: tuple[CheckSpec, ...] = field(default=())
    status_columns: Mapping[str, str] = field(default_factory=dict)

    def warmup_of(self, exp: E) -> WarmupSpec | None:
        """The warm-up asset this experiment has, if any."""
        return self.warmup if self.warmup is not None and self.warmup.applies(exp) else None

    @overload
    def backend(self, tier: Literal["rollout"], exp: E, env: RolloutEnv) -> RolloutBackend: ...

    @overload
    def backend(self, tier: Literal["trainer"], exp: E, env: TrainerEnv) -> TrainerBackend: ...

    def backend(self, tier: Literal["rollout", "trainer"], exp: E, env: Any) -> RolloutBackend | TrainerBackend:
        """The backend of `tier` that the experiment names (`exp.backends()`), built for `env`."""
        factories: Mapping[str, Callable[[E, Any], RolloutBackend | TrainerBackend]] = (
            self.rollout if tier == "rollout" else self.trainer
        )
        name = exp.backends()[tier]
        if name not in factories:
            raise ValueError(f"task {self.kind} has no {tier} backend {name!r}; it has {', '.join(sorted(factories))}")
        return factories[name](exp, env)


# The tasks that ship with dagster-rl: kind -> the module that registers it (imported on first use).
BUILTIN_TASKS = {
    "secret_search": "dagster_rl.tasks.secret_search.task",
    "verifiable_prompts": "dagster_rl.tasks.lm.task",
    "text_agent": "dagster_rl.tasks.agent.task",
}
_REGISTERED: dict[str, Task] = {}


def register(task: Task) -> Task:
    """Make `task.kind` known; registering the same kind again replaces it."""
    _REGISTERED[task.kind] = task
    return task


def task_kinds() -> list[str]:
    return sorted(set(BUILTIN_TASKS) | set(_REGISTERED))


def task_of(kind: str) -> Task:
    """The task registered as `kind`: a built-in one (imported on first use), one an experiment's
    `plugins` registered, or one an installed plugin registers (`dagster_rl.base.plugins`: the
    entry points are imported at the first kind not found)."""
    if kind not in _REGISTERED and kind in BUILTIN_TASKS:
        importlib.import_module(BUILTIN_TASKS[kind])
    if kind not in _REGISTERED:
        failed = plugins.installed_failures()
        if kind not in _REGISTERED:
            raise ValueError(
                f"{kind!r} is not a task kind; use one of {task_kinds()}, or name the module that registers yours in the "
                f"experiment's `plugins`{failed}"
            )
    return _REGISTERED[kind]
