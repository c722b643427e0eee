"""One run of an experiment at a time on a cluster too: the code location's executor with
DAGSTER_RL_EXECUTOR=k8s (`k8s_job_executor`, each step in its own pod) holds each experiment's pool
to one run, as the local executor does (tests/test_processes.py).

Two runs of one experiment's range execute as on the cluster, except where the cluster is: each
run's executor is dagster-k8s's own (`K8sStepHandler` builds the step Job from the run launcher's
config and the op's `dagster-k8s/config`), its API client talks to the fake Kubernetes API
(tests/fake_kubernetes.py), whose kubelet runs each step pod's `dagster api execute_step` as a
process on this machine against the same SQLite instance.
"""

import threading

import pytest
import yaml
from dagster import AssetKey, DagsterEventType, DagsterInstance, execute_job, reconstructable
from dagster_k8s.client import DagsterKubernetesClient

from assets.concurrency import experiment_pool
from assets.deployment import EXECUTOR
from tests.fake_kubernetes import FakeKubernetes
from tests.instance_config import instance_config
from tests.servers import wait_until
from tests.settings import demo_settings, write_experiments

EXPERIMENT = "slow"
KUBECONFIG = """apiVersion: v1
kind: Config
clusters: [{name: fake, cluster: {server: "https://127.0.0.1:9"}}]
users: [{name: fake, user: {token: fake}}]
contexts: [{name: fake, context: {cluster: fake, user: fake, namespace: dagster-rl}}]
current-context: fake
"""


def slow_train():
    """The code location's train job of the experiment (what a run and its step pods load)."""
    from assets.definitions import build_definitions
    from assets.experiments import read

    return build_definitions(read().experiments).resolve_job_def(f"{EXPERIMENT}_train")


@pytest.fixture
def cluster_home(tmp_path, monkeypatch):
    """A Dagster home whose instance is deploy/dagster.yaml's (SQLite) with the K8sRunLauncher, and
    the fake cluster the step Jobs go to."""
    home = tmp_path / "home"
    experiments = write_experiments(home / "experiments", demo_settings(name=EXPERIMENT, n_steps=4, faults={"step_delay_s": 2.0}))
    (tmp_path / "kubeconfig").write_text(KUBECONFIG)
    env = {"DAGSTER_RL_EXPERIMENTS": str(experiments), EXECUTOR: "k8s", "DAGSTER_RL_ARTIFACTS": f"file://{home}/artifacts"}
    config = instance_config(home)
    config["run_launcher"] = {
        "module": "dagster_k8s",
        "class": "K8sRunLauncher",
        "config": {
            "load_incluster_config": False,
            "kubeconfig_file": str(tmp_path / "kubeconfig"),
            "job_namespace": "dagster-rl",
            "job_image": "registry.example.com/dagster-rl:test",
            "service_account_name": "dagster-rl",
            "dagster_home": str(home),
            "instance_config_map": "dagster-instance",
            "env_vars": [f"{k}={v}" for k, v in env.items()],  # the code location's env, as the container context carries it
        },
    }
    (home / "dagster.yaml").write_text(yaml.safe_dump(config))
    for name, value in {**env, "DAGSTER_HOME": str(home)}.items():
        monkeypatch.setenv(name, value)
    DagsterInstance.from_config(str(home)).dispose()  # the schema, before several processes open it

    fake = FakeKubernetes()
    production = DagsterKubernetesClient.production_client
    monkeypatch.setattr(
        DagsterKubernetesClient,
        "production_client",
        staticmethod(lambda **_: production(batch_api_override=fake.batch, core_api_override=fake.core)),
    )
    yield home, fake
    fake.close()


def test_a_second_run_of_an_experiment_waits_for_the_first_under_k8s_job_executor(cluster_home):
    home, cluster = cluster_home
    job = reconstructable(slow_train)
    assert job.get_definition().executor_def.name == "k8s"
    tags = {"dagster/asset_partition_range_start": "0000", "dagster/asset_partition_range_end": "0003"}
    results: dict[str, object] = {}

    def run(key: str) -> None:
        with DagsterInstance.from_config(str(home)) as instance:
            results[key] = execute_job(job, instance=instance, tags=tags)

    first = threading.Thread(target=run, args=("first",))
    first.start()

    def step_jobs():
        return [o for v, o in cluster.calls if v == "create" and o.startswith("job/")]

    wait_until(lambda: step_jobs() or not first.is_alive(), 120, 0.2, lambda: f"no step Job of the first run: {cluster.calls}")
    assert len(step_jobs()) == 1, results
    with DagsterInstance.from_config(str(home)) as instance:
        assert instance.event_log_storage.get_concurrency_info(experiment_pool(EXPERIMENT)).limit == 1
    second = threading.Thread(target=run, args=("second",))
    second.start()
    first.join(300)
    second.join(300)
    assert not first.is_alive() and not second.is_alive()
    assert results["first"].success and results["second"].success

    with DagsterInstance.from_config(str(home)) as instance:
        runs = {k: results[k].run_id for k in ("first", "second")}
        records = instance.fetch_materializations(AssetKey([EXPERIMENT, "weights"]), limit=100, ascending=True).records
        computed = [(r.asset_materialization.partition, r.run_id) for r in records]
        steps = ["0000", "0001", "0002", "0003"]
        # each run reported every step; the second only once the first had finished: cache hits
        assert [p for p, r in computed if r == runs["first"]] == steps and [
            p for p, r in computed if r == runs["second"]
        ] == steps
        assert computed.index(("0000", runs["second"])) > computed.index(("0003", runs["first"]))
        second_log = [e for e in instance.all_logs(runs["second"])]
        blocked = [
            e.message
            for e in second_log
            if "blocked" in (e.message or "").lower() and experiment_pool(EXPERIMENT) in (e.message or "")
        ]
        assert blocked, [e.message for e in second_log][:60]
        waited = [e.message for e in second_log if f"Run {runs['first']} of experiment {EXPERIMENT}" in (e.message or "")]
        assert waited and "this run waits for it" in waited[0]
        hits = [
            e.dagster_event.event_specific_data.materialization.metadata
            for e in second_log
            if e.dagster_event and e.dagster_event.event_type == DagsterEventType.ASSET_MATERIALIZATION
        ]
        assert hits and all(m["cache"].value == "hit" for m in hits if "cache" in m), hits
    # two step Jobs, one per run, the second created after the first one's pod ended
    assert len(step_jobs()) == 2
