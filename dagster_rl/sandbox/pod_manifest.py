"""The sandbox tier's pods: their settings (`PodSandboxSettings`) and their manifest (`sandbox_pod`).

A sandbox pod runs nothing of its own: its one container's process is a tiny init (`INIT`, PID 1 of
the container: it reaps orphans and waits) and every program is exec'd into it by the driver
(`dagster_rl.sandbox.pods`). What the pod is allowed:

    account        automountServiceAccountToken false, and an account bound to no Role
    network        labels the deny-all NetworkPolicy selects (deploy/k8s/sandbox.yaml)
    runtime        runtimeClassName (gVisor `gvisor`/`runsc`, Kata) when set; empty: the cluster's default
    user           runAsNonRoot, a fixed uid/gid, no privilege escalation, every capability dropped,
                   seccomp RuntimeDefault, a read-only root filesystem, no host namespaces,
                   enableServiceLinks false (no other Service's address in its environment)
    files          /work: an emptyDir with a sizeLimit (memory-backed by default: writes past the size
                   fail with ENOSPC, where a disk-backed one is evicted by the kubelet, pod and episode
                   with it); /tmp: a memory-backed emptyDir with a sizeLimit
    resources      requests and limits of the tier (500m CPU and 1 GiB by default)
    lifetime       activeDeadlineSeconds (a backstop: the driver deletes the pod when the episode
                   ends), labels naming the driver that owns it, an owner reference to the driver's
                   own pod when the driver runs in one (deleted with it)

How the experiment's `SandboxLimits` map onto the pod (`check_limits`): `memory_mb` stays each
process's address space (RLIMIT_AS, as on a laptop); the pod's memory limit bounds all of an
episode's processes together with its memory-backed folders, so it must hold one program of
`memory_mb` plus /tmp, /work (when in memory) and `OVERHEAD_MIB` for the init and the launcher. A
program that goes past the pod's limit is killed by the kernel's OOM killer, which the launcher
sees in the container's cgroup: the call ends as `memory`. `cpu_s` stays CPU seconds (RLIMIT_CPU);
the pod's CPU limit is a rate, so a program that may use `cpu_s` needs `cpu_s / cpu_limit`
seconds of wall time: `wall_s` must allow that, or the wall backstop would end what the CPU limit
should. `processes` stays RLIMIT_NPROC (plus the init and the launcher), which the kernel counts
per user: without a per-pod kernel (gVisor, Kata) or user namespaces (`host_users: false`) every
pod of the same uid on a node counts together.
"""

import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, field_validator

from dagster_rl.base.strict import Strict
from dagster_rl.runtime.pods import QUANTITY, Toleration
from dagster_rl.sandbox.limits import SandboxLimits
from dagster_rl.sandbox.outcomes import WORK

APP_LABELS = {"app.kubernetes.io/name": "dagster-rl", "app.kubernetes.io/component": "sandbox"}  # the NetworkPolicy's selector
OWNER_LABEL = "dagster-rl/sandbox-owner"  # who made the pod: the driver's pod uid, or host-pid-start of a driver off the cluster
OWNER_POD = "dagster-rl/sandbox-owner-pod"  # annotation: the driver's pod name, when it runs in one
CONTAINER = "sandbox"
OVERHEAD_MIB = 64  # the init and the launcher (two small interpreters), in the pod's memory
MAX_POOL = 256

# PID 1 of a sandbox pod's container: not dumpable (no process of the sandbox's user may ptrace it
# or write its memory, and kill(-1) never reaches PID 1), reaps the orphans a call's cleanup leaves.
# It handles no signal: the kernel then drops every signal a process of its own PID namespace sends
# it, SIGKILL included, and the runtime's SIGKILL (a deleted pod) still ends it. Standard library
# only; a line to the pod's log says whether prctl took.
INIT = """import os, signal
try:
    import ctypes
    dumpable = ctypes.CDLL(None).prctl(4, 0, 0, 0, 0) != 0
except Exception:
    dumpable = True
print("dagster-rl sandbox init: dumpable" if dumpable else "dagster-rl sandbox init: ready", flush=True)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
while True:
    signal.sigtimedwait({signal.SIGCHLD}, 5)
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
"""


def quantity(text: str, what: Literal["bytes", "cores"]) -> float:
    """A Kubernetes quantity as a number of bytes or cores ('1Gi' -> 1073741824, '500m' -> 0.5)."""
    match = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?", text)
    if match is None:
        raise ValueError(f"{text!r} is not a Kubernetes quantity (e.g. '500m', '1Gi')")
    number, suffix = float(match.group(1)), match.group(2) or ""
    scale = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
    scale |= {f"{p}i": 1024.0 ** (i + 1) for i, p in enumerate("KMGTPE")}
    value = number * scale[suffix]
    return value if what == "cores" else float(int(value))


class PodSandboxSettings(Strict):
    """Where and how the sandbox tier's pods run on Kubernetes (the `k8s` placement)."""

    namespace: str = Field("", description="empty: the namespace this process runs in, else 'default'")
    image: str = Field("", description="an image with a python3 (the deployment's own, as the trainer pods'); required")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    image_pull_secrets: tuple[str, ...] = ()
    python: str = Field("python3", description="the image's interpreter (a name on its PATH, or a path)")
    runtime_class_name: str = Field(
        "", description="gVisor (`gvisor`, `runsc`) or Kata where the cluster has one; empty: default"
    )
    service_account: str = Field("dagster-rl-sandbox", description="an account bound to no Role (deploy/k8s/sandbox.yaml)")
    cpu_request: str = Field("500m", description="CPU request of a sandbox pod")
    cpu_limit: str | None = Field("500m", description="CPU limit (a rate); None: none")
    memory_request: str = Field("1Gi", description="memory request of a sandbox pod")
    memory_limit: str = Field("1Gi", description="memory limit: every process of the episode and its in-memory folders")
    workspace_size: str = Field("128Mi", description="the sizeLimit of /work, the episode's folder")
    workspace_medium: Literal["Memory", "Disk"] = Field(
        "Memory", description="Memory: a full /work fails writes (ENOSPC); Disk: the kubelet evicts the pod"
    )
    tmp_size: str = Field("16Mi", description="the sizeLimit of /tmp (always in memory)")
    run_as_user: int = Field(65534, ge=1, le=2**31 - 1, description="the sandbox's uid (never 0)")
    run_as_group: int = Field(65534, ge=1, le=2**31 - 1)
    host_users: bool | None = Field(None, description="false: a user namespace per pod (Kubernetes >= 1.30, runtime support)")
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: tuple[Toleration, ...] = ()
    labels: dict[str, str] = Field(default_factory=dict, description="added to every sandbox pod")
    pool_size: int = Field(2, ge=0, le=MAX_POOL, description="pods started ahead, each for one episode, never reused")
    startup_timeout_s: float = Field(300.0, gt=0, le=86_400, description="a pod not running by then is SandboxUnavailable")
    active_deadline_s: int = Field(3600, ge=60, le=7 * 86_400, description="a pod's longest life (the backstop of cleanup)")
    slot_timeout_s: float = Field(600.0, gt=0, le=86_400, description="how long an episode waits for a free slot")
    exec_grace_s: float = Field(15.0, gt=0, le=3600, description="past a call's wall limit, the driver stops it itself")
    poll_interval_s: float = Field(0.5, gt=0, le=60)

    @field_validator("cpu_request", "cpu_limit", "memory_request", "memory_limit", "workspace_size", "tmp_size")
    @classmethod
    def _quantity(cls, v: str | None) -> str | None:
        if v is not None and not QUANTITY.match(v):
            raise ValueError(f"{v!r} is not a Kubernetes quantity (e.g. '500m', '1Gi')")
        return v

    def memory_for_programs_mib(self) -> int:
        """What the pod's memory limit leaves for programs once its in-memory folders are full."""
        held = quantity(self.tmp_size, "bytes") + (
            quantity(self.workspace_size, "bytes") if self.workspace_medium == "Memory" else 0
        )
        return int((quantity(self.memory_limit, "bytes") - held) // (1 << 20)) - OVERHEAD_MIB

    def check_limits(self, limits: SandboxLimits) -> None:
        """A `ValueError` saying what to change when `limits` do not fit these pods (see the module)."""
        room = self.memory_for_programs_mib()
        if limits.memory_mb > room:
            raise ValueError(
                f"the sandbox limits' memory_mb {limits.memory_mb} does not fit a sandbox pod: its memory_limit "
                f"{self.memory_limit} leaves {room} MiB after /tmp ({self.tmp_size}), /work ({self.workspace_size}, "
                f"{self.workspace_medium}) and {OVERHEAD_MIB} MiB for the launcher: lower memory_mb or raise memory_limit"
            )
        if self.cpu_limit is not None and limits.wall_s < limits.cpu_s / quantity(self.cpu_limit, "cores"):
            raise ValueError(
                f"the sandbox limits' wall_s {limits.wall_s:g} is shorter than cpu_s {limits.cpu_s:g} takes at the pod's "
                f"cpu_limit {self.cpu_limit} ({limits.cpu_s / quantity(self.cpu_limit, 'cores'):g} s): the wall backstop "
                "would end what the CPU limit should; raise wall_s or the cpu_limit"
            )
        if limits.folder_mb << 20 > quantity(self.workspace_size, "bytes"):
            raise ValueError(
                f"the sandbox limits' folder_mb {limits.folder_mb} is more than a sandbox pod's /work holds "
                f"({self.workspace_size}): lower folder_mb or raise workspace_size"
            )


@dataclass(frozen=True)
class Owner:
    """The driver that makes sandbox pods: `id` labels them; `pod` and `uid` name the driver's own pod
    when it runs in one (the owner reference, and how a later driver tells that it is gone)."""

    id: str
    pod: str = ""
    uid: str = ""


def sandbox_pod(settings: PodSandboxSettings, name: str, namespace: str, owner: Owner) -> dict[str, Any]:
    """The manifest of one sandbox pod."""
    if not settings.image:
        raise ValueError("a sandbox pod needs an image with a python3: set the sandbox tier's image")
    resources: dict[str, dict[str, str]] = {
        "requests": {"cpu": settings.cpu_request, "memory": settings.memory_request},
        "limits": {"memory": settings.memory_limit},
    }
    if settings.cpu_limit is not None:
        resources["limits"]["cpu"] = settings.cpu_limit
    work: dict[str, Any] = {"sizeLimit": settings.workspace_size}
    if settings.workspace_medium == "Memory":
        work["medium"] = "Memory"
    container = {
        "name": CONTAINER,
        "image": settings.image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": [settings.python, "-I", "-S", "-c", INIT],
        "workingDir": WORK,
        "resources": resources,
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "privileged": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [{"name": "work", "mountPath": WORK}, {"name": "tmp", "mountPath": "/tmp"}],
    }
    spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "hostNetwork": False,
        "hostPID": False,
        "hostIPC": False,
        "restartPolicy": "Never",
        "activeDeadlineSeconds": settings.active_deadline_s,
        "terminationGracePeriodSeconds": 1,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": settings.run_as_user,
            "runAsGroup": settings.run_as_group,
            "fsGroup": settings.run_as_group,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": [
            {"name": "work", "emptyDir": work},
            {"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": settings.tmp_size}},
        ],
    }
    if settings.service_account:
        spec["serviceAccountName"] = settings.service_account
    if settings.runtime_class_name:
        spec["runtimeClassName"] = settings.runtime_class_name
    if settings.host_users is not None:
        spec["hostUsers"] = settings.host_users
    if settings.node_selector:
        spec["nodeSelector"] = dict(settings.node_selector)
    if settings.tolerations:
        spec["tolerations"] = [t.manifest() for t in settings.tolerations]
    if settings.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": s} for s in settings.image_pull_secrets]
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "labels": {**settings.labels, **APP_LABELS, OWNER_LABEL: owner.id},
    }
    if owner.pod:
        metadata["annotations"] = {OWNER_POD: owner.pod}
    if owner.pod and owner.uid:
        metadata["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "Pod", "name": owner.pod, "uid": owner.uid, "blockOwnerDeletion": False}
        ]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def label_value(text: str) -> str:
    """`text` as a valid label value: at most 63 of [A-Za-z0-9_.-], starting and ending alphanumeric."""
    value = re.sub(r"[^A-Za-z0-9_.-]", "-", text)[:63].strip("-_.")
    return value or "unknown"
