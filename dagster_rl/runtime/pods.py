"""What a set of pods needs and runs: the records between a backend that wants N pods (the trainer's
`k8s` backend) and the launcher that places them on a cluster (`resources.PipesK8sJobLauncher`).

An experiment declares what its pods need (`PodResources`: cpu, memory, GPUs, node selector,
tolerations, shared memory); a backend asks for a `PodJob` (N pods running one command, whole-set
restarts, a deadline); the launcher adds where they run (namespace, image, service account, shared
storage: `dagster_rl.runtime.k8s_manifests.ClusterSettings`).
"""

import re
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import Field, field_validator

from dagster_rl.base.bounds import MAX_DEADLINE_S, MAX_NODES, MAX_RESTARTS, MAX_STEPS, NODE_GPUS
from dagster_rl.base.strict import Strict
from dagster_rl.runtime.workers import Workers

# A Kubernetes quantity: 4, 500m, 0.5, 24Gi, 8G ...
QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
COMPLETION_INDEX = "JOB_COMPLETION_INDEX"  # set by Kubernetes in every pod of an Indexed Job
MASTER_ADDR, MASTER_PORT = "MASTER_ADDR", "MASTER_PORT"  # pod 0's address (<job>-0.<service>) and port


class Toleration(Strict):
    key: str = Field("", description="the taint's key; empty with Exists: every taint")
    operator: Literal["Equal", "Exists"] = Field("Equal", description="Equal: the value must match; Exists: any value")
    value: str = Field("", description="the taint's value (with Equal)")
    effect: Literal["", "NoSchedule", "PreferNoSchedule", "NoExecute"] = Field(
        "", description="the taint's effect; empty: every effect"
    )

    def manifest(self) -> dict[str, str]:
        return {k: v for k, v in self.model_dump().items() if v}


class PodResources(Strict):
    """What one pod of a tier needs. `cpu`/`memory` are requests (memory is also the limit), `gpu`
    GPUs of `gpu_resource` are the limit; `shm_size` mounts a memory-backed /dev/shm of that size
    (NCCL and data loaders need more than the container default of 64 MiB)."""

    cpu: str | None = Field(None, description="CPU request, e.g. '4' or '500m'")
    memory: str | None = Field(None, description="memory request and limit, e.g. '24Gi'")
    gpu: int = Field(0, ge=0, le=NODE_GPUS, description="GPUs per pod (a limit of gpu_resource)")
    gpu_resource: str = Field("nvidia.com/gpu", description="the extended resource that counts GPUs")
    node_selector: dict[str, str] = Field(default_factory=dict, description="node labels the pod must match")
    tolerations: tuple[Toleration, ...] = Field((), description="taints the pod tolerates")
    shm_size: str | None = Field(None, description="size of a memory-backed /dev/shm, e.g. '8Gi'")
    image: str | None = Field(None, description="this tier's image; default: the launcher's")
    env_from_secrets: tuple[str, ...] = Field((), description="Secrets whose keys become environment variables")

    @field_validator("cpu", "memory", "shm_size")
    @classmethod
    def _quantity(cls, v: str | None) -> str | None:
        if v is not None and not QUANTITY.match(v):
            raise ValueError(f"{v!r} is not a Kubernetes quantity (e.g. '4', '500m', '24Gi')")
        return v

    def container_resources(self) -> dict[str, dict[str, Any]]:
        requests = {k: v for k, v in (("cpu", self.cpu), ("memory", self.memory)) if v}
        limits: dict[str, Any] = {"memory": self.memory} if self.memory else {}
        if self.gpu:
            limits[self.gpu_resource] = self.gpu
        return {k: v for k, v in (("requests", requests), ("limits", limits)) if v}

    def dagster_k8s_config(self) -> dict[str, Any]:
        """The `dagster-k8s/config` tag of an op whose step pod (k8s_job_executor) has these needs."""
        pod: dict[str, Any] = {}
        if self.node_selector:
            pod["node_selector"] = dict(self.node_selector)
        if self.tolerations:
            pod["tolerations"] = [t.manifest() for t in self.tolerations]
        config: dict[str, Any] = {"container_config": {"resources": self.container_resources()}}
        if pod:
            config["pod_spec_config"] = pod
        return config


class PodJob(Strict):
    """`nodes` pods that each run `command` once, as one set: if any pod fails the whole set is
    restarted (up to `max_restarts` times); the set fails after `active_deadline_s`. The command may
    name $(JOB_COMPLETION_INDEX) (the pod's index, 0..nodes-1), $(MASTER_ADDR) and $(MASTER_PORT)
    (pod 0's address and the rendezvous port): Kubernetes expands them from the pod's environment."""

    name: str = Field(description="a hint for the Job's name (the launcher makes it unique and valid)")
    nodes: int = Field(ge=1, le=MAX_NODES)
    command: tuple[str, ...]
    env: dict[str, str] = Field(default_factory=dict)
    resources: PodResources = PodResources()
    max_restarts: int = Field(0, ge=0, le=MAX_RESTARTS)
    active_deadline_s: int = Field(3600, ge=1, le=MAX_DEADLINE_S * MAX_STEPS)  # a session's Job: a range of steps' deadlines
    port: int = Field(29500, ge=1, le=65535)


class PodLauncher(Protocol):
    """Places a `PodJob` on a cluster: `run` waits for it to end; `start` returns once its pods run
    and leaves them running (a session's workers). `workdir` is a folder on storage that this
    process and the pods read and write at the same path (where a backend puts the pods' inputs)."""

    @property
    def workdir(self) -> Path: ...

    def run(self, job: PodJob) -> None: ...

    def start(self, job: PodJob) -> Workers: ...
