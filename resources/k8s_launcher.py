"""The trainer's Kubernetes launcher: a `PodJob` (N pods running one command as a set) as an Indexed
Job plus a headless Service, launched from the driver through Dagster Pipes, built on dagster-k8s.

What comes from dagster-k8s: the Pipes client's configuration loading, context injection (env vars)
and pod-log message reader (`PipesK8sClient`, `PipesK8sPodLogsMessageReader`: global rank 0, in pod
0, reports through its logs), and the API client's helpers (`DagsterKubernetesClient`: Job creation
with retries, waiting for a pod and for the Job's success while watching the Dagster run, deleting a
Job with its pods; `k8s_api_retry`, `k8s_api_retry_creation_mutation` for the Service). What a Job
of N pods needs beyond them is here: the Service, finding pod 0, whole-set restarts, and cleanup of
both objects on success, failure and run termination.

Pod 0's logs are read on a thread of their own (`PodLogs`): dagster-k8s 0.29.27 reads them
synchronously until the stream ends, so a pod 0 that hangs, or a stream that stalls, would hold
the wait for the Job, its deadline and the run's cancellation behind it. Here the wait for the Job
(success, a failed pod, the Job's deadline, the run leaving STARTED) runs beside the log stream,
and decides.
"""

import threading
import time
from contextlib import ExitStack
from typing import Any

import kubernetes
from dagster import (
    AssetExecutionContext,
    ConfigurableResource,
    DagsterRunStatus,
    PipesClientCompletedInvocation,
    open_pipes_session,
)
from dagster_k8s import PipesK8sClient
from dagster_k8s.client import (
    DagsterK8sAPIRetryLimitExceeded,
    DagsterK8sError,
    DagsterK8sJobStatusException,
    DagsterK8sUnrecoverableAPIError,
    DagsterKubernetesClient,
    k8s_api_retry,
    k8s_api_retry_creation_mutation,
)
from dagster_k8s.utils import detect_current_namespace
from pydantic import Field

from dagster_rl.base.errors import DagsterRLError
from dagster_rl.runtime.k8s_manifests import (
    INDEX_LABEL,
    JOB_LABEL,
    ClusterSettings,
    headless_service,
    indexed_job,
    job_name,
    job_network_policy,
    owned_by,
)
from dagster_rl.runtime.pods import PodJob
from dagster_rl.runtime.workers import WorkersGone
from resources.trainer_launcher import ReportedMessages, _lift_typed_output_requirement, ended_by_the_driver, no_preview_notices


class PodJobFailed(DagsterRLError):
    """Every attempt of a set of pods failed."""


class PodJobTerminated(DagsterRLError):
    """The Dagster run was terminated while its pods ran; they were deleted."""

    retryable = False


class PipesK8sJobLauncher(ConfigurableResource):
    """Runs a trainer's set of pods on Kubernetes: an Indexed Job (completions = parallelism =
    nodes, backoffLimit 0, activeDeadlineSeconds) and a headless Service for the rendezvous at pod 0,
    created from the driver's step through Dagster Pipes. Pod 0's logs carry rank 0's Pipes
    messages into the run. Any failed pod fails the attempt; the whole set is then deleted and
    created again, up to the PodJob's `max_restarts` times. The Job and the Service are deleted on
    success, failure and run termination (and a TTL and an owner reference on the Service remove
    them if this process dies first).

    `workdir` must be on storage that the driver and the pods mount at the same path
    (`storage_claim` at `storage_mount_path`): the trainer writes each job's inputs there and reads
    the checkpoint back.

    Examples:
        .. code-block:: python

            from dagster import Definitions
            from resources import PipesK8sJobLauncher, PipesTorchrunLauncher, TrainerEnvironment

            k8s = PipesK8sJobLauncher(
                image="registry.example.com/dagster-rl:1.0", service_account="dagster-rl-trainer",
                storage_claim="dagster-rl-shared", storage_mount_path="/data", workdir="/data/trainer-jobs",
            )
            defs = Definitions(
                assets=[...],
                resources={"trainer": TrainerEnvironment(launcher=PipesTorchrunLauncher(), k8s=k8s, timeout_s=7200)},
            )
    """

    image: str = Field(description="image of the trainer pods (torch, peft, transformers, this project)")
    workdir: str = Field(description="a folder on the shared storage, the same path in the driver and the pods")
    namespace: str = Field("", description="empty: the namespace this process runs in, else 'default'")
    image_pull_policy: str = "IfNotPresent"
    service_account: str = Field("", description="the pods' service account")
    image_pull_secrets: list[str] = Field(default_factory=list)
    storage_claim: str = Field("", description="a PersistentVolumeClaim every pod mounts at storage_mount_path")
    storage_mount_path: str = "/data"
    labels: dict[str, str] = Field(default_factory=dict, description="added to the Job, its pods and the Service")
    load_incluster_config: bool | None = Field(None, description="None: in-cluster when KUBERNETES_SERVICE_HOST is set")
    kubeconfig_file: str | None = None
    kube_context: str | None = None
    poll_interval_s: float = Field(5.0, gt=0)
    pod_start_timeout_s: float = Field(1800.0, gt=0, description="how long pod 0 may take to appear and start")
    log_drain_timeout_s: float = Field(60.0, gt=0, description="how long pod 0's log may take to end once the Job succeeded")
    ttl_after_finished_s: int = Field(3600, ge=0)

    # ---- what tests replace -------------------------------------------------------------------
    def pipes_client(self) -> PipesK8sClient:
        return PipesK8sClient(
            load_incluster_config=self.load_incluster_config,
            kubeconfig_file=self.kubeconfig_file,
            kube_context=self.kube_context,
            poll_interval=self.poll_interval_s,
        )

    def kubernetes_client(self, pipes: PipesK8sClient) -> DagsterKubernetesClient:
        pipes._load_k8s_config()  # dagster-k8s's own config loading (in-cluster or kubeconfig)
        return DagsterKubernetesClient.production_client()

    def networking_api(self, client: DagsterKubernetesClient) -> Any:
        """The NetworkingV1Api, on the same connection as dagster-k8s's client."""
        return kubernetes.client.NetworkingV1Api(client.core_api.api_client)

    # ---- the launch ---------------------------------------------------------------------------
    def cluster(self) -> ClusterSettings:
        return ClusterSettings(
            namespace=self.namespace or detect_current_namespace(self.kubeconfig_file) or "default",
            image=self.image,
            image_pull_policy=self.image_pull_policy,
            service_account=self.service_account,
            image_pull_secrets=tuple(self.image_pull_secrets),
            storage_claim=self.storage_claim,
            storage_mount_path=self.storage_mount_path,
            labels=dict(self.labels),
            ttl_after_finished_s=self.ttl_after_finished_s,
        )

    def run(self, context: AssetExecutionContext | Any, job: PodJob) -> PipesClientCompletedInvocation:
        """Run the set of pods to success (restarting the whole set up to `job.max_restarts` times)."""
        pipes = self.pipes_client()
        client = self.kubernetes_client(pipes)
        cluster = self.cluster()
        errors: list[str] = []
        for attempt in range(job.max_restarts + 1):
            name = job_name(job.name, context.run_id, attempt)
            try:
                invocation = self._attempt(context, pipes, client, cluster, job, name)
            except DagsterK8sJobStatusException:
                raise PodJobTerminated(f"the run stopped while Job {name} ran; its pods and Service were deleted") from None
            except DagsterK8sError as e:
                errors.append(f"attempt {attempt} (Job {name}): {e}")
                context.log.warning(f"trainer Job {name} failed, {job.max_restarts - attempt} whole-set restart(s) left: {e}")
                continue
            for message in invocation.get_custom_messages():
                context.log.info(f"trainer rank 0 reported: {message}")
            _lift_typed_output_requirement(context)
            return invocation
        raise PodJobFailed(
            f"the trainer's {job.nodes} pod(s) failed {len(errors)} time(s) ({job.max_restarts} restart(s) allowed):\n"
            + "\n".join(e[-3000:] for e in errors)
        )

    def start(self, context: AssetExecutionContext | Any, job: PodJob) -> "SessionPods":
        """Create the set of pods and return once pod 0 runs, leaving them running: a trainer
        session's workers for a range of steps (`SessionPods`)."""
        return SessionPods(self, context, job)

    def _attempt(
        self, context, pipes: PipesK8sClient, client: DagsterKubernetesClient, cluster: ClusterSettings, job: PodJob, name: str
    ):
        ns = cluster.namespace
        with (
            no_preview_notices(),
            open_pipes_session(
                context=context, extras=None, context_injector=pipes.context_injector, message_reader=pipes.message_reader
            ) as session,
        ):
            body = indexed_job(job, cluster, name, extra_env=dict(session.get_bootstrap_env_vars()))
            context.log.info(f"creating trainer Job {ns}/{name}: {job.nodes} pod(s), pod 0 at {name}-0.{name}")
            logs = None
            try:
                self._create(client, ns, name, body, headless_service(job, cluster, name))
                pod0 = self._pod0(context, client, ns, name)
                logs = PodLogs(pipes, context, client, ns, pod0)
                # the Job decides (success, a failed pod, its deadline, the run leaving STARTED), not the log stream
                client.wait_for_job_success(
                    name,
                    ns,
                    instance=context.instance,
                    run_id=context.run_id,
                    wait_timeout=job.active_deadline_s + self.pod_start_timeout_s,
                    wait_time_between_attempts=self.poll_interval_s,
                    num_pods_to_wait_for=job.nodes,
                )
                if problem := logs.drain(self.log_drain_timeout_s):
                    context.log.warning(
                        f"Job {name} succeeded, but pod 0's log stream ({ns}/{pod0}) {problem}: rank 0's last messages may be "
                        "missing from the run's log (the checkpoint is on the shared volume)"
                    )
            finally:
                self._cleanup(context, client, ns, name)
                if logs is not None:
                    logs.stop(self.poll_interval_s)  # the pods are deleted: a live stream ends; a stalled one is left behind
        return PipesClientCompletedInvocation(session)

    def _create(self, client: DagsterKubernetesClient, ns: str, name: str, job: dict, service: dict) -> None:
        """The Job's NetworkPolicy (before any of its pods exists) and Service, then the Job
        (dagster-k8s's creation with retries: transient API errors are retried, and a 409 after a
        retry means an earlier attempt went through), then the policy and the Service owned by the Job."""
        wait = self.poll_interval_s
        networking = self.networking_api(client)
        try:
            k8s_api_retry_creation_mutation(
                lambda: networking.create_namespaced_network_policy(ns, job_network_policy(job)), max_retries=3, timeout=wait
            )
            k8s_api_retry_creation_mutation(
                lambda: client.core_api.create_namespaced_service(ns, service), max_retries=3, timeout=wait
            )
            client.create_namespaced_job_with_retries(body=job, namespace=ns, wait_time_between_attempts=wait)
            created = k8s_api_retry(lambda: client.batch_api.read_namespaced_job(name, ns), max_retries=3, timeout=wait)
            uid = getattr(getattr(created, "metadata", None), "uid", None)
            if uid:
                k8s_api_retry(
                    lambda: client.core_api.patch_namespaced_service(name, ns, owned_by(job, uid)), max_retries=3, timeout=wait
                )
                k8s_api_retry(
                    lambda: networking.patch_namespaced_network_policy(name, ns, owned_by(job, uid)), max_retries=3, timeout=wait
                )
        except (DagsterK8sAPIRetryLimitExceeded, DagsterK8sUnrecoverableAPIError) as e:
            raise DagsterRLError(
                f"cannot create the trainer's Job, Service and NetworkPolicy {ns}/{name}: {_api_error(e.k8s_api_exception)}"
            ) from None

    def _pod0(self, context, client: DagsterKubernetesClient, ns: str, name: str) -> str:
        """The name of the Job's pod of completion index 0 (Kubernetes names it <job>-0-<random>),
        found by the index annotation, which every Kubernetes version with Indexed Jobs sets (the
        same index as a pod label exists from 1.28 only). While waiting for it: the Job failing,
        `pod_start_timeout_s` passing, or the run leaving STARTED ends the wait."""
        deadline = time.monotonic() + self.pod_start_timeout_s
        while True:
            pods = client.core_api.list_namespaced_pod(namespace=ns, label_selector=f"{JOB_LABEL}={name}").items
            zero = [p.metadata.name for p in pods if (p.metadata.annotations or {}).get(INDEX_LABEL) == "0"]
            if zero:
                return zero[0]
            status = client.get_job_status(name, ns)
            if status is not None and status.failed:
                raise DagsterK8sError(f"Job {name} failed before its pod 0 started: {status}")
            run = context.instance.get_run_by_id(context.run_id)
            if run is None or run.status != DagsterRunStatus.STARTED:
                raise DagsterK8sJobStatusException()
            if time.monotonic() > deadline:
                raise DagsterK8sError(f"Job {name} has no pod 0 after {self.pod_start_timeout_s} s")
            time.sleep(self.poll_interval_s)

    def _cleanup(self, context, client: DagsterKubernetesClient, ns: str, name: str) -> None:
        """Delete the Job with its pods, the Service and the NetworkPolicy; never masks the error being raised."""
        for what, delete in (
            ("Job", lambda: client.delete_job(name, ns)),
            ("Service", lambda: client.core_api.delete_namespaced_service(name, ns)),
            ("NetworkPolicy", lambda: self.networking_api(client).delete_namespaced_network_policy(name, ns)),
        ):
            try:
                delete()
            except kubernetes.client.ApiException as e:
                if e.status != 404:
                    context.log.warning(f"could not delete trainer {what} {ns}/{name}: {e}; it expires by its TTL / owner")
            except Exception as e:  # cleanup is best effort
                context.log.warning(f"could not delete trainer {what} {ns}/{name}: {e!r}")


class SessionPods:
    """A session's pods (`dagster_rl.runtime.workers.Workers`): one Indexed Job and its Service that live
    for the range, inside one Pipes session (pod 0's logs carry rank 0's message per step, read
    beside the driver as in `run`). `check`, at most every `poll_interval_s`: the run left STARTED
    deletes everything (`PodJobTerminated`); a failed pod fails the Job, which is deleted and
    created again as a whole set (the new pods take up the step the session folder holds pending),
    up to `max_restarts` times per step; pods that all exited (the workers stopped: idle, told to)
    end the session. `close` gives them time to exit, then deletes the Job and the Service."""

    def __init__(self, launcher: PipesK8sJobLauncher, context, job: PodJob):
        self.launcher, self.context, self.job = launcher, context, job
        self.pipes = launcher.pipes_client()
        self.client = launcher.kubernetes_client(self.pipes)
        self.cluster = launcher.cluster()
        self.ns = self.cluster.namespace
        self.stack = ExitStack()
        with no_preview_notices():
            self.session = self.stack.enter_context(
                open_pipes_session(
                    context=context,
                    extras=None,
                    context_injector=self.pipes.context_injector,
                    message_reader=self.pipes.message_reader,
                )
            )
        _lift_typed_output_requirement(context)  # the driver yields its own materializations while the session is open
        self.messages = ReportedMessages(context, self.session)
        self.attempt, self.restarts_left = 0, job.max_restarts
        self.errors: list[str] = []
        self.name: str | None = None
        self.logs: PodLogs | None = None
        self.checked = 0.0
        try:
            self._launch()
        except BaseException:
            self.close(0)
            raise

    def _launch(self) -> None:
        """Create this attempt's Job and Service and wait for its pod 0; a failure there is a failed attempt."""
        while True:
            self.name = job_name(self.job.name, self.context.run_id, self.attempt)
            body = indexed_job(self.job, self.cluster, self.name, extra_env=dict(self.session.get_bootstrap_env_vars()))
            self.context.log.info(
                f"creating trainer session Job {self.ns}/{self.name}: {self.job.nodes} pod(s), pod 0 at {self.name}-0.{self.name}"
            )
            try:
                self.launcher._create(self.client, self.ns, self.name, body, headless_service(self.job, self.cluster, self.name))
                pod0 = self.launcher._pod0(self.context, self.client, self.ns, self.name)
            except DagsterK8sJobStatusException:
                self._cleanup()
                raise PodJobTerminated(
                    f"the run stopped while the trainer session's Job {self.name} started; its pods and Service were deleted"
                ) from None
            except DagsterK8sError as e:
                self._failed(str(e))
                continue
            self.logs = PodLogs(self.pipes, self.context, self.client, self.ns, pod0)
            self.checked = time.monotonic()
            return

    def _failed(self, why: str) -> None:
        """This attempt failed: delete it; restart the whole set when a restart is left, else fail."""
        self.errors.append(f"attempt {self.attempt} (Job {self.name}): {why}")
        failed = self.name
        self._cleanup()
        if self.restarts_left <= 0:
            raise PodJobFailed(
                f"the trainer session's {self.job.nodes} pod(s) failed {len(self.errors)} time(s) during one step "
                f"({self.job.max_restarts} restart(s) allowed):\n" + "\n".join(e[-3000:] for e in self.errors)
            )
        self.context.log.warning(f"trainer session Job {failed} failed, {self.restarts_left} whole-set restart(s) left: {why}")
        self.restarts_left -= 1
        self.attempt += 1

    def check(self) -> None:
        self.messages.log_new()
        if time.monotonic() - self.checked < self.launcher.poll_interval_s:
            return
        self.checked = time.monotonic()
        run = self.context.instance.get_run_by_id(self.context.run_id)
        if run is None or run.status != DagsterRunStatus.STARTED:
            self._cleanup()
            raise PodJobTerminated(
                f"the run stopped while the trainer session's Job {self.name} ran; its pods and Service were deleted"
            )
        status = self.client.get_job_status(self.name, self.ns) if self.name is not None else None
        if status is None:
            raise WorkersGone(f"the trainer session's Job {self.ns}/{self.name} is gone (deleted from outside)")
        if status.failed:
            self._failed(f"pod(s) failed: {status}")
            self._launch()  # the new pods take up the step that is pending in the session folder
        elif (status.succeeded or 0) >= self.job.nodes:
            raise WorkersGone(f"the trainer session's pods ({self.ns}/{self.name}) all exited")

    def stepped(self) -> None:
        self.restarts_left = self.job.max_restarts
        self.errors = []
        self.messages.log_new()

    def close(self, grace_s: float) -> None:
        """Wait up to `grace_s` for the pods to exit (they were told to stop), then delete the Job
        and the Service and end the Pipes session."""
        try:
            deadline = time.monotonic() + grace_s
            while self.name is not None and time.monotonic() < deadline:
                status = self.client.get_job_status(self.name, self.ns)
                if status is None or status.failed or (status.succeeded or 0) >= self.job.nodes:
                    break
                time.sleep(self.launcher.poll_interval_s)
            if (
                grace_s > 0
                and self.logs is not None
                and (problem := self.logs.drain(min(grace_s, self.launcher.log_drain_timeout_s)))
            ):
                self.context.log.warning(f"pod 0's log stream of the trainer session ({self.ns}/{self.logs.pod}) {problem}")
        finally:
            with ended_by_the_driver(self.context, grace_s):
                self._cleanup()
                self.stack.close()
                self.messages.log_new()
                _lift_typed_output_requirement(self.context)

    def _cleanup(self) -> None:
        if self.name is not None:
            self.launcher._cleanup(self.context, self.client, self.ns, self.name)
            self.name = None
        if self.logs is not None:
            self.logs.stop(self.launcher.poll_interval_s)  # the pods are deleted: a live stream ends
        self.logs = None


class PodLogs:
    """Pod 0's logs, read on a thread by dagster-k8s's Pipes reader (`PipesK8sClient.consume_pod_logs`:
    it waits for the pod, follows its log, reconnects on errors, forwards rank 0's Pipes messages to
    the run). The caller waits for the Job meanwhile; `drain` then gives the stream time to end
    (pod 0 has exited), and `stop` leaves a stalled one behind."""

    def __init__(self, pipes: PipesK8sClient, context, client: DagsterKubernetesClient, namespace: str, pod: str):
        self.pod = pod
        self.error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._read, args=(pipes, context, client, namespace), name=f"pod-logs-{pod}", daemon=True
        )
        self._thread.start()

    def _read(self, pipes: PipesK8sClient, context, client: DagsterKubernetesClient, namespace: str) -> None:
        try:
            with pipes.consume_pod_logs(context=context, client=client, namespace=namespace, pod_name=self.pod):
                pass
        except BaseException as e:  # reported by drain; the Job's outcome decides the step
            self.error = e

    def drain(self, timeout_s: float) -> str | None:
        """Wait up to `timeout_s` for the stream to end: None when it ended cleanly, else what went wrong."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            return f"had not ended {timeout_s:g} s later"
        if self.error is not None:
            return f"could not be read ({self.error!r})"
        return None

    def stop(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)


def _api_error(error: BaseException) -> str:
    """What an API error says, and, for a 403, which permission the driver's account lacks."""
    if not isinstance(error, kubernetes.client.ApiException):
        return repr(error)
    said = f"HTTP {error.status} {error.reason}: {str(error.body)[:500]}"
    if error.status == 403:
        said += (
            ". The driver runs as the service account of the run's pods, the chart's global.serviceAccountName "
            "(deploy/helm/values.yaml); deploy/k8s/rbac.yaml binds that account to the Role it needs (create/get/list/"
            "patch/delete on jobs and services, create/patch/delete on networkpolicies, get/list/delete on pods, get on "
            "pods/log): kubectl apply -f deploy/k8s/rbac.yaml "
            "in the release's namespace, and check with deploy/smoke-test.sh"
        )
    return said
