"""The trainer backend `k8s` through `PipesK8sJobLauncher` against a FAKE of the Kubernetes API
(tests/fake_kubernetes.py: an API server that validates and authorizes, a Job controller, pods as
local processes): two pods of torchrun train the step two local torchrun processes train; the create /
wait / read-logs / cleanup sequence; whole-set restarts; failure; run termination, both ways Dagster
ends a run; a pod 0 that hangs; and RBAC: every call is made as the account the Helm chart gives
the driver's step pod, with the rules deploy/k8s/rbac.yaml binds to it."""

import json
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from dagster import AssetExecutionContext, DagsterInstance, asset, materialize
from dagster._core.errors import DagsterExecutionInterruptedError
from dagster_k8s.client import DagsterKubernetesClient

from dagster_rl.runtime.pods import PodJob, PodResources
from resources import PipesK8sJobLauncher, PipesTorchrunLauncher, TrainerEnvironment
from resources.k8s_launcher import PodJobFailed, PodJobTerminated
from tests.fake_kubernetes import FakeKubernetes, kill_pod_processes
from tests.harness import failure_message
from tests.helm_chart import NAMESPACE, RELEASE, VALUES, bound_rules, user_deployments_service_account
from tests.settings import SESSION_STEPS, TINY_PLUMBING, session_settings, shipped_settings

CLUSTER: dict[str, FakeKubernetes] = {}


def driver_account() -> tuple[str, list[dict]]:
    """(the driver's identity as the API server sees it, the rules deploy/k8s/rbac.yaml grants it)."""
    account = user_deployments_service_account(yaml.safe_load(VALUES.read_text()), RELEASE)
    return f"system:serviceaccount:{NAMESPACE}:{account}", bound_rules(account)


class FakeClusterLauncher(PipesK8sJobLauncher):
    """The launcher with dagster-k8s's API client over the fake cluster instead of a kubeconfig."""

    def kubernetes_client(self, pipes) -> DagsterKubernetesClient:
        fake = CLUSTER["current"]
        return DagsterKubernetesClient.production_client(batch_api_override=fake.batch, core_api_override=fake.core)

    def networking_api(self, client):
        return CLUSTER["current"].networking


@pytest.fixture
def cluster():
    fake = CLUSTER["current"] = FakeKubernetes(rbac=driver_account())
    yield fake
    fake.close()
    assert fake.denied == [], "the launcher made calls deploy/k8s/rbac.yaml does not allow"


def launcher(tmp_path, **kw) -> FakeClusterLauncher:
    shared = tmp_path / "shared"
    return FakeClusterLauncher(
        image="registry.example.com/dagster-rl:test", workdir=str(shared / "trainer-jobs"), namespace="training",
        service_account="dagster-rl-trainer", storage_claim="dagster-rl-shared", storage_mount_path=str(shared),
        poll_interval_s=0.2, **kw,
    )  # fmt: skip


def nothing_left(cluster: FakeKubernetes) -> None:
    assert cluster.objects() == {"jobs": [], "services": [], "networkpolicies": [], "pods": []}
    assert cluster.running_processes() == []


# One attempt's objects, from creation to cleanup: its NetworkPolicy (before any pod), the Service, the
# Job (then owning the Service and the policy), its pods.
WHOLE_LIFECYCLE = [
    "create networkpolicy", "create service", "create job", "patch service", "patch networkpolicy",
    "delete job", "delete pod", "delete service", "delete networkpolicy",
]  # fmt: skip
LAST_DELETES = ["delete job", "delete pod", "delete service", "delete networkpolicy"]


def lifecycle(calls: list[tuple[str, str]], job: str) -> list[str]:
    """The calls about one attempt's objects, pods collapsed."""
    out = []
    for verb, obj in calls:
        kind, name = obj.split("/", 1)
        if name == job or (kind == "pod" and name.startswith(job + "-")):
            item = f"{verb} {kind}"
            if not out or out[-1] != item:
                out.append(item)
    return out


def test_two_pods_of_torchrun_train_the_step_the_local_torchrun_trainer_trains(lab, cluster, tmp_path):
    """Two pods of one process each train, bit for bit, what two local torchrun processes train: the
    same world size on one machine. (That torchrun trains what the in-process trainer trains, to float
    rounding, is test_lm_driver's and test_lm_ddp's.)"""
    pods = {"cpu": "1", "memory": "2Gi", "shm_size": "1Gi", "node_selector": {"pool": "gpu"}}
    settings = shipped_settings(
        "tiny_grpo", **TINY_PLUMBING, trainer={"backend": "k8s", "nodes": 2, "nproc_per_node": 1, "pods": pods}
    )
    two = lab("pods", settings, trainer=TrainerEnvironment(launcher=PipesTorchrunLauncher(), k8s=launcher(tmp_path)))
    result = two.run("tiny_grpo", "0000", "0000")
    assert result.success, failure_message(result)

    # rank 0 (pod 0) reported through its logs into the run: world size 2, one process per pod
    logs = [e.message for e in two.instance.all_logs(result.run_id)]
    reported = [m for m in logs if "trainer rank 0 reported" in m]
    assert len(reported) == 1 and "'world_size': 2" in reported[0]
    ours = two.latest("tiny_grpo", "weights", "0000")
    assert ours["weights_version"] == 1 and ours["samples_used"] == 64
    # on-policy the policy term is mean_i A_i r_i with sum_i A_i = 0 per group: mean_i A_i (r_i - 1), at
    # most max|A_i| ratio_max_dev <= sqrt(n_samples - 1) ratio_max_dev (a z-score of n values is at most
    # sqrt(n - 1)); what is left is beta x KL to the base, which the warm-up moved away from
    beta = two.experiments["tiny_grpo"].grpo.kl_beta
    assert beta > 0 and ours["kl"] > 0.5
    assert abs(ours["loss"] - beta * ours["kl"]) <= (8 - 1) ** 0.5 * ours["ratio_max_dev"] + 1e-7
    # bit for bit the checkpoint of the torchrun trainer of the same world size on one machine
    local = lab("torchrun", shipped_settings("tiny_grpo", **TINY_PLUMBING, trainer={"backend": "torchrun", "nproc_per_node": 2}))
    assert local.run("tiny_grpo", "0000", "0000").success
    theirs = local.latest("tiny_grpo", "weights", "0000")
    assert ours["content_hash"] == theirs["content_hash"]
    assert all(ours[k] == theirs[k] for k in ("mean_reward", "loss", "ratio", "kl", "grad_norm")), (ours, theirs)

    # create the Service and the Job (the Service then owned by the Job), read pod 0, delete all
    job = next(obj.split("/", 1)[1] for verb, obj in cluster.calls if obj.startswith("job/"))
    assert job.startswith("drl-tiny-grpo-s0000-") and job.endswith("-a0")
    assert lifecycle(cluster.calls, job) == WHOLE_LIFECYCLE
    assert [c for c in cluster.calls if c[0] == "delete" and c[1].startswith("pod/")].__len__() == 2
    nothing_left(cluster)


def error_classes(result, node: str = "trainer_pods") -> set[str]:
    """The classes of the failed step's error and of its causes."""
    error, found = result.failure_data_for_node(node).error, set()
    while error is not None:
        found.add(error.cls_name)
        error = error.cause
    return found


def _pods_asset(job: PodJob, cluster: FakeKubernetes, on_status=None):
    @asset
    def trainer_pods(context: AssetExecutionContext, k8s: PipesK8sJobLauncher):
        if on_status is not None:
            cluster.on_job_status = lambda name: on_status(context)
        invocation = k8s.run(context, job)
        context.log.info(f"messages: {json.dumps(invocation.get_custom_messages())}")

    return trainer_pods


REPORT = (
    "import os\n"
    "from dagster_pipes import open_dagster_pipes\n"
    "if os.environ['JOB_COMPLETION_INDEX'] == '0':\n"
    "    with open_dagster_pipes() as pipes:\n"
    "        pipes.report_custom_message({'master': os.environ['MASTER_ADDR'], 'index': os.environ['JOB_COMPLETION_INDEX']})\n"
)


def _materialize(job: PodJob, cluster, tmp_path, on_status=None, **kw):
    instance = DagsterInstance.ephemeral()
    result = materialize(
        [_pods_asset(job, cluster, on_status)],
        resources={"k8s": launcher(tmp_path, **kw)},
        instance=instance,
        raise_on_error=False,
    )
    logs = [e.message for e in instance.all_logs(result.run_id)]
    return result, logs


def _within(seconds: float, cluster: FakeKubernetes, fn):
    """(fn(), how long it took); after `seconds` the fake cluster is shut down (its pods killed, its
    log streams ended), so that a launcher that would hang fails the test instead."""
    watchdog = threading.Timer(seconds, cluster.close)
    watchdog.start()
    start = time.monotonic()
    try:
        return fn(), time.monotonic() - start
    finally:
        watchdog.cancel()


def test_a_failed_pod_restarts_the_whole_set_and_every_attempt_is_cleaned_up(cluster, tmp_path):
    cluster.crash = {(0, 1)}  # the first Job's pod 1 dies (a lost node)
    job = PodJob(name="restart", nodes=2, command=(sys.executable, "-c", REPORT), max_restarts=1, resources=PodResources(cpu="1"))
    result, logs = _materialize(job, cluster, tmp_path)
    assert result.success, failure_message(result)
    created = [obj.split("/", 1)[1] for verb, obj in cluster.calls if verb == "create" and obj.startswith("job/")]
    assert len(created) == 2 and created[0].endswith("-a0") and created[1].endswith("-a1")
    for name in created:
        assert lifecycle(cluster.calls, name) == WHOLE_LIFECYCLE
    assert any("failed, 1 whole-set restart(s) left" in m for m in logs)
    # pod 0 of the attempt that succeeded reported, and resolved its own DNS name through the Service
    messages = json.loads(next(m for m in logs if m.startswith("messages: "))[len("messages: ") :])
    assert messages == [{"master": "127.0.0.1", "index": "0"}]
    nothing_left(cluster)


def test_a_set_that_fails_more_often_than_it_may_restart_fails_the_step_with_every_attempt_named(cluster, tmp_path):
    cluster.crash = {(0, 1), (1, 0)}
    job = PodJob(name="doomed", nodes=2, command=(sys.executable, "-c", "import time; time.sleep(30)"), max_restarts=1)
    result, _ = _materialize(job, cluster, tmp_path)
    assert not result.success
    message = failure_message(result)
    assert "failed 2 time(s) (1 restart(s) allowed)" in message and "attempt 0" in message and "attempt 1" in message
    assert error_classes(result) >= {PodJobFailed.__name__}
    nothing_left(cluster)  # the sleeping pods were killed with their Jobs


def test_a_terminated_run_deletes_its_pods_while_they_run(cluster, tmp_path):
    """Dagster terminates a run by signalling its step process: the interrupt arrives in the main
    thread, which waits for the Job while pod 0's logs are read beside it."""

    following = threading.Event()

    def interrupt(job_name: str) -> None:  # the signal, once pod 0's logs are being read
        if following.is_set():
            raise DagsterExecutionInterruptedError()

    cluster.on_log_follow = lambda pod_name: following.set()
    cluster.on_job_status = interrupt
    job = PodJob(name="stopped", nodes=2, command=(sys.executable, "-c", "import time; time.sleep(60)"))
    result, _ = _materialize(job, cluster, tmp_path)
    assert not result.success
    assert (
        lifecycle(cluster.calls, next(o.split("/", 1)[1] for v, o in cluster.calls if o.startswith("job/")))[-4:] == LAST_DELETES
    )
    nothing_left(cluster)


def test_a_run_marked_canceling_stops_waiting_and_deletes_its_pods(cluster, tmp_path):
    """The run's status leaves STARTED (`dagster run terminate` from another process): the wait for
    the Job, which watches the run, stops, and nothing is left."""
    slow = "import os, time\nif os.environ['JOB_COMPLETION_INDEX'] != '0':\n    time.sleep(60)\n"
    job = PodJob(name="canceled", nodes=2, command=(sys.executable, "-c", slow))

    def cancel(context) -> None:
        run = context.instance.get_run_by_id(context.run_id)
        if run.status.value == "STARTED":
            context.instance.report_run_canceling(run)

    result, _ = _materialize(job, cluster, tmp_path, on_status=cancel)
    assert not result.success
    assert error_classes(result) >= {PodJobTerminated.__name__}
    assert "the run stopped while Job" in failure_message(result)
    nothing_left(cluster)


HANG = "import time\nprint('pod up', flush=True)\ntime.sleep(600)\n"  # never exits on its own


def test_a_hung_pod_0_whose_log_never_ends_fails_at_the_jobs_deadline(cluster, tmp_path):
    """Pod 0 hangs and its log stream never ends (a stalled connection). The Job's deadline fails
    the Job; the launcher sees it through its wait for the Job, not through the stream, deletes
    everything and reports the deadline. (Reading the stream first, as dagster-k8s does, would
    wait on it for ever.)"""
    cluster.stalled_logs = {0}
    job = PodJob(name="hung", nodes=2, command=(sys.executable, "-c", HANG), active_deadline_s=3, max_restarts=0)
    (result, _), took = _within(60, cluster, lambda: _materialize(job, cluster, tmp_path))
    assert not result.success and took < 30
    message = failure_message(result)
    assert "failed 1 time(s) (0 restart(s) allowed)" in message and "DeadlineExceeded" in message
    assert error_classes(result) >= {PodJobFailed.__name__}
    nothing_left(cluster)


def test_a_run_canceled_while_pod_0_hangs_stops_at_once(cluster, tmp_path):
    """Pod 0 runs, logs nothing more, never exits; the run is marked CANCELING from elsewhere two
    seconds in. The wait for the Job watches the run beside the log stream: the step stops within a
    few polls, long before the Job's deadline (an hour), and the pods and Service are deleted."""
    job = PodJob(name="hung-cancel", nodes=2, command=(sys.executable, "-c", HANG), active_deadline_s=3600)
    started = time.monotonic()

    def cancel(context) -> None:
        run = context.instance.get_run_by_id(context.run_id)
        if run.status.value == "STARTED" and time.monotonic() - started > 2:
            context.instance.report_run_canceling(run)

    (result, _), took = _within(60, cluster, lambda: _materialize(job, cluster, tmp_path, on_status=cancel))
    assert not result.success and took < 30
    assert error_classes(result) >= {PodJobTerminated.__name__}
    nothing_left(cluster)


def test_a_succeeded_job_whose_pod_0_log_stalls_keeps_its_result_and_says_so(cluster, tmp_path):
    """The Job succeeded (every pod exited 0) but pod 0's log stream does not end: the step succeeds
    after `log_drain_timeout_s`, with a warning that rank 0's last messages may be missing."""
    cluster.stalled_logs = {0}
    job = PodJob(name="stalled", nodes=2, command=(sys.executable, "-c", REPORT))
    (result, logs), took = _within(60, cluster, lambda: _materialize(job, cluster, tmp_path, log_drain_timeout_s=1.0))
    assert result.success, failure_message(result)
    assert any("pod 0's log stream" in m and "had not ended 1 s later" in m for m in logs), logs
    nothing_left(cluster)


def test_pod_0_is_found_on_a_cluster_older_than_kubernetes_1_28(tmp_path):
    """Before 1.28 the Job controller sets the completion index as a pod annotation only (the label
    came in 1.28): pod 0 is found by the annotation, which every version with Indexed Jobs sets."""
    fake = CLUSTER["current"] = FakeKubernetes(rbac=driver_account(), index_label=False)
    try:
        job = PodJob(name="old-cluster", nodes=2, command=(sys.executable, "-c", REPORT))
        result, logs = _materialize(job, fake, tmp_path)
        assert result.success, failure_message(result)
        assert json.loads(next(m for m in logs if m.startswith("messages: "))[len("messages: ") :]) == [
            {"master": "127.0.0.1", "index": "0"}
        ]
        nothing_left(fake)
        assert fake.denied == []
    finally:
        fake.close()


# The Role the user-deployments subchart gives its own account (charts/dagster-user-deployments/
# templates/role.yaml): jobs and pods, no services.
SUBCHART_ROLE = [
    {"apiGroups": ["batch"], "resources": ["jobs", "jobs/status", "cronjobs"], "verbs": ["*"]},
    {"apiGroups": [""], "resources": ["pods", "pods/log", "pods/status"], "verbs": ["*"]},
]


def test_a_driver_without_the_rbac_role_fails_at_once_and_says_what_to_apply(tmp_path):
    """What the runs met when they ran as the subchart's own account: its Role has no services (nor
    networkpolicies), the first creation (the Job's NetworkPolicy) is a 403. The step fails at once
    (no whole-set restarts: retrying cannot grant a permission), naming the account's source and
    deploy/k8s/rbac.yaml, and leaves nothing."""
    account = "system:serviceaccount:dagster-rl:dagster-dagster-user-deployments-user-deployments"
    fake = CLUSTER["current"] = FakeKubernetes(rbac=(account, SUBCHART_ROLE))
    try:
        job = PodJob(name="forbidden", nodes=2, command=(sys.executable, "-c", REPORT), max_restarts=2)
        result, _ = _materialize(job, fake, tmp_path)
        assert not result.success
        message = failure_message(result)
        assert "HTTP 403 Forbidden" in message
        assert (
            f'User \\"{account}\\" cannot create resource \\"networkpolicies\\" in API group \\"networking.k8s.io\\"' in message
        )
        assert "global.serviceAccountName" in message and "kubectl apply -f deploy/k8s/rbac.yaml" in message
        assert fake.denied == [  # the cleanup tried too
            ("networking.k8s.io", "networkpolicies", "create"), ("", "services", "delete"), ("networking.k8s.io", "networkpolicies", "delete"),
        ]  # fmt: skip
        assert [v for v, o in fake.calls if v == "create"] == []  # nothing was created; no restart was tried
        nothing_left(fake)
    finally:
        fake.close()


# ---- a trainer session: one Job for a range of steps ------------------------------------------------


def kill_pod(cluster: FakeKubernetes, index: int) -> str:
    """SIGKILL the process group of pod `index` of the newest Job (a lost node); return the Job's name."""
    with cluster._lock:  # the test plays the node that dies
        job = max(cluster.jobs.values(), key=lambda j: j.number)
        pod = job.pods[index]
    kill_pod_processes(pod.proc.pid)
    return job.name


def test_a_session_of_three_steps_is_one_job_whose_pods_survive_a_restart_byte_identical(lab, cluster, tmp_path, session_run):
    """Steps 0000..0002 on 2 pods in one session: one Job for the range, not one per step. Pod 1
    dies while step 0001 is handed over: the Job fails, the launcher deletes it and creates the
    whole set again, whose pods take up the pending step from the session folder and load its input
    checkpoint. The run ends with the bytes of the uninterrupted 2-rank torchrun session, and every
    Job and Service is deleted."""
    killed = []

    def kill_pod_1_at_step_1() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not killed:
            if any((tmp_path / "shared" / "trainer-jobs").glob("*/jobs/000002.json")):
                killed.append(kill_pod(cluster, 1))
            time.sleep(0.005)

    settings = session_settings(trainer={"backend": "k8s", "nodes": 2, "nproc_per_node": 1, "max_restarts": 1})
    pods = lab("session_pods", settings, trainer=TrainerEnvironment(launcher=PipesTorchrunLauncher(), k8s=launcher(tmp_path)))
    killer = threading.Thread(target=kill_pod_1_at_step_1, daemon=True)
    killer.start()
    result = pods.run("tiny_grpo", SESSION_STEPS[0], SESSION_STEPS[-1])
    killer.join(5)
    assert result.success, failure_message(result)
    created = [obj.split("/", 1)[1] for verb, obj in cluster.calls if verb == "create" and obj.startswith("job/")]
    assert killed == created[:1] and len(created) == 2 and created[0].endswith("-a0") and created[1].endswith("-a1")
    for name in created:
        assert lifecycle(cluster.calls, name) == WHOLE_LIFECYCLE
    logs = [e.message for e in pods.instance.all_logs(result.run_id)]
    assert any(f"trainer session Job {created[0]} failed, 1 whole-set restart(s) left" in m for m in logs)
    reported = [m for m in logs if m.startswith("trainer rank 0 reported: ")]
    assert [f"'step': {s}," in m for m in reported for s in [int(m.split("'step': ")[1].split(",")[0])]] == [True] * len(reported)
    assert sorted({int(m.split("'step': ")[1].split(",")[0]) for m in reported}) == [0, 1, 2]
    assert [pods.latest("tiny_grpo", "weights", s)["content_hash"] for s in SESSION_STEPS] == [
        session_run.latest("tiny_grpo", "weights", s)["content_hash"] for s in SESSION_STEPS
    ]
    nothing_left(cluster)
    assert list((tmp_path / "shared" / "trainer-jobs").iterdir()) == []  # the session folder went with it


WAIT_FOR_STOP = (
    "import os, sys, time\nwhile not os.path.exists(sys.argv[1]):\n    time.sleep(0.05)\nprint('stopped', flush=True)\n"
)


def _session_asset(job: PodJob, cluster: FakeKubernetes, steps: int = 3, during=None, on_status=None):
    """An asset that holds a session's pods for `steps` steps of half a second (checking them all
    along, `during(step, workers)` in each), then tells them to stop (the file their command waits
    for) and closes them; any error closes them at once."""

    @asset
    def trainer_session(context: AssetExecutionContext, k8s: PipesK8sJobLauncher):
        if on_status is not None:
            cluster.on_job_status = lambda name: on_status(context)
        workers = k8s.start(context, job)
        try:
            for step in range(steps):
                if during is not None:
                    during(step, workers)
                end = time.monotonic() + 0.5
                while time.monotonic() < end:
                    workers.check()
                    time.sleep(0.05)
                workers.stepped()
        except BaseException:
            workers.close(0)
            raise
        Path(job.command[-1]).write_text("")
        workers.close(30)
        context.log.info(
            f"jobs: {json.dumps([o.split('/', 1)[1] for v, o in cluster.calls if v == 'create' and o.startswith('job/')])}"
        )

    return trainer_session


def _session_job(tmp_path, name: str, max_restarts: int = 0) -> PodJob:
    stop = tmp_path / f"{name}.stop"
    return PodJob(
        name=name,
        nodes=2,
        command=(sys.executable, "-c", WAIT_FOR_STOP, str(stop)),
        max_restarts=max_restarts,
        active_deadline_s=600,
    )


def _materialize_session(asset_def, cluster, tmp_path):
    instance = DagsterInstance.ephemeral()
    result = materialize([asset_def], resources={"k8s": launcher(tmp_path)}, instance=instance, raise_on_error=False)
    return result, [e.message for e in instance.all_logs(result.run_id)]


def test_a_session_job_lives_for_the_range_and_its_pods_exit_when_told(cluster, tmp_path):
    job = _session_job(tmp_path, "range")
    result, logs = _materialize_session(_session_asset(job, cluster), cluster, tmp_path)
    assert result.success, failure_message(result)
    [name] = json.loads(next(m for m in logs if m.startswith("jobs: "))[len("jobs: ") :])
    assert lifecycle(cluster.calls, name) == WHOLE_LIFECYCLE
    pods = [p for p in cluster.deleted_pods if p.job == name]
    assert len(pods) == 2 and all(p.exit_code == 0 and not p.killed for p in pods)  # they exited on their own, then were deleted
    nothing_left(cluster)


def test_a_sessions_restarts_are_counted_per_step(cluster, tmp_path):
    """max_restarts 1: a lost pod in each of two steps costs two whole-set restarts and the range
    goes on; two in one step fail it, and every Job is deleted."""

    def lose_a_pod_in_steps_0_and_2(step, workers):
        if step in (0, 2):
            kill_pod(cluster, 1)
            wait_until_restarted(workers)

    def wait_until_restarted(workers):
        before = workers.attempt
        end = time.monotonic() + 30
        while workers.attempt == before and time.monotonic() < end:
            workers.check()
            time.sleep(0.05)

    job = _session_job(tmp_path, "restarts", max_restarts=1)
    result, logs = _materialize_session(_session_asset(job, cluster, during=lose_a_pod_in_steps_0_and_2), cluster, tmp_path)
    assert result.success, failure_message(result)
    created = json.loads(next(m for m in logs if m.startswith("jobs: "))[len("jobs: ") :])
    assert [n[-3:] for n in created] == ["-a0", "-a1", "-a2"]
    nothing_left(cluster)

    def lose_two_pods_in_step_1(step, workers):
        if step == 1:
            for _ in range(2):
                kill_pod(cluster, 0)
                wait_until_restarted(workers)

    job = _session_job(tmp_path, "doomed-session", max_restarts=1)
    result, _ = _materialize_session(_session_asset(job, cluster, during=lose_two_pods_in_step_1), cluster, tmp_path)
    assert not result.success
    message = failure_message(result)
    assert (
        "failed 2 time(s) during one step (1 restart(s) allowed)" in message and "attempt 0" in message and "attempt 1" in message
    )
    assert error_classes(result, "trainer_session") >= {PodJobFailed.__name__}
    nothing_left(cluster)


@pytest.mark.parametrize("how", ["interrupted", "canceling"])
def test_a_terminated_run_deletes_its_sessions_job_and_service(cluster, tmp_path, how):
    """Both ways Dagster ends a run, while a session's pods wait for their next step: the
    interrupt in the driver's thread (it closes the session at once), or the run marked CANCELING
    from elsewhere (the session's check sees it: `PodJobTerminated`). Nothing is left."""
    following, started = threading.Event(), time.monotonic()
    cluster.on_log_follow = lambda pod_name: following.set()

    def stop(context) -> None:
        if not following.is_set() or time.monotonic() - started < 1.5:
            return
        if how == "interrupted":
            raise DagsterExecutionInterruptedError()
        run = context.instance.get_run_by_id(context.run_id)
        if run.status.value == "STARTED":
            context.instance.report_run_canceling(run)

    job = _session_job(tmp_path, f"stopped-{how}")
    (result, _), took = _within(
        60, cluster, lambda: _materialize_session(_session_asset(job, cluster, steps=20, on_status=stop), cluster, tmp_path)
    )
    assert not result.success and took < 30
    if how == "canceling":
        assert error_classes(result, "trainer_session") >= {PodJobTerminated.__name__}
    name = next(o.split("/", 1)[1] for v, o in cluster.calls if o.startswith("job/"))
    assert lifecycle(cluster.calls, name)[-4:] == LAST_DELETES
    nothing_left(cluster)
