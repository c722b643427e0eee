"""The Kubernetes objects of a `PodJob`: an Indexed Job of N pods and the headless Service that
gives pod 0 the DNS name the others rendezvous at. Pure functions over dicts (camelCase, as
`kubectl apply` takes them); `resources.PipesK8sJobLauncher` creates them through dagster-k8s.

    Job      completionMode Indexed, completions = parallelism = nodes, backoffLimit 0 (a failed pod
             fails the set; the launcher restarts the whole set), activeDeadlineSeconds, a TTL as
             the backstop of the launcher's own cleanup
    pods     hostname <job>-<index> (Indexed Jobs), subdomain = the Service: pod 0 is
             <job>-0.<service>; env JOB_COMPLETION_INDEX, MASTER_ADDR, MASTER_PORT
    Service  clusterIP None, publishNotReadyAddresses (pods resolve before they are ready),
             selecting the Job's pods
    NetworkPolicy  the Job's pods accept connections from each other only (the rendezvous port and
             the ports NCCL opens); deploy/k8s/trainer.yaml makes every trainer pod accept nothing else
"""

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any

from dagster_rl.runtime.pods import COMPLETION_INDEX, MASTER_ADDR, MASTER_PORT, PodJob

MAX_LABEL = 63  # a DNS label, a label value
# Indexed pods are named <job>-<index>-<5 random> and their hostname is <job>-<index>: keep the job
# name short enough that both fit in a DNS label for any index up to 9999.
MAX_JOB_NAME = MAX_LABEL - len("-9999-xxxxx")
JOB_LABEL = "dagster-rl/job"
INDEX_LABEL = "batch.kubernetes.io/job-completion-index"  # an annotation of every Indexed Job pod (a label too from 1.28)
CONTAINER = "worker"
SHM_VOLUME = "dshm"
STORAGE_VOLUME = "shared-storage"


@dataclass(frozen=True)
class ClusterSettings:
    """Where pods run: the deployment's side of a PodJob (the experiment's side is PodResources)."""

    namespace: str = "default"
    image: str = ""
    image_pull_policy: str = "IfNotPresent"
    service_account: str = ""
    image_pull_secrets: tuple[str, ...] = ()
    storage_claim: str = ""  # a PersistentVolumeClaim every pod mounts at storage_mount_path
    storage_mount_path: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    ttl_after_finished_s: int = 3600


def slug(text: str) -> str:
    """Lowercase letters, digits and '-' only."""
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", text.lower())).strip("-")


def job_name(hint: str, run_id: str, attempt: int) -> str:
    """A valid, unique name for one attempt of a PodJob: `drl-<hint>-<run>-a<attempt>`, the hint cut
    (and a hash of it kept) when too long. Starts with a letter: also a valid Service name."""
    tail = f"-{slug(run_id)[:8] or 'run'}-a{attempt}"
    room = MAX_JOB_NAME - len("drl-") - len(tail)
    body = slug(hint) or "job"
    if len(body) > room:
        digest = hashlib.sha256(hint.encode()).hexdigest()[:6]
        body = f"{body[: room - 7].rstrip('-')}-{digest}"
    return f"drl-{body}{tail}"


def service_name(job: str) -> str:
    return job  # a Job and a Service may share a name; the job's name is a valid DNS-1035 label


def pod0_address(job: str) -> str:
    return f"{job}-0.{service_name(job)}"


def labels(job: str, cluster: ClusterSettings) -> dict[str, str]:
    return {
        **cluster.labels,
        "app.kubernetes.io/name": "dagster-rl",
        "app.kubernetes.io/component": "trainer",
        JOB_LABEL: job,
    }


def _env(items: dict[str, str]) -> list[dict[str, Any]]:
    return [{"name": k, "value": v} for k, v in items.items()]


def indexed_job(spec: PodJob, cluster: ClusterSettings, name: str, extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    """The Job manifest of one attempt of `spec`, named `name`."""
    res = spec.resources
    image = res.image or cluster.image
    if not image:
        raise ValueError("a PodJob needs an image: set the launcher's image or the tier's pods.image")
    env = [
        # Kubernetes sets it too; declared here so that $(JOB_COMPLETION_INDEX) expands in the command
        {"name": COMPLETION_INDEX, "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{INDEX_LABEL}']"}}},
        *_env({MASTER_ADDR: pod0_address(name), MASTER_PORT: str(spec.port)}),
        *_env({**spec.env, **(extra_env or {})}),
    ]
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    if res.shm_size:
        volumes.append({"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": res.shm_size}})
        mounts.append({"name": SHM_VOLUME, "mountPath": "/dev/shm"})
    if cluster.storage_claim:
        volumes.append({"name": STORAGE_VOLUME, "persistentVolumeClaim": {"claimName": cluster.storage_claim}})
        mounts.append({"name": STORAGE_VOLUME, "mountPath": cluster.storage_mount_path})
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": image,
        "imagePullPolicy": cluster.image_pull_policy,
        "command": list(spec.command),
        "env": env,
        "ports": [{"name": "rendezvous", "containerPort": spec.port}],
    }
    if res.container_resources():
        container["resources"] = res.container_resources()
    if res.env_from_secrets:
        container["envFrom"] = [{"secretRef": {"name": s}} for s in res.env_from_secrets]
    if mounts:
        container["volumeMounts"] = mounts
    pod: dict[str, Any] = {"subdomain": service_name(name), "restartPolicy": "Never", "containers": [container]}
    if cluster.service_account:
        pod["serviceAccountName"] = cluster.service_account
    if cluster.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": s} for s in cluster.image_pull_secrets]
    if res.node_selector:
        pod["nodeSelector"] = dict(res.node_selector)
    if res.tolerations:
        pod["tolerations"] = [t.manifest() for t in res.tolerations]
    if volumes:
        pod["volumes"] = volumes
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": cluster.namespace, "labels": labels(name, cluster)},
        "spec": {
            "completionMode": "Indexed",
            "completions": spec.nodes,
            "parallelism": spec.nodes,
            "backoffLimit": 0,  # any failed pod fails the set: the launcher restarts all of it
            "activeDeadlineSeconds": spec.active_deadline_s,
            "ttlSecondsAfterFinished": cluster.ttl_after_finished_s,
            "template": {"metadata": {"labels": labels(name, cluster)}, "spec": pod},
        },
    }


def headless_service(spec: PodJob, cluster: ClusterSettings, name: str) -> dict[str, Any]:
    """The Service whose name is the pods' subdomain: pod i answers at <job>-i.<service>."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": service_name(name), "namespace": cluster.namespace, "labels": labels(name, cluster)},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {JOB_LABEL: name},
            "ports": [{"name": "rendezvous", "port": spec.port, "targetPort": spec.port}],
        },
    }


def job_network_policy(job: dict[str, Any]) -> dict[str, Any]:
    """The NetworkPolicy of one attempt (named as its Job): its pods accept connections, on any port,
    from its own pods and from nothing else (torchrun's store and NCCL authenticate no one)."""
    meta = job["metadata"]
    pods = {"matchLabels": {JOB_LABEL: meta["name"]}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": meta["name"], "namespace": meta["namespace"], "labels": dict(meta["labels"])},
        "spec": {"podSelector": pods, "policyTypes": ["Ingress"], "ingress": [{"from": [{"podSelector": pods}]}]},
    }


def owned_by(job: dict[str, Any], uid: str) -> dict[str, Any]:
    """An ownerReferences patch making an object garbage-collected with the Job (a backstop: the
    launcher deletes both itself)."""
    ref = {"apiVersion": "batch/v1", "kind": "Job", "name": job["metadata"]["name"], "uid": uid, "blockOwnerDeletion": False}
    return {"metadata": {"ownerReferences": [ref]}}


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of $(VAR) in a container's command and args: a defined VAR is replaced,
    `$$` is a literal `$`, anything else is left as it is."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), value
    )
