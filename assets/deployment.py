"""Where the code location runs, read from its environment: one machine by default, or a Kubernetes
cluster (deploy/helm/values.yaml sets these variables on the user code deployment).

    DAGSTER_RL_ARTIFACTS          the artifact store's fsspec URL (default $DAGSTER_HOME/artifacts);
                                  on Kubernetes a folder of the shared volume, file:///data/artifacts
    DAGSTER_RL_ROLLOUT_URL        the rollout server (vLLM) of `rollout.backend: openai_server`
    DAGSTER_RL_ROLLOUT_API_KEY    its key, sent as a Bearer token (optional)
    DAGSTER_RL_ADAPTER_DIR        a shared folder for adapters, when the server cannot read the store
    DAGSTER_RL_K8S_IMAGE          set: trainers of `trainer.backend: k8s` run as pods of this image
    DAGSTER_RL_K8S_NAMESPACE      their namespace (default: the namespace this pod runs in)
    DAGSTER_RL_K8S_SERVICE_ACCOUNT  their service account
    DAGSTER_RL_STORAGE_CLAIM      the PersistentVolumeClaim the pods mount (shared with the driver)
    DAGSTER_RL_STORAGE_PATH       where it is mounted, in every pod (default /data)
    DAGSTER_RL_EXECUTOR           k8s: every run's steps run in their own pods (k8s_job_executor)
    DAGSTER_RL_SANDBOX_IMAGE      set: the programs agents run go to sandbox pods of this image (else bubblewrap)
    DAGSTER_RL_SANDBOX_RUNTIME_CLASS  their runtimeClassName (gVisor, Kata), when the cluster has one

URLs and keys are `EnvVar`s, read where the run executes (the UI shows the names, never a key).
"""

import os

from dagster import EnvVar, ExecutorDefinition

from assets.concurrency import experiment_executor, experiment_k8s_executor
from dagster_rl.base.errors import SettingError
from resources import PipesK8sJobLauncher, PipesTorchrunLauncher, RolloutEnvironment, SandboxEnvironment, TrainerEnvironment

ARTIFACTS = "DAGSTER_RL_ARTIFACTS"
ROLLOUT_URL, ROLLOUT_API_KEY, ADAPTER_DIR = "DAGSTER_RL_ROLLOUT_URL", "DAGSTER_RL_ROLLOUT_API_KEY", "DAGSTER_RL_ADAPTER_DIR"
K8S_IMAGE, K8S_NAMESPACE, K8S_SERVICE_ACCOUNT = (
    "DAGSTER_RL_K8S_IMAGE",
    "DAGSTER_RL_K8S_NAMESPACE",
    "DAGSTER_RL_K8S_SERVICE_ACCOUNT",
)
STORAGE_CLAIM, STORAGE_PATH = "DAGSTER_RL_STORAGE_CLAIM", "DAGSTER_RL_STORAGE_PATH"
EXECUTOR = "DAGSTER_RL_EXECUTOR"
SANDBOX_IMAGE, SANDBOX_RUNTIME_CLASS = "DAGSTER_RL_SANDBOX_IMAGE", "DAGSTER_RL_SANDBOX_RUNTIME_CLASS"


def artifact_url() -> str:
    return os.environ.get(ARTIFACTS, "")


def rollout_environment() -> RolloutEnvironment:
    """In-process generation; a rollout server for `openai_server` when DAGSTER_RL_ROLLOUT_URL is set."""
    if not os.environ.get(ROLLOUT_URL):
        return RolloutEnvironment()
    return RolloutEnvironment(
        base_url=EnvVar(ROLLOUT_URL),
        api_key=EnvVar(ROLLOUT_API_KEY) if os.environ.get(ROLLOUT_API_KEY) else "",
        adapter_dir=os.environ.get(ADAPTER_DIR, ""),
        max_concurrency=64,
    )


def trainer_environment() -> TrainerEnvironment:
    """torchrun on this machine; and Kubernetes pods for `trainer.backend: k8s` when DAGSTER_RL_K8S_IMAGE is set."""
    if not os.environ.get(K8S_IMAGE):
        return TrainerEnvironment(launcher=PipesTorchrunLauncher())
    mount = os.environ.get(STORAGE_PATH, "/data")
    k8s = PipesK8sJobLauncher(
        image=os.environ[K8S_IMAGE],
        namespace=os.environ.get(K8S_NAMESPACE, ""),
        service_account=os.environ.get(K8S_SERVICE_ACCOUNT, ""),
        storage_claim=os.environ.get(STORAGE_CLAIM, ""),
        storage_mount_path=mount,
        workdir=f"{mount.rstrip('/')}/trainer-jobs",
    )
    return TrainerEnvironment(launcher=PipesTorchrunLauncher(), k8s=k8s, timeout_s=4 * 3600.0)


def sandbox_environment() -> SandboxEnvironment:
    """Bubblewrap on this machine; sandbox pods on the cluster when DAGSTER_RL_SANDBOX_IMAGE is set."""
    if not os.environ.get(SANDBOX_IMAGE):
        return SandboxEnvironment()
    return SandboxEnvironment(
        backend="k8s",
        pod_image=os.environ[SANDBOX_IMAGE],
        pod_namespace=os.environ.get(K8S_NAMESPACE, ""),
        pod_runtime_class_name=os.environ.get(SANDBOX_RUNTIME_CLASS, ""),
        max_concurrency=64,
    )


def executor() -> ExecutorDefinition:
    """k8s_job_executor when DAGSTER_RL_EXECUTOR=k8s: the driver's step runs in its own small pod,
    shaped by the experiment's `driver_pod` (the op's `dagster-k8s/config` tag); else the multiprocess
    executor. Either way the executor also holds each experiment's pool to one run at a time and
    watches the runs holding it (`assets.concurrency`)."""
    value = os.environ.get(EXECUTOR, "")
    if value not in ("", "k8s", "in_process"):
        raise SettingError(f"{EXECUTOR}={value!r}: use k8s, or leave it unset")
    return experiment_k8s_executor if value == "k8s" else experiment_executor
