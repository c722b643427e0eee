"""A FAKE of the Kubernetes API: the part of `BatchV1Api` and `CoreV1Api` that dagster-k8s and
`resources.PipesK8sJobLauncher` call, backed by a tiny in-memory cluster whose pods are local
processes. It is not Kubernetes; it plays the parts the launcher depends on:

- an API server that validates every object it is sent (kubernetes-validate, strict, 1.33);
- a Job controller for Indexed Jobs: pods <job>-<i>-<random> with the Job's labels plus job-name
  and batch.kubernetes.io/job-completion-index, hostname <job>-<i>, the Job's subdomain; with
  backoffLimit 0 the first failed pod fails the Job and its other pods are killed;
- a kubelet: the container's env (values, and the completion-index fieldRef), $(VAR) expansion of
  the command, the process's output as the pod's log (timestamped, followable), its exit code as
  the container's terminated state;
- cluster DNS and networking, the only places it bends: pod 0's name <job>-0.<service> resolves to
  127.0.0.1 only if a Service of that name selects the pod (as cluster DNS would), and every Job
  gets its own free port for MASTER_PORT, since all "pods" share this machine's network.

- the Job controller's own clock: `activeDeadlineSeconds` fails a Job (reason DeadlineExceeded) and
  kills its pods when it passes, whether or not anyone reads the Job;
- RBAC, when given `rbac=(account, rules)`: every call is authorized against the rules of the Role
  bound to that account (403 Forbidden otherwise, worded as the API server words it);
- plain Jobs too (the `k8s_job_executor`'s step Jobs: one pod, command and args from the container);
- standalone pods (the sandbox tier's) and their pods/exec websocket (`tests.fake_pods`): `.pods`,
  and `clients()`, CoreV1Apis that reach them over HTTP, REST and exec (RBAC enforced there too).

Hooks for failure tests: `crash` = {(job number, pod index)} runs a failing command in those pods;
`stalled_logs` = {pod index}: a followed log of such a pod never ends, even after its container
exits (a stalled stream); `on_job_status(job_name)` is called on each Job status read;
`on_log_follow(pod_name)` when a pod's log is followed. `index_label=False` plays a cluster older
than Kubernetes 1.28, whose Job controller puts the completion index on pods as an annotation only.
"""

import functools
import inspect
import itertools
import json
import os
import random
import signal
import string
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import kubernetes_validate
from kubernetes.client import (
    ApiClient,
    ApiException,
    V1Container,
    V1ContainerState,
    V1ContainerStateRunning,
    V1ContainerStateTerminated,
    V1ContainerStatus,
    V1Job,
    V1JobCondition,
    V1JobStatus,
    V1ObjectMeta,
    V1Pod,
    V1PodSpec,
    V1PodStatus,
)

from dagster_rl.runtime.k8s_manifests import INDEX_LABEL, expand
from dagster_rl.runtime.lifetime import children
from dagster_rl.runtime.pods import MASTER_ADDR, MASTER_PORT
from tests import REPO
from tests.fake_pods import StandalonePods, fake_clients
from tests.machine import free_port

K8S_VERSION = "1.33.0"


def validate(obj: dict) -> None:
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _parse_selector(text: str | None) -> dict[str, str]:
    return dict(part.split("=", 1) for part in text.split(",")) if text else {}


# What each call of the fake needs, in RBAC terms: (API group, resource, verb).
PERMISSION = {
    "create_namespaced_job": ("batch", "jobs", "create"),
    "list_namespaced_job": ("batch", "jobs", "list"),
    "read_namespaced_job": ("batch", "jobs", "get"),
    "read_namespaced_job_status": ("batch", "jobs/status", "get"),
    "delete_namespaced_job": ("batch", "jobs", "delete"),
    "create_namespaced_service": ("", "services", "create"),
    "patch_namespaced_service": ("", "services", "patch"),
    "delete_namespaced_service": ("", "services", "delete"),
    "create_namespaced_pod": ("", "pods", "create"),
    "read_namespaced_pod": ("", "pods", "get"),
    "patch_namespaced_pod": ("", "pods", "patch"),
    "list_namespaced_pod": ("", "pods", "list"),
    "read_namespaced_pod_log": ("", "pods/log", "get"),
    "delete_namespaced_pod": ("", "pods", "delete"),
    "list_namespaced_event": ("", "events", "list"),
    "create_namespaced_network_policy": ("networking.k8s.io", "networkpolicies", "create"),
    "patch_namespaced_network_policy": ("networking.k8s.io", "networkpolicies", "patch"),
    "delete_namespaced_network_policy": ("networking.k8s.io", "networkpolicies", "delete"),
}


def _forbidden(account: str, namespace: str, group: str, resource: str, verb: str) -> ApiException:
    """The 403 the API server answers, worded as it words it."""
    kind, _, sub = resource.partition("/")
    what = f'resource "{kind}"' + (f' subresource "{sub}"' if sub else "")
    message = (
        f'{resource} is forbidden: User "{account}" cannot {verb} {what} in API group "{group}" in the namespace "{namespace}"'
    )
    error = ApiException(status=403, reason="Forbidden")
    error.body = json.dumps({"kind": "Status", "status": "Failure", "reason": "Forbidden", "code": 403, "message": message})
    return error


def allows(rules: list[dict], group: str, resource: str, verb: str) -> bool:
    """Whether a Role's rules allow `verb` on `resource` of API `group` (RBAC is additive)."""
    return any(
        (group in rule.get("apiGroups", []) or "*" in rule.get("apiGroups", []))
        and (resource in rule.get("resources", []) or "*" in rule.get("resources", []))
        and (verb in rule.get("verbs", []) or "*" in rule.get("verbs", []))
        for rule in rules
    )


@dataclass
class FakePod:
    name: str
    namespace: str
    labels: dict[str, str]
    annotations: dict[str, str]
    spec: dict[str, Any]
    job: str
    index: int
    proc: subprocess.Popen | None = None
    lines: list[str] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    killed: bool = False

    @property
    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def model(self) -> V1Pod:
        container = self.spec["containers"][0]
        rc = self.exit_code if self.done.is_set() else None
        if rc is None:
            state, phase = V1ContainerState(running=V1ContainerStateRunning(started_at=datetime.now(UTC))), "Running"
        else:
            reason = "Completed" if rc == 0 else "Error"
            state = V1ContainerState(terminated=V1ContainerStateTerminated(exit_code=rc, reason=reason, message=None))
            phase = "Succeeded" if rc == 0 else "Failed"
        status = V1ContainerStatus(
            name=container["name"], image=container["image"], image_id="fake", ready=rc is None, restart_count=0, state=state
        )
        return V1Pod(
            metadata=V1ObjectMeta(
                name=self.name, namespace=self.namespace, labels=dict(self.labels), annotations=dict(self.annotations)
            ),
            spec=V1PodSpec(containers=[V1Container(name=container["name"], image=container["image"])]),
            status=V1PodStatus(phase=phase, container_statuses=[status], init_container_statuses=None),
        )


@dataclass
class FakeJob:
    manifest: dict[str, Any]
    number: int
    uid: str
    created: float
    pods: list[FakePod] = field(default_factory=list)
    failed_reason: str | None = None

    @property
    def name(self) -> str:
        return self.manifest["metadata"]["name"]

    def status(self) -> V1JobStatus:
        codes = [p.exit_code if p.done.is_set() else None for p in self.pods]
        conditions = None
        if self.failed_reason is not None:
            conditions = [V1JobCondition(type="Failed", status="True", reason=self.failed_reason)]
        return V1JobStatus(
            active=sum(c is None for c in codes) or None,
            succeeded=sum(c == 0 for c in codes) or None,
            failed=sum(c not in (None, 0) for c in codes) or None,
            conditions=conditions,
        )


class FakeKubernetes:
    """The fake cluster; `.batch` and `.core` are its BatchV1Api and CoreV1Api."""

    def __init__(
        self,
        extra_path: str = str(Path(sys.executable).parent),
        rbac: tuple[str, list[dict]] | None = None,
        index_label: bool = True,
    ):
        self.rbac = rbac  # (the caller's service account, the rules bound to it); None: no RBAC
        self.denied: list[tuple[str, str, str]] = []  # (group, resource, verb) refused, in order
        self.index_label = index_label
        self.stalled_logs: set[int] = set()
        self.jobs: dict[tuple[str, str], FakeJob] = {}
        self.services: dict[tuple[str, str], dict[str, Any]] = {}
        self.network_policies: dict[tuple[str, str], dict[str, Any]] = {}
        self.deleted_pods: list[FakePod] = []
        self.orphans: dict[tuple[str, str], FakePod] = {}  # pods of deleted Jobs, not deleted yet
        self.calls: list[tuple[str, str]] = []  # (verb, object name), in order
        self.crash: set[tuple[int, int]] = set()
        self.on_job_status: Callable[[str], None] | None = None
        self.on_log_follow: Callable[[str], None] | None = None
        self.extra_path = extra_path
        self.pods = StandalonePods(validate, self._denial)
        self._numbers = itertools.count()
        self._lock = threading.RLock()
        self._closed = threading.Event()
        self.batch = SimpleNamespace(
            **{name: self._authorized(name) for name in PERMISSION if name.endswith("_job") or "_job_" in name}
        )
        self.networking = SimpleNamespace(**{name: self._authorized(name) for name in PERMISSION if "network_policy" in name})
        self.core = SimpleNamespace(
            **{
                name: self._authorized(name)
                for name in PERMISSION
                if name not in vars(self.batch) and "network_policy" not in name
            }
        )
        self.pods.api = self.core  # what the pods' REST calls over HTTP reach
        threading.Thread(target=self._job_controller, name="fake-job-controller", daemon=True).start()

    def _denial(self, namespace: str, group: str, resource: str, verb: str) -> str:
        """Why RBAC refuses the call ("" when it allows it), worded as the API server words it."""
        if self.rbac is None or allows(self.rbac[1], group, resource, verb):
            return ""
        self.denied.append((group, resource, verb))
        return json.loads(_forbidden(self.rbac[0], namespace, group, resource, verb).body)["message"]

    def clients(self) -> functools.partial:
        """What `PodSandboxes(clients=...)` takes: the fake API server's pods over HTTP (REST and exec,
        RBAC enforced), picklable into other processes."""
        return functools.partial(fake_clients, self.pods.exec_url())

    def _authorized(self, name: str) -> Callable:
        """The API server's authorization in front of a call: RBAC against the caller's Role."""
        method = getattr(self, name)
        group, resource, verb = PERMISSION[name]

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.rbac is not None and not allows(self.rbac[1], group, resource, verb):
                self.denied.append((group, resource, verb))
                namespace = inspect.signature(method).bind(*args, **kwargs).arguments.get("namespace", "default")
                raise _forbidden(self.rbac[0], namespace, group, resource, verb)
            return method(*args, **kwargs)

        return call

    def list_namespaced_event(self, namespace: str, **_: Any):
        return SimpleNamespace(items=[])

    # ---- what is left ----------------------------------------------------------------------------
    def objects(self) -> dict[str, list[str]]:
        """The Jobs, Services, NetworkPolicies and pods that still exist."""
        with self._lock:
            return {
                "jobs": [n for (_, n) in self.jobs],
                "services": [n for (_, n) in self.services],
                "networkpolicies": [n for (_, n) in self.network_policies],
                "pods": [p.name for j in self.jobs.values() for p in j.pods]
                + [n for (_, n) in self.orphans]
                + [n for (_, n) in self.pods.pods],
            }

    def running_processes(self) -> list[str]:
        with self._lock:
            pods = [p for j in self.jobs.values() for p in j.pods] + list(self.orphans.values()) + self.deleted_pods
            return [p.name for p in pods if p.proc is not None and p.proc.poll() is None] + self.pods.running()

    def close(self) -> None:
        self._closed.set()
        self.pods.close()
        with self._lock:
            for pod in [p for j in self.jobs.values() for p in j.pods] + list(self.orphans.values()) + self.deleted_pods:
                self._kill(pod)

    # ---- services ------------------------------------------------------------------------------
    def _admit(self, kind: str, namespace: str, body: dict, existing: dict) -> str:
        """The API server's part of a create: validate, record, refuse a name that exists."""
        validate(body)
        name = body["metadata"]["name"]
        self.calls.append(("create", f"{kind}/{name}"))
        if (namespace, name) in existing:
            raise ApiException(status=409, reason="AlreadyExists")
        return name

    def create_namespaced_service(self, namespace: str, body: dict, **_: Any) -> dict:
        with self._lock:
            name = self._admit("service", namespace, body, self.services)
            self.services[(namespace, name)] = body
        return body

    def patch_namespaced_service(self, name: str, namespace: str, body: dict, **_: Any) -> dict:
        with self._lock:
            self.calls.append(("patch", f"service/{name}"))
            svc = self.services[(namespace, name)]
            svc["metadata"].update(body["metadata"])
            validate(svc)
            return svc

    def delete_namespaced_service(self, name: str, namespace: str, **_: Any) -> None:
        with self._lock:
            self.calls.append(("delete", f"service/{name}"))
            if self.services.pop((namespace, name), None) is None:
                raise ApiException(status=404, reason="NotFound")

    # ---- network policies ---------------------------------------------------------------------
    def create_namespaced_network_policy(self, namespace: str, body: dict, **_: Any) -> dict:
        with self._lock:
            name = self._admit("networkpolicy", namespace, body, self.network_policies)
            self.network_policies[(namespace, name)] = body
        return body

    def patch_namespaced_network_policy(self, name: str, namespace: str, body: dict, **_: Any) -> dict:
        with self._lock:
            self.calls.append(("patch", f"networkpolicy/{name}"))
            policy = self.network_policies[(namespace, name)]
            policy["metadata"].update(body["metadata"])
            validate(policy)
            return policy

    def delete_namespaced_network_policy(self, name: str, namespace: str, **_: Any) -> None:
        with self._lock:
            self.calls.append(("delete", f"networkpolicy/{name}"))
            if self.network_policies.pop((namespace, name), None) is None:
                raise ApiException(status=404, reason="NotFound")

    # ---- jobs ----------------------------------------------------------------------------------
    def create_namespaced_job(self, body: dict | V1Job, namespace: str, **_: Any) -> V1Job:
        if not isinstance(body, dict):  # a V1Job model (dagster-k8s's step Jobs): what the client sends
            body = ApiClient().sanitize_for_serialization(body)
        with self._lock:
            name = self._admit("job", namespace, body, self.jobs)
            job = FakeJob(body, next(self._numbers), str(uuid.uuid4()), time.monotonic())
            self.jobs[(namespace, name)] = job
            port = str(free_port())  # every Job its own port: all "pods" share this machine's network
            job.pods = [self._make_pod(job, namespace, index) for index in range(body["spec"].get("completions") or 1)]
            for pod in job.pods:
                self._start(job, pod, port)
        return V1Job(metadata=V1ObjectMeta(name=name, namespace=namespace, uid=job.uid))

    def list_namespaced_job(self, namespace: str, field_selector: str | None = None, **_: Any):
        name = (field_selector or "").removeprefix("metadata.name=")
        with self._lock:
            jobs = [j for (ns, n), j in self.jobs.items() if ns == namespace and (not name or n == name)]
            return SimpleNamespace(
                items=[V1Job(metadata=V1ObjectMeta(name=j.name, uid=j.uid), status=self._status(j)) for j in jobs]
            )

    def read_namespaced_job(self, name: str, namespace: str, **_: Any) -> V1Job:
        with self._lock:
            job = self.jobs.get((namespace, name))
            if job is None:
                raise ApiException(status=404, reason="NotFound")
            return V1Job(metadata=V1ObjectMeta(name=name, namespace=namespace, uid=job.uid), status=self._status(job))

    def read_namespaced_job_status(self, name: str, namespace: str, **_: Any) -> V1Job:
        if self.on_job_status is not None:
            self.on_job_status(name)
        with self._lock:
            job = self.jobs.get((namespace, name))
            if job is None:
                raise ApiException(status=404, reason="NotFound")
            return V1Job(metadata=V1ObjectMeta(name=name, uid=job.uid), status=self._status(job))

    def _job_controller(self) -> None:
        """The Job controller's own clock: deadlines pass whether or not anyone reads the Job."""
        while not self._closed.wait(0.2):
            with self._lock:
                for job in list(self.jobs.values()):
                    self._status(job)

    def delete_namespaced_job(self, name: str, namespace: str, **_: Any) -> None:
        with self._lock:
            self.calls.append(("delete", f"job/{name}"))
            job = self.jobs.pop((namespace, name), None)
            if job is None:
                raise ApiException(status=404, reason="NotFound")
            # the Job's pods stay until deleted themselves (the API's default propagation for a Job: orphan)
            self.orphans.update({(namespace, p.name): p for p in job.pods})

    def _status(self, job: FakeJob) -> V1JobStatus:
        """The Job controller: backoffLimit 0 (and activeDeadlineSeconds) fail the Job and kill its pods."""
        status = job.status()
        deadline = job.manifest["spec"].get("activeDeadlineSeconds")
        if job.failed_reason is None and status.failed and job.manifest["spec"].get("backoffLimit", 6) == 0:
            job.failed_reason = "BackoffLimitExceeded"
        if job.failed_reason is None and deadline and time.monotonic() - job.created > deadline:
            job.failed_reason = "DeadlineExceeded"
        if job.failed_reason is not None:
            for pod in job.pods:
                self._kill(pod)
            status = job.status()
        return status

    # ---- pods ----------------------------------------------------------------------------------
    def _all_pods(self, namespace: str) -> list[FakePod]:
        pods = [p for (ns, _), j in self.jobs.items() if ns == namespace for p in j.pods]
        return pods + [p for (ns, _), p in self.orphans.items() if ns == namespace]

    def list_namespaced_pod(self, namespace: str, field_selector: str | None = None, label_selector: str | None = None, **_: Any):
        name = (field_selector or "").removeprefix("metadata.name=")
        selector = _parse_selector(label_selector)
        with self._lock:
            for job in self.jobs.values():
                self._status(job)
            pods = [p for p in self._all_pods(namespace) if (not name or p.name == name) and _selects(selector, p.labels)]
            alone = [p for p in self.pods.in_namespace(namespace) if (not name or p.name == name)]
            alone_models = [self.pods.read(namespace, p.name) for p in alone]
            return SimpleNamespace(
                items=[p.model() for p in pods] + [m for m in alone_models if _selects(selector, m.metadata.labels or {})]
            )

    def create_namespaced_pod(self, namespace: str, body: dict, **_: Any) -> V1Pod:
        self.calls.append(("create", f"pod/{body['metadata']['name']}"))
        return self.pods.create(namespace, body)

    def read_namespaced_pod(self, name: str, namespace: str, **_: Any) -> V1Pod:
        return self.pods.read(namespace, name)

    def patch_namespaced_pod(self, name: str, namespace: str, body: dict, **_: Any) -> V1Pod:
        self.calls.append(("patch", f"pod/{name}"))
        return self.pods.patch(namespace, name, body)

    def delete_namespaced_pod(self, name: str, namespace: str, **_: Any) -> None:
        with self._lock:
            self.calls.append(("delete", f"pod/{name}"))
            pod = self.orphans.pop((namespace, name), None)
            if pod is None:
                if self.pods.delete(namespace, name):
                    return
                raise ApiException(status=404, reason="NotFound")
            self._kill(pod)
            self.deleted_pods.append(pod)

    def read_namespaced_pod_log(self, name: str, namespace: str, follow: bool = False, tail_lines: int | None = None, **kw: Any):
        with self._lock:
            pod = next((p for p in self._all_pods(namespace) if p.name == name), None)
        if pod is None:
            raise ApiException(status=404, reason="NotFound")
        if not follow:
            lines = pod.lines[-tail_lines:] if tail_lines else list(pod.lines)
            return SimpleNamespace(data="".join(f"{line}\n" for line in lines).encode())
        if self.on_log_follow is not None:
            self.on_log_follow(name)
        return self._follow(pod, timestamps=bool(kw.get("timestamps")))

    def _follow(self, pod: FakePod, timestamps: bool):
        sent = 0
        while True:
            finished = (pod.done.is_set() and pod.index not in self.stalled_logs) or self._closed.is_set()
            lines = pod.lines[sent:]
            for line in lines:
                yield (line if timestamps else line.split(" ", 1)[1]).encode() + b"\n"
            sent += len(lines)
            if finished and sent == len(pod.lines):
                return
            time.sleep(0.05)

    # ---- the kubelet ---------------------------------------------------------------------------
    def _make_pod(self, job: FakeJob, namespace: str, index: int) -> FakePod:
        template = job.manifest["spec"]["template"]
        suffix = "".join(random.choices(string.ascii_lowercase + string.digits, k=5))
        labels = {**template["metadata"].get("labels", {}), "job-name": job.name, "batch.kubernetes.io/job-name": job.name}
        if self.index_label:  # Kubernetes >= 1.28 labels pods with their index too; before, the annotation only
            labels[INDEX_LABEL] = str(index)
        return FakePod(
            f"{job.name}-{index}-{suffix}", namespace, labels, {INDEX_LABEL: str(index)}, template["spec"], job.name, index
        )

    def _start(self, job: FakeJob, pod: FakePod, port: str) -> None:
        container = pod.spec["containers"][0]
        env = {e["name"]: self._env_value(e, pod) for e in container.get("env", [])}
        env[MASTER_ADDR] = self._resolve(pod.namespace, env.get(MASTER_ADDR, ""))
        env[MASTER_PORT] = port
        command = [expand(part, env) for part in container.get("command", []) + container.get("args", [])]
        if (job.number, pod.index) in self.crash:
            command = [sys.executable, "-c", "import sys; print('node lost', flush=True); sys.exit(137)"]
        process_env = {
            "PATH": f"{self.extra_path}{os.pathsep}{os.environ.get('PATH', '')}",
            "HOME": os.environ.get("HOME", "/tmp"),
            **env,
        }
        # the node's CPU is this machine's: its kernel setting too (ATEN_CPU_CAPABILITY stands for the CPU a
        # real node would have), or pods compared bit for bit with local processes would round differently
        for key in ("HF_HUB_OFFLINE", "DAGSTER_RL_MODEL_CACHE", "TMPDIR", "ATEN_CPU_CAPABILITY"):
            if key in os.environ:
                process_env[key] = os.environ[key]
        pod.proc = subprocess.Popen(
            command, cwd=REPO, env=process_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        threading.Thread(target=self._collect, args=(pod,), daemon=True).start()

    def _env_value(self, entry: dict[str, Any], pod: FakePod) -> str:
        if "value" in entry:
            return entry["value"]
        path = entry["valueFrom"]["fieldRef"]["fieldPath"]
        if path == f"metadata.annotations['{INDEX_LABEL}']":
            return pod.annotations[INDEX_LABEL]
        raise NotImplementedError(f"the fake resolves no fieldRef {path}")

    def _resolve(self, namespace: str, host: str) -> str:
        """Cluster DNS for <hostname>.<subdomain>: 127.0.0.1 when a Service named <subdomain> selects
        a pod of that hostname and subdomain; else the name, which then does not resolve."""
        hostname, _, subdomain = host.partition(".")
        service = self.services.get((namespace, subdomain))
        if service is None or not service["spec"].get("publishNotReadyAddresses"):
            return host
        for job in self.jobs.values():
            for pod in job.pods:
                if f"{job.name}-{pod.index}" == hostname and pod.spec.get("subdomain") == subdomain:
                    if _selects(service["spec"]["selector"], pod.labels):
                        return "127.0.0.1"
        return host

    def _collect(self, pod: FakePod) -> None:
        assert pod.proc is not None and pod.proc.stdout is not None
        for raw in pod.proc.stdout:
            pod.lines.append(f"{_now()} {raw.decode(errors='replace').rstrip()}")
        pod.proc.wait()
        pod.done.set()
        with self._lock:  # the Job controller reacts to a pod that ended, as the real one does
            job = next((j for j in self.jobs.values() if j.name == pod.job), None)
            if job is not None:
                self._status(job)

    def _kill(self, pod: FakePod) -> None:
        if pod.proc is not None and pod.proc.poll() is None:
            pod.killed = True
            kill_pod_processes(pod.proc.pid)
            pod.proc.wait()


def kill_pod_processes(pid: int) -> None:
    """SIGKILL a pod's process and everything it started, as a container's end does (torchrun starts
    its workers in sessions of their own: the pod's process group alone would leave them running)."""
    for child in children(pid):
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
