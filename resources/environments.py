"""The loop's environments: rollout, judge and trainer, each with its own retries, timeout and
concurrency, each building the backend an experiment runs (through its task's record)."""

import os
import tempfile
import threading
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal

from dagster import AssetExecutionContext, ConfigurableResource, InitResourceContext
from pydantic import Field, PrivateAttr, model_validator

from dagster_rl.base import bounds
from dagster_rl.base.retries import Limits
from dagster_rl.core.experiment import Experiment
from dagster_rl.core.task import Endpoint, JudgeBackend, RolloutBackend, RolloutEnv, TrainerBackend, TrainerEnv, task_of
from dagster_rl.inference.server_process import ADAPTER_ROOTS_ENV, ManagedServer
from dagster_rl.inference.vllm_client import VLLMClient
from dagster_rl.judges.journal import JudgeJournal
from dagster_rl.judges.llm_judge import LLMJudge, OpenAIChatClient
from dagster_rl.judges.rubric_judge import RubricJudge
from dagster_rl.runtime.pods import PodJob
from dagster_rl.runtime.workers import Workers
from dagster_rl.sandbox.bubblewrap import BubblewrapSandboxes, default_root
from dagster_rl.sandbox.placement import Sandboxes
from resources.artifact_store import ArtifactStoreResource
from resources.k8s_launcher import PipesK8sJobLauncher
from resources.trainer_launcher import PipesTorchrunLauncher


class _Environment(ConfigurableResource):
    max_retries: int = Field(2, ge=0, le=bounds.MAX_RETRIES, description="retries of one call (a trial, a judgement, an update)")
    timeout_s: float = Field(60.0, gt=0, le=bounds.MAX_DEADLINE_S, description="time limit of one attempt")
    max_concurrency: int = Field(8, ge=1, le=bounds.MAX_CONCURRENCY, description="calls running at once")

    def limits(self) -> Limits:
        return Limits(self.max_retries, self.timeout_s, self.max_concurrency)


class RolloutEnvironment(_Environment):
    """Runs a step's trials with the rollout backend the experiment's task names: the sandboxed
    secret_search agent (`sandbox`), batched `transformers` generation of a language model (`hf`),
    or a warm vLLM server over its OpenAI-compatible API (`openai_server`, at `base_url`).

    Where the server is and how to reach it belong here, not in the experiment: the same experiment
    runs against whatever server this code location deploys, and its key stays out of experiment
    files (use `EnvVar`). With `server_command` (on a GPU machine e.g. `["vllm", "serve", "<model>",
    "--enable-lora", "--port", "8000", ...]`; vLLM's CPU build: `dagster_rl.inference.server_process.vllm_cpu_command`)
    the environment starts the server when a backend first needs it, waits until it is healthy and
    generates a token, and stops it when the run ends.

    Examples:
        .. code-block:: python

            from dagster import Definitions, EnvVar
            from resources import RolloutEnvironment

            defs = Definitions(
                assets=[...],
                resources={
                    "rollout": RolloutEnvironment(
                        base_url="http://vllm:8000/v1", api_key=EnvVar("VLLM_API_KEY"), max_concurrency=64,
                        max_retries=3, timeout_s=120, sandbox_root="/scratch",
                    )
                },
            )
    """

    sandbox_root: str = Field("", description="where trials may write (sandboxes); empty means the system temp dir")
    base_url: str = Field("", description="openai_server: the server's OpenAI-compatible base URL, e.g. http://vllm:8000/v1")
    api_key: str = Field("", description="openai_server: sent as a Bearer token when set (use EnvVar for secrets)")
    request_timeout_s: float = Field(120.0, gt=0, description="openai_server: time limit of one HTTP request")
    adapter_dir: str = Field(
        "",
        description="openai_server: a folder the driver writes adapters to and the server reads at the same path; "
        "empty: the server reads the weights' artifact folders (a local or mounted artifact store)",
    )
    server_command: list[str] = Field(default_factory=list, description="start this server for the run (e.g. vllm serve ...)")
    server_startup_timeout_s: float = Field(900.0, gt=0)
    _server: ManagedServer | None = PrivateAttr(None)
    _server_lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    def endpoint(self) -> Endpoint | None:
        if not self.base_url:
            if self.server_command:
                raise ValueError("RolloutEnvironment(server_command=...) needs the base_url the server will answer at")
            return None
        return Endpoint(self.base_url, self.api_key or None, self.request_timeout_s, self.adapter_dir, self._start_server)

    def _start_server(self, adapter_roots: list[str]) -> None:
        """Start the managed server once, on first use (no command: the server is someone else's),
        allowed to load adapters from `adapter_roots` alone (`DAGSTER_RL_ADAPTER_ROOTS`, which
        `dagster-rl serve` reads; vLLM ignores it)."""
        if not self.server_command:
            return
        with self._server_lock:
            if self._server is None:
                client = VLLMClient(self.base_url, self.api_key or None)
                env = {ADAPTER_ROOTS_ENV: os.pathsep.join(adapter_roots)}
                self._server = ManagedServer(self.server_command, client, self.server_startup_timeout_s, env=env).start()

    def teardown_after_execution(self, context: InitResourceContext) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def backend_for(self, exp: Experiment, sandboxes: Sandboxes | None = None) -> RolloutBackend:
        """The experiment's rollout backend; `sandboxes`: where its environments' programs run (the sandbox tier's)."""
        env = RolloutEnv(self.limits(), Path(self.sandbox_root or tempfile.gettempdir()), self.endpoint(), sandboxes)
        return task_of(exp.kind).backend("rollout", exp, env)


class SandboxEnvironment(_Environment):
    """The sandbox tier: where the programs an agent's environment runs (a tool call's Python) run,
    isolated and bounded (`dagster_rl.sandbox`, docs/sandbox.md). `bubblewrap` (the embedded default):
    a bubblewrap sandbox per call on this machine, as an unprivileged user, with no network and
    nothing of the host but the interpreter's files; `k8s`: a fresh pod of the sandbox tier per
    episode, taken from a pool started ahead (docs/kubernetes.md, "Sandboxes"). Its own limits:
    `max_concurrency` sandboxes at once (across the run's processes), `max_retries` attempts again a
    sandbox that could not be made (never a program that ran), `timeout_s` how long a call may wait
    for a free sandbox. What one program may use (CPU seconds, memory, output) is the experiment's,
    in its environment's settings. A run whose environment runs programs checks the placement before
    its first step: bubblewrap missing, or no pod that runs a program, fails it there, saying what to do.

    Examples:
        .. code-block:: python

            from dagster import Definitions
            from resources import SandboxEnvironment

            defs = Definitions(
                assets=[...],
                resources={
                    "sandbox": SandboxEnvironment(max_concurrency=16, root="/scratch/sandboxes"),  # this machine
                    # on a cluster: SandboxEnvironment(backend="k8s", pod_image="registry.example.com/dagster-rl:0.1.0",
                    #                                  pod_runtime_class_name="gvisor", max_concurrency=64)
                },
            )
    """

    backend: Literal["bubblewrap", "k8s"] = Field(
        "bubblewrap", description="bubblewrap: on this machine; k8s: a pod of the sandbox tier per episode"
    )
    root: str = Field(
        "", description="bubblewrap: the folder of the episodes' workspaces; empty: <system temp>/dagster_rl_sandboxes"
    )
    python: str = Field(
        "/usr/bin/python3", description="bubblewrap: the interpreter programs run on (its files are bound read-only)"
    )
    uid: int = Field(65534, ge=1, le=2**31 - 2, description="bubblewrap: the user sandboxes run as when this process is root")
    timeout_s: float = Field(600.0, gt=0, le=bounds.MAX_DEADLINE_S, description="how long a call may wait for a free sandbox")
    pod_image: str = Field("", description="k8s: the sandbox pods' image (one with a python3: the deployment's own)")
    pod_namespace: str = Field("", description="k8s: their namespace; empty: this process's")
    pod_runtime_class_name: str = Field("", description="k8s: gVisor or Kata where the cluster has one; empty: the default")
    pod_service_account: str = Field(
        "dagster-rl-sandbox", description="k8s: an account bound to no Role (deploy/k8s/sandbox.yaml)"
    )
    pod_pool_size: int = Field(2, ge=0, le=1024, description="k8s: pods started ahead, each for one episode, never reused")
    pod_cpu_limit: str = Field("500m", description="k8s: a sandbox pod's CPU request and limit")
    pod_memory_limit: str = Field("1Gi", description="k8s: a sandbox pod's memory request and limit")
    _built: list = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _pods_are_valid(self) -> "SandboxEnvironment":
        """A k8s placement's pod settings are checked where the resource is configured, not at its first call."""
        if self.backend == "k8s":
            self._pod_settings()
        return self

    def _pod_settings(self):
        from dagster_rl.sandbox.pod_manifest import PodSandboxSettings

        if not self.pod_image:
            raise ValueError("SandboxEnvironment(backend='k8s') needs pod_image: an image with a python3, the deployment's own")
        return PodSandboxSettings(
            namespace=self.pod_namespace,
            image=self.pod_image,
            runtime_class_name=self.pod_runtime_class_name,
            service_account=self.pod_service_account,
            pool_size=self.pod_pool_size,
            cpu_request=self.pod_cpu_limit,
            cpu_limit=self.pod_cpu_limit,
            memory_request=self.pod_memory_limit,
            memory_limit=self.pod_memory_limit,
            slot_timeout_s=self.timeout_s,
        )

    def sandboxes(self) -> Sandboxes:
        if self.backend == "bubblewrap":
            return BubblewrapSandboxes(
                Path(self.root) if self.root else default_root(),
                python=self.python,
                uid=self.uid,
                max_concurrency=self.max_concurrency,
                max_retries=self.max_retries,
                slot_timeout_s=self.timeout_s,
            )
        from dagster_rl.sandbox.pods import PodSandboxes

        pods = PodSandboxes(self._pod_settings(), max_concurrency=self.max_concurrency, max_retries=self.max_retries)
        self._built.append(pods)
        return pods

    def teardown_after_execution(self, context: InitResourceContext) -> None:
        """The pods of the pool are deleted when the run's step ends."""
        while self._built:
            self._built.pop().close()


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
    (`in_process`), or (language models) `torchrun` on this machine (`torchrun`), started by its
    `launcher` (Dagster Pipes from the driver's step), or an Indexed Job of GPU pods on Kubernetes
    (`k8s`), placed by its `k8s` launcher. With the experiment's `trainer.session: range` the
    workers or pods live for the run's range of steps: the driver closes them when its range ends,
    and this resource's teardown closes any it left.

    Examples:
        .. code-block:: python

            from dagster import Definitions
            from resources import PipesK8sJobLauncher, PipesTorchrunLauncher, TrainerEnvironment

            defs = Definitions(
                assets=[...],
                resources={
                    "trainer": TrainerEnvironment(
                        launcher=PipesTorchrunLauncher(),
                        k8s=PipesK8sJobLauncher(image="registry.example.com/dagster-rl:1.0", workdir="/data/trainer-jobs",
                                                storage_claim="dagster-rl-shared", storage_mount_path="/data"),
                        timeout_s=7200,
                    )
                },
            )
    """

    launcher: PipesTorchrunLauncher
    k8s: PipesK8sJobLauncher | None = None
    max_retries: int = Field(0, ge=0, le=bounds.MAX_RETRIES)
    timeout_s: float = Field(3600.0, gt=0, le=bounds.MAX_DEADLINE_S)
    max_concurrency: int = Field(1, ge=1, le=bounds.MAX_CONCURRENCY)
    _built: list = PrivateAttr(default_factory=list)

    def backend_for(self, exp: Experiment, context: AssetExecutionContext | Any) -> TrainerBackend:
        pods = _BoundPods(self.k8s, context) if self.k8s is not None else None
        env = TrainerEnv(
            self.limits(), launch=partial(self.launcher.run, context), pods=pods, start=partial(self.launcher.start, context)
        )
        backend = task_of(exp.kind).backend("trainer", exp, env)
        self._built.append(backend)
        return backend

    def teardown_after_execution(self, context: InitResourceContext) -> None:
        """The backstop of the driver's own close at the end of its range: no session outlives the run's step."""
        while self._built:
            close = getattr(self._built.pop(), "close", None)
            if callable(close):
                close()


@dataclass(frozen=True)
class _BoundPods:
    """The k8s launcher bound to the driver's step (what `dagster_rl.runtime.pods.PodLauncher` promises)."""

    launcher: PipesK8sJobLauncher
    context: Any

    @property
    def workdir(self) -> Path:
        return Path(self.launcher.workdir)

    def run(self, job: PodJob) -> None:
        self.launcher.run(self.context, job)

    def start(self, job: PodJob) -> Workers:
        return self.launcher.start(self.context, job)
