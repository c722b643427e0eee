"""The rollout, judge and trainer environments, each with its own retries, timeout and concurrency."""

import tempfile
from pathlib import Path
from typing import Literal

from dagster import ConfigurableResource
from pydantic import Field

from dagster_rl.experiment import ExperimentBase
from dagster_rl.environments import InProcessTrainer, Limits, RubricJudge, SandboxRollouts
from dagster_rl.judge_journal import JudgeJournal
from dagster_rl.llm_judge import LLMJudge, OpenAIChatClient
from dagster_rl.store import ArtifactStore


class _Environment(ConfigurableResource):
    max_retries: int = Field(2, ge=0, description="retries of one call (a trial, a judgement, an update)")
    timeout_s: float = Field(60.0, gt=0, description="time limit of one attempt")
    max_concurrency: int = Field(8, ge=1, description="calls running at once")

    def limits(self) -> Limits:
        return Limits(self.max_retries, self.timeout_s, self.max_concurrency)


class RolloutEnvironment(_Environment):
    """Runs trials in-process: the sandboxed secret_search agent, or batched `transformers`
    generation of a language-model policy."""

    backend: Literal["in_process"] = "in_process"
    sandbox_root: str = Field("", description="where trial sandboxes are made; empty means the system temp dir")

    def engine(self, exp: ExperimentBase):
        if exp.kind == "verifiable_prompts":
            from dagster_rl.lm.environments import HFRollouts

            return HFRollouts(limits=self.limits())
        root = Path(self.sandbox_root or tempfile.gettempdir()) / "dagster_rl_sandboxes"
        return SandboxRollouts(sandbox_root=root, limits=self.limits())


class JudgeEnvironment(_Environment):
    """Scores trajectories: deterministic verifier plus rubric, in-process (`in_process`), or plus an
    LLM judge over an OpenAI-compatible chat endpoint (`openai`), every call journaled in the
    artifact store so a retried judgement replays the journal instead of paying again.

    Values may come from the environment of the process that runs the step:
    `JudgeEnvironment(backend="openai", base_url=EnvVar("DAGSTER_RL_JUDGE_URL"), api_key=EnvVar(...))`.
    """

    backend: Literal["in_process", "openai"] = "in_process"
    base_url: str = Field("", description="openai: the endpoint's base URL, e.g. http://127.0.0.1:8000/v1")
    model: str = Field("", description="openai: the judge model's name, sent with every request")
    api_key: str = Field("", description="openai: sent as a Bearer token when set (use EnvVar for secrets)")
    request_timeout_s: float = Field(30.0, gt=0, description="openai: time limit of one HTTP request")

    def engine(self, exp: ExperimentBase, store: ArtifactStore | None = None) -> RubricJudge | LLMJudge:
        if self.backend == "in_process":
            return RubricJudge(limits=self.limits())
        if exp.kind != "secret_search":
            raise ValueError(
                f"the LLM judge (backend 'openai') scores secret_search trajectories; experiment {exp.name} is "
                f"{exp.kind}: use backend 'in_process' (its verifier + rubric) for it"
            )
        if not self.base_url or not self.model:
            raise ValueError("JudgeEnvironment(backend='openai') needs base_url and model")
        if store is None:
            raise ValueError("JudgeEnvironment(backend='openai') journals its calls: engine() needs the artifact store")
        client = OpenAIChatClient(self.base_url, self.api_key or None, self.request_timeout_s)
        return LLMJudge(client, self.model, JudgeJournal(store), self.limits())


class TrainerEnvironment(_Environment):
    """Runs the policy update: in-process, or (language models, `trainer.backend: torchrun` in the
    experiment) `torchrun` on this machine, launched by `runner` (Dagster Pipes from the driver)."""

    backend: Literal["in_process"] = "in_process"
    max_retries: int = Field(0, ge=0)
    timeout_s: float = Field(3600.0, gt=0)
    max_concurrency: int = Field(1, ge=1)

    def engine(self, exp: ExperimentBase, runner=None):
        if exp.kind == "verifiable_prompts":
            from dagster_rl.lm.environments import LMTrainer, subprocess_runner

            return LMTrainer(limits=self.limits(), runner=runner or subprocess_runner)
        return InProcessTrainer(limits=self.limits())
