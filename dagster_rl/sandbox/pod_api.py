"""The Kubernetes API as the sandbox pods need it: the clients, who owns the pods, what the API says
of a pod in words (running, or waiting on what, and whether waiting longer can help), an API
call's failure as what to fix (`ApiFailure`), and the removal of pods no live driver owns."""

import logging
import os
import re
import socket
from collections.abc import Callable
from typing import Any, TypeVar

from dagster_rl.base.errors import DagsterRLError
from dagster_rl.runtime.lifetime import alive, identity
from dagster_rl.sandbox.calls import SandboxUnavailable
from dagster_rl.sandbox.pod_manifest import APP_LABELS, OWNER_LABEL, OWNER_POD, Owner, label_value

T = TypeVar("T")
log = logging.getLogger(__name__)
OWNER_PROCESS = "dagster-rl/sandbox-owner-process"  # annotation: <host>/<pid>:<start> of the process that made the pod
# a container waiting for one of these will not start however long it waits
FATAL_WAITING = {"InvalidImageName", "CreateContainerConfigError", "ErrImageNeverPull"}
RBAC = (
    "the driver's service account needs, in the sandbox pods' namespace: pods create/get/list/patch/delete and "
    "pods/exec create (get too before Kubernetes 1.30): kubectl apply -f deploy/k8s/rbac.yaml"
)


class ApiFailure(DagsterRLError):
    """A call to the Kubernetes API failed (refused, or the API server unreachable)."""


def api_call(what: str, call: Callable[[], T]) -> T:
    """`call()`, its failure an `ApiFailure` saying what was being done and, for a 403, what to apply."""
    try:
        return call()
    except Exception as e:
        status = getattr(e, "status", None)
        said = f"HTTP {status} {getattr(e, 'reason', '')}: {str(getattr(e, 'body', '') or '')[:500]}" if status else repr(e)
        raise ApiFailure(f"cannot {what}: {said}{'. ' + RBAC if status == 403 else ''}") from None


def not_found(error: BaseException) -> bool:
    """A 404: from a REST call, or from an exec's websocket handshake (which the client reports as
    status 0, "Handshake status 404 Not Found")."""
    return http_status(error) == 404


def http_status(error: BaseException) -> int | None:
    status = getattr(error, "status", None)
    if status:
        return status
    match = re.search(r"Handshake status (\d{3})", f"{getattr(error, 'reason', '')} {error}")
    return int(match.group(1)) if match else None


def exec_failure(error: BaseException) -> str:
    """Why an exec could not be opened, with what to apply when the API refused it (403)."""
    said = f"{type(error).__name__}: {getattr(error, 'reason', None) or error}"[:1500]
    return f"{said}. {RBAC}" if http_status(error) == 403 else said


def is_running(pod: Any) -> bool:
    """The pod runs and its container has started."""
    status = pod.status
    if status is None or status.phase != "Running":
        return False
    return any(c.state is not None and c.state.running is not None for c in status.container_statuses or [])


def describe_waiting(pod: Any) -> tuple[str, bool]:
    """What a pod that does not run is waiting on, and whether it never will run (fatal)."""
    status = pod.status
    if status is None:
        return "no status yet", False
    if status.phase in ("Succeeded", "Failed"):
        return f"it ended ({status.phase}: {status.reason or ''} {status.message or ''}{_terminated(status)})".strip(), True
    for container in status.container_statuses or []:
        waiting = container.state.waiting if container.state is not None else None
        if waiting is not None and waiting.reason:
            return f"container {waiting.reason}: {waiting.message or ''}".strip(), waiting.reason in FATAL_WAITING
    for condition in status.conditions or []:
        if condition.type == "PodScheduled" and condition.status == "False":
            return f"not scheduled: {condition.reason or ''} {condition.message or ''}".strip(), False
    return f"phase {status.phase}", False


def _terminated(status: Any) -> str:
    for container in status.container_statuses or []:
        ended = container.state.terminated if container.state is not None else None
        if ended is not None:
            return f"; its container exited {ended.exit_code} ({ended.reason or ''} {ended.message or ''})"
    return ""


def default_clients() -> tuple[Any, Any]:
    """A CoreV1Api for REST calls and one on an ApiClient of its own for execs (`pod_exec`), from the
    in-cluster configuration when this runs in a pod, else from the kubeconfig."""
    try:
        import kubernetes

        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            kubernetes.config.load_incluster_config()
        else:
            kubernetes.config.load_kube_config()
        return kubernetes.client.CoreV1Api(kubernetes.client.ApiClient()), kubernetes.client.CoreV1Api(
            kubernetes.client.ApiClient()
        )
    except Exception as e:
        raise SandboxUnavailable(f"no Kubernetes cluster to run sandboxes on (in-cluster config, or a kubeconfig): {e}") from None


def current_namespace() -> str:
    try:
        with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"


def find_owner(api: Any, namespace: str, creator: str) -> Owner:
    """The driver's pod when it runs in one (its name is its hostname), else the process that made
    the placement (`creator`, as `owner_process` names it) on this host."""
    pod = os.environ.get("HOSTNAME", "") if os.environ.get("KUBERNETES_SERVICE_HOST") else ""
    if pod:
        try:
            uid = api.read_namespaced_pod(pod, namespace).metadata.uid
            if uid:
                return Owner(id=uid, pod=pod, uid=uid)
        except Exception as e:
            log.warning("sandbox pods carry no owner reference: cannot read this pod %s (%s)", pod, e)
    host, _, ident = creator.rpartition("/")
    return Owner(id=label_value(f"{host[:30]}-p{ident.replace(':', '-')}"))


def delete_pod(api: Any, namespace: str, name: str) -> None:
    try:
        api.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
    except Exception as e:
        if not not_found(e):
            log.warning("could not delete sandbox pod %s/%s (its deadline or the next run removes it): %s", namespace, name, e)


def delete_all(api: Any, namespace: str, made: set[str], pid: int) -> None:
    """Delete `made` (at exit of the process `pid` only: a forked copy leaves its parent's pods alone)."""
    if os.getpid() == pid:
        for name in list(made):
            delete_pod(api, namespace, name)


def remove_leftovers(api: Any, namespace: str, keep: set[str]) -> list[str]:
    """Delete the sandbox pods of `namespace` that no live driver owns (`_abandoned`), never `keep`
    (this process's own). Returns their names; never raises."""
    selector = ",".join(f"{k}={v}" for k, v in APP_LABELS.items())
    try:
        pods = api.list_namespaced_pod(namespace, label_selector=selector).items
    except Exception as e:
        log.warning("could not list sandbox pods to remove leftovers: %s", e)
        return []
    removed = []
    for pod in pods:
        labels, notes = pod.metadata.labels or {}, pod.metadata.annotations or {}
        if pod.metadata.name in keep:
            continue
        if _abandoned(api, namespace, pod.status.phase if pod.status else None, labels.get(OWNER_LABEL, ""), notes):
            delete_pod(api, namespace, pod.metadata.name)
            removed.append(pod.metadata.name)
    return removed


def _abandoned(api: Any, namespace: str, phase: str | None, owner_id: str, notes: dict[str, str]) -> bool:
    """Whether no live driver owns a sandbox pod: it ended; or the process that made it ran on this
    host (this pod, in a cluster) and is gone; or its owner pod is gone, ended, or another pod now."""
    if phase in ("Succeeded", "Failed"):
        return True
    if process_gone(notes.get(OWNER_PROCESS, "")):
        return True
    if notes.get(OWNER_POD):
        try:
            owner = api.read_namespaced_pod(notes[OWNER_POD], namespace)
        except Exception as e:
            return not_found(e)
        return owner.metadata.uid != owner_id or (owner.status is not None and owner.status.phase in ("Succeeded", "Failed"))
    return False


def owner_process() -> str:
    """This process, as the annotation `OWNER_PROCESS` names it."""
    return f"{socket.gethostname()}/{identity()}"


def process_gone(process: str) -> bool:
    """Whether the process an `OWNER_PROCESS` annotation names ran on this host and is gone."""
    host, _, ident = process.rpartition("/")
    return bool(host) and host == socket.gethostname() and not alive(ident)
