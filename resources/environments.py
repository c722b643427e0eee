"""The loop's environments: rollout, judge and trainer, each with its own retries, timeout and
concurrency, each building the backend an experiment runs (through its task's record)."""

import tempfile
from functools import partial
from pathlib import Path
from typing import Any, Literal

from dagster import AssetExecutionContext, ConfigurableResource
from pydantic import Field

from dagster_rl.experiment import Experiment
from dagster_rl.judge_journal import JudgeJournal
from dagster_rl.llm_judge import LLMJudge, OpenAIChatClient
from dagster_rl.retries import Limits
from dagster_rl.rubric_judge import RubricJudge
from dagster_rl.task import Backend, JudgeBackend, RolloutEnv, TrainerEnv, task_of
from resources.artifact_store import ArtifactStoreResource
from resources.trainer_launcher import PipesTorchrunLauncher


class _Environment(ConfigurableResource):
    max_retries: int = Field(2, ge=0, description="retries of one call (a trial, a judgement, an update)")
    timeout_s: float = Field(60.0, gt=0, description="time limit of one attempt")
    max_concurrency: int = Field(8, ge=1, description="calls running at once")

    def limits(self) -> Limits:
        return Limits(self.max_retries, self.timeout_s, self.max_concurrency)


class RolloutEnvironment(_Environment):
    """Runs a step's trials with the rollout backend the experiment's task names: the sandboxed
    secret_search agent (`sandbox`), or batched `transformers` generation of a language model (`hf`).

    Examples:
        .. code-block:: python

            from dagster import Definitions
            from resources import RolloutEnvironment

            defs = Definitions(
                assets=[...],
                resources={"rollout": RolloutEnvironment(max_retries=3, timeout_s=120, sandbox_root="/scratch")},
            )
    """

    sandbox_root: str = Field("", description="where trials may write (sandboxes); empty means the system temp dir")

    def backend_for(self, exp: Experiment) -> Backend:
        env = RolloutEnv(self.limits(), Path(self.sandbox_root or tempfile.gettempdir()))
        return task_of(exp.kind).backend("rollout", exp, env)


class JudgeEnvironment(_Environment):
    """Scores trajectories: the task's deterministic verifier plus rubric, in-process
    (`in_process`), or the verifier plus an LLM judge over an OpenAI-compatible chat endpoint
    (`openai`), every call journaled in the artifact store so a retried judgement replays the
    journal instead of paying again.

    Examples:
        .. code-block:: python

            from dagster import Definitions, EnvVar
            from resources import ArtifactStoreResource, JudgeEnvironment

            store = ArtifactStoreResource()
            defs = Definitions(
                assets=[...],
                resources={
                    "artifact_store": store,
                    "judge": JudgeEnvironment(
                        artifact_store=store, backend="openai", base_url=EnvVar("DAGSTER_RL_JUDGE_URL"),
                        model="Qwen/Qwen2.5-7B-Instruct", api_key=EnvVar("DAGSTER_RL_JUDGE_API_KEY"),
                    ),
                },
            )
    """

    artifact_store: ArtifactStoreResource  # where the `openai` backend journals its calls
    backend: Literal["in_process", "openai"] = "in_process"
    base_url: str = Field("", description="openai: the endpoint's base URL, e.g. http://127.0.0.1:8000/v1")
    model: str = Field("", description="openai: the judge model's name, sent with every request")
    api_key: str = Field("", description="openai: sent as a Bearer token when set (use EnvVar for secrets)")
    request_timeout_s: float = Field(30.0, gt=0, description="openai: time limit of one HTTP request")

    def backend_for(self, exp: Experiment) -> JudgeBackend:
        task = task_of(exp.kind)
        if self.backend == "in_process":
            return RubricJudge(task.score, self.limits())
        if task.grading is None:
            raise ValueError(
                f"the LLM judge (backend 'openai') has no grading prompt for task kind {exp.kind} (experiment "
                f"{exp.name}): use backend 'in_process' (its verifier + rubric) for it"
            )
        if not self.base_url or not self.model:
            raise ValueError("JudgeEnvironment(backend='openai') needs base_url and model")
        client = OpenAIChatClient(self.base_url, self.api_key or None, self.request_timeout_s)
        return LLMJudge(client, self.model, JudgeJournal(self.artifact_store.get_store()), task.grading, self.limits())


class TrainerEnvironment(_Environment):
    """Runs the policy update with the trainer backend the experiment names: in this process
    (`in_process`), or (language models, `trainer.backend: torchrun`) `torchrun` on this machine,
    started by its `launcher` (Dagster Pipes from the driver's step).

    Examples:
        .. code-block:: python

            from dagster import Definitions
            from resources import PipesTorchrunLauncher, TrainerEnvironment

            defs = Definitions(
                assets=[...],
                resources={"trainer": TrainerEnvironment(launcher=PipesTorchrunLauncher(), timeout_s=7200)},
            )
    """

    launcher: PipesTorchrunLauncher
    max_retries: int = Field(0, ge=0)
    timeout_s: float = Field(3600.0, gt=0)
    max_concurrency: int = Field(1, ge=1)

    def backend_for(self, exp: Experiment, context: AssetExecutionContext | Any) -> Backend:
        env = TrainerEnv(self.limits(), launch=partial(self.launcher.run, context))
        return task_of(exp.kind).backend("trainer", exp, env)
