"""The trainer backend `k8s` through `PipesK8sJobLauncher` against a FAKE of the Kubernetes API
(tests/fake_kubernetes.py: an API server that validates, a Job controller, pods as local processes):
two pods of torchrun train the step two local torchrun processes train; the create / wait / read-logs /
cleanup sequence; whole-set restarts; failure; and run termination, both ways Dagster ends a run."""

import json
import sys

import pytest
from dagster import AssetExecutionContext, DagsterInstance, asset, materialize
from dagster._core.errors import DagsterExecutionInterruptedError
from dagster_k8s.client import DagsterKubernetesClient

from dagster_rl.pods import PodJob, PodResources
from resources import PipesK8sJobLauncher, PipesTorchrunLauncher, TrainerEnvironment
from resources.k8s_launcher import PodJobFailed, PodJobTerminated
from tests.conftest import TINY_PLUMBING, shipped_settings
from tests.fake_kubernetes import FakeKubernetes
from tests.harness import failure_message

CLUSTER: dict[str, FakeKubernetes] = {}


class FakeClusterLauncher(PipesK8sJobLauncher):
    """The launcher with dagster-k8s's API client over the fake cluster instead of a kubeconfig."""

    def kubernetes_client(self, pipes) -> DagsterKubernetesClient:
        fake = CLUSTER["current"]
        return DagsterKubernetesClient.production_client(batch_api_override=fake.batch, core_api_override=fake.core)


@pytest.fixture
def cluster():
    fake = CLUSTER["current"] = FakeKubernetes()
    yield fake
    fake.close()


def launcher(tmp_path, **kw) -> FakeClusterLauncher:
    shared = tmp_path / "shared"
    return FakeClusterLauncher(
        image="registry.example.com/dagster-rl:test", workdir=str(shared / "trainer-jobs"), namespace="training",
        service_account="dagster-rl-trainer", storage_claim="dagster-rl-shared", storage_mount_path=str(shared),
        poll_interval_s=0.2, **kw,
    )  # fmt: skip


def nothing_left(cluster: FakeKubernetes) -> None:
    assert cluster.objects() == {"jobs": [], "services": [], "pods": []}
    assert cluster.running_processes() == []


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
    settings = shipped_settings("tiny_grpo", **TINY_PLUMBING, trainer={"backend": "k8s", "nodes": 2, "nproc_per_node": 1, "pods": pods})
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
    assert lifecycle(cluster.calls, job) == ["create service", "create job", "patch service", "delete job", "delete pod", "delete service"]
    assert [c for c in cluster.calls if c[0] == "delete" and c[1].startswith("pod/")].__len__() == 2
    nothing_left(cluster)


def error_classes(result) -> set[str]:
    """The classes of the failed step's error and of its causes."""
    error, found = result.failure_data_for_node("trainer_pods").error, set()
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


def _materialize(job: PodJob, cluster, tmp_path, on_status=None):
    instance = DagsterInstance.ephemeral()
    result = materialize([_pods_asset(job, cluster, on_status)], resources={"k8s": launcher(tmp_path)}, instance=instance, raise_on_error=False)
    logs = [e.message for e in instance.all_logs(result.run_id)]
    return result, logs


def test_a_failed_pod_restarts_the_whole_set_and_every_attempt_is_cleaned_up(cluster, tmp_path):
    cluster.crash = {(0, 1)}  # the first Job's pod 1 dies (a lost node)
    job = PodJob(name="restart", nodes=2, command=(sys.executable, "-c", REPORT), max_restarts=1, resources=PodResources(cpu="1"))
    result, logs = _materialize(job, cluster, tmp_path)
    assert result.success, failure_message(result)
    created = [obj.split("/", 1)[1] for verb, obj in cluster.calls if verb == "create" and obj.startswith("job/")]
    assert len(created) == 2 and created[0].endswith("-a0") and created[1].endswith("-a1")
    for name in created:
        assert lifecycle(cluster.calls, name) == ["create service", "create job", "patch service", "delete job", "delete pod", "delete service"]
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
    """Dagster terminates a run by signalling its step process: the interrupt arrives while the
    driver reads pod 0's logs."""

    def interrupt(pod_name: str) -> None:
        raise DagsterExecutionInterruptedError()

    cluster.on_log_follow = interrupt
    job = PodJob(name="stopped", nodes=2, command=(sys.executable, "-c", "import time; time.sleep(60)"))
    result, _ = _materialize(job, cluster, tmp_path)
    assert not result.success
    assert lifecycle(cluster.calls, next(o.split("/", 1)[1] for v, o in cluster.calls if o.startswith("job/")))[-3:] == [
        "delete job", "delete pod", "delete service",
    ]  # fmt: skip
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
