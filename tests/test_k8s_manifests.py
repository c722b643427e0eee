"""Every Kubernetes object of the deployment: the manifests in deploy/, the Job, Service and
NetworkPolicy the trainer's launcher creates, a sandbox pod, the driver's step pod, and the pod the
Helm values give the code location, all valid for Kubernetes 1.33 (kubernetes-validate, strict),
with the rules across fields that schemas cannot check: the Service is the pods' subdomain, pod 0's
address is <job>-0.<service>, names fit their limits; the service account the chart gives the run
and step pods (tests/helm_chart.py, through dagster-k8s's own code) is the one deploy/k8s/rbac.yaml
binds; and the NetworkPolicies let each tier be reached by the pods that must reach it, and no other."""

import copy
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import kubernetes
import pytest
import yaml
from dagster import EnvVar
from dagster._config import process_config
from dagster._core.code_pointer import ModuleCodePointer
from dagster._core.origin import JobPythonOrigin, RepositoryPythonOrigin
from dagster._core.storage.dagster_run import DagsterRun
from dagster_k8s import K8sRunLauncher
from dagster_k8s.container_context import K8sContainerContext
from dagster_k8s.executor import K8sStepHandler
from dagster_k8s.job import DagsterK8sJobConfig, construct_dagster_k8s_job, get_user_defined_k8s_config

from assets import deployment
from dagster_rl.base.errors import SettingError
from dagster_rl.core.experiment_files import load_experiments
from dagster_rl.runtime.k8s_manifests import (
    INDEX_LABEL,
    MAX_LABEL,
    ClusterSettings,
    expand,
    headless_service,
    indexed_job,
    job_name,
    job_network_policy,
)
from dagster_rl.runtime.pods import COMPLETION_INDEX, MASTER_ADDR, MASTER_PORT, PodJob, PodResources
from dagster_rl.sandbox.pod_manifest import Owner, PodSandboxSettings, sandbox_pod
from dagster_rl.tasks.lm.backends import LMTrainer
from tests import REPO, helm_chart
from tests.fake_kubernetes import allows, validate
from tests.harness import failure_message
from tests.settings import shipped_settings

DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def qwen():
    return load_experiments(REPO / "experiments")["qwen25_grpo_k8s"]


CLUSTER = ClusterSettings(
    namespace="dagster-rl", image="registry.example.com/dagster-rl:0.1.0", service_account="dagster-rl-trainer",
    image_pull_secrets=("registry",), storage_claim="dagster-rl-shared", storage_mount_path="/data",
)  # fmt: skip


def test_every_manifest_in_deploy_is_valid_for_kubernetes_1_33():
    found = {
        p.relative_to(REPO).as_posix(): [d["kind"] for d in documents(p)]
        for p in sorted((REPO / "deploy" / "k8s").glob("*.yaml"))
    }
    assert found == {
        "deploy/k8s/rbac.yaml": ["ServiceAccount", "Role", "RoleBinding", "Role", "RoleBinding"],
        "deploy/k8s/sandbox.yaml": ["ServiceAccount", "NetworkPolicy"],
        "deploy/k8s/storage.yaml": ["PersistentVolumeClaim"],
        "deploy/k8s/trainer.yaml": ["NetworkPolicy"],
        "deploy/k8s/vllm.yaml": ["Deployment", "Service", "NetworkPolicy"],
    }
    for path in (REPO / "deploy" / "k8s").glob("*.yaml"):
        for doc in documents(path):
            validate(doc)


def test_the_trainer_job_and_service_of_the_gpu_experiment():
    exp = qwen()
    spec = LMTrainer(nproc_per_node=1).pod_job(exp, Path("/data/trainer-jobs/dagster-rl-train-x/job.json"), step=17)
    name = job_name(spec.name, "5f0c3c1e-0d4b-4a77-9a7e-0123456789ab", 2)
    job = indexed_job(spec, CLUSTER, name, extra_env={"DAGSTER_PIPES_CONTEXT": "x", "DAGSTER_PIPES_MESSAGES": "y"})
    service = headless_service(spec, CLUSTER, name)
    validate(job)
    validate(service)

    js, pod = job["spec"], job["spec"]["template"]["spec"]
    assert (js["completionMode"], js["completions"], js["parallelism"], js["backoffLimit"]) == ("Indexed", 2, 2, 0)
    assert js["activeDeadlineSeconds"] == 3600 and js["ttlSecondsAfterFinished"] > 0
    # the rendezvous: pods <job>-<i>.<service>; the Service is headless, selects them, answers before they are ready
    assert pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert all(job["spec"]["template"]["metadata"]["labels"][k] == v for k, v in service["spec"]["selector"].items())
    container = pod["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env[MASTER_ADDR]["value"] == f"{name}-0.{service['metadata']['name']}"
    assert env[MASTER_PORT]["value"] == str(service["spec"]["ports"][0]["port"]) == str(container["ports"][0]["containerPort"])
    assert env[COMPLETION_INDEX]["valueFrom"]["fieldRef"]["fieldPath"] == f"metadata.annotations['{INDEX_LABEL}']"
    assert {"DAGSTER_PIPES_CONTEXT", "DAGSTER_PIPES_MESSAGES", "OMP_NUM_THREADS"} <= set(env)
    # the pod command: torchrun, node rank = completion index, static rendezvous at pod 0, the trainer entrypoint
    cmd = container["command"]
    assert cmd[:3] == ["python", "-m", "torch.distributed.run"]
    assert cmd[cmd.index("--nnodes") + 1] == "2" and cmd[cmd.index("--nproc-per-node") + 1] == "1"
    assert cmd[cmd.index("--node-rank") + 1] == "$(JOB_COMPLETION_INDEX)" and cmd[cmd.index("--rdzv-backend") + 1] == "static"
    assert cmd[cmd.index("--master-addr") + 1] == "$(MASTER_ADDR)" and cmd[cmd.index("--master-port") + 1] == "$(MASTER_PORT)"
    assert cmd[-3:] == ["-m", "dagster_rl.tasks.lm.train.entrypoint", "/data/trainer-jobs/dagster-rl-train-x/job.json"]
    # what the experiment asked of each pod, and where the deployment puts it
    assert container["resources"] == {
        "requests": {"cpu": "6", "memory": "48Gi"},
        "limits": {"memory": "48Gi", "nvidia.com/gpu": 1},
    }
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert volumes[mounts["/data"]]["persistentVolumeClaim"] == {"claimName": "dagster-rl-shared"}
    assert pod["serviceAccountName"] == "dagster-rl-trainer" and pod["imagePullSecrets"] == [{"name": "registry"}]
    assert pod["restartPolicy"] == "Never" and container["image"] == CLUSTER.image


@pytest.mark.parametrize("hint", ["a", "x" * 300, "Weird_Name.With:Chars", "qwen25_grpo_k8s-s9999"])
def test_names_fit_their_limits_whatever_the_experiment_is_called(hint):
    for attempt in (0, 12):
        name = job_name(hint, "RUN-ID_with.odd", attempt)
        assert DNS_LABEL.match(name), name  # a valid Service name (DNS-1035) and Job name
        assert len(f"{name}-9999-abcde") <= MAX_LABEL  # pod names <job>-<index>-<5>, hostnames <job>-<index>
        spec = PodJob(name=hint, nodes=3, command=("true",))
        validate(indexed_job(spec, CLUSTER, name))
        validate(headless_service(spec, CLUSTER, name))
    assert job_name("x" * 300, "r", 0) != job_name("x" * 299 + "y", "r", 0)  # long hints keep their difference


def test_a_pod_expands_its_command_as_kubernetes_does():
    env = {"JOB_COMPLETION_INDEX": "1", "MASTER_ADDR": "j-0.j"}
    assert expand("--node-rank=$(JOB_COMPLETION_INDEX)", env) == "--node-rank=1"
    assert expand("$(MASTER_ADDR):$(UNDEFINED)", env) == "j-0.j:$(UNDEFINED)"
    assert expand("$$(MASTER_ADDR) costs $$5", env) == "$(MASTER_ADDR) costs $5"


def test_the_driver_step_pod_is_what_the_experiment_declares():
    """k8s_job_executor turns the driver op's `dagster-k8s/config` tag into its step pod."""
    from assets.driver import build_driver

    exp = qwen()
    config = get_user_defined_k8s_config(build_driver(exp).op.tags)
    job = construct_dagster_k8s_job(
        DagsterK8sJobConfig(job_image="registry.example.com/dagster-rl:0.1.0", dagster_home="/opt/dagster/dagster_home"),
        ["dagster", "api", "execute_step"],
        "dagster-step-0123456789",
        user_defined_k8s_config=config,
    )
    body = kubernetes.client.ApiClient().sanitize_for_serialization(job)
    validate(body)
    assert body["spec"]["template"]["spec"]["containers"][0]["resources"] == {
        "requests": {"cpu": "4", "memory": "16Gi"},
        "limits": {"memory": "16Gi"},
    }
    assert "dagster-k8s/config" not in build_driver(load_experiments(REPO / "experiments")["demo"]).op.tags


def test_the_helm_values_deploy_the_code_location_the_launcher_and_postgres():
    values = yaml.safe_load((REPO / "deploy" / "helm" / "values.yaml").read_text())
    (code,) = values["dagster-user-deployments"]["deployments"]
    assert code["dagsterApiGrpcArgs"] == ["-m", "assets.definitions"] and code["includeConfigInLaunchedRuns"] == {"enabled": True}
    assert values["runLauncher"]["type"] == "K8sRunLauncher" and values["postgresql"]["enabled"] is True
    assert values["postgresql"]["postgresqlScheme"] == "postgresql+psycopg2"
    env = {e["name"]: e["value"] for e in code["env"]}
    known = {deployment.ARTIFACTS, deployment.ROLLOUT_URL, deployment.K8S_IMAGE, deployment.K8S_SERVICE_ACCOUNT,
             deployment.STORAGE_CLAIM, deployment.STORAGE_PATH, deployment.EXECUTOR, "DAGSTER_RL_EXPERIMENTS", "HF_HUB_OFFLINE",
             deployment.SANDBOX_IMAGE}  # fmt: skip
    assert set(env) == known and env[deployment.EXECUTOR] == "k8s"
    assert env[deployment.K8S_IMAGE] == env[deployment.SANDBOX_IMAGE] == f"{code['image']['repository']}:{code['image']['tag']}"
    storage = documents(REPO / "deploy" / "k8s" / "storage.yaml")[0]
    assert (
        code["volumes"][0]["persistentVolumeClaim"]["claimName"] == storage["metadata"]["name"] == env[deployment.STORAGE_CLAIM]
    )
    assert code["volumeMounts"][0]["mountPath"] == env[deployment.STORAGE_PATH]
    rbac = {d["kind"]: d for d in documents(REPO / "deploy" / "k8s" / "rbac.yaml")}
    assert rbac["ServiceAccount"]["metadata"]["name"] == env[deployment.K8S_SERVICE_ACCOUNT]
    # the code location's pod, as the chart would make it from these values
    pod = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "dagster-rl"},
        "spec": {"serviceAccountName": helm_chart.code_server_service_account(values, RELEASE, code), "volumes": code["volumes"], "containers": [{
            "name": "dagster-rl", "image": env[deployment.K8S_IMAGE], "env": code["env"],
            "envFrom": [{"secretRef": {"name": s["name"]}} for s in code["envSecrets"]],
            "volumeMounts": code["volumeMounts"], "resources": code["resources"],
        }]},
    }  # fmt: skip
    validate(pod)
    # vLLM reads the adapters and the model on the same volume, at the same path
    vllm = documents(REPO / "deploy" / "k8s" / "vllm.yaml")[0]["spec"]["template"]["spec"]
    assert {v["persistentVolumeClaim"]["claimName"] for v in vllm["volumes"] if "persistentVolumeClaim" in v} == {
        storage["metadata"]["name"]
    }
    args = vllm["containers"][0]["args"]
    assert args[0] == qwen().policy.base_model and "--enable-lora" in args and "--logprobs-mode=processed_logprobs" in args
    assert "--generation-config=vllm" in args and f"--dtype={qwen().policy.dtype}" in args
    assert int(next(a for a in args if a.startswith("--max-lora-rank=")).split("=")[1]) >= qwen().policy.lora.rank
    assert {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"} in vllm["containers"][0]["env"]


def test_the_dockerfile_pins_torch_and_the_smoke_test_is_valid_bash():
    docker = (REPO / "deploy" / "Dockerfile").read_text()
    assert "pip install torch==2.13.0" in docker
    for folder in re.findall(r"^COPY (\S+) ", docker, re.M):
        assert (REPO / folder).exists(), folder
    subprocess.run(["bash", "-n", str(REPO / "deploy" / "smoke-test.sh")], check=True)
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", str(REPO / "deploy" / "smoke-test.sh")], check=True)
    smoke = yaml.safe_load((REPO / "deploy" / "smoke" / "smoke_k8s.yaml").read_text())
    assert (
        smoke["trainer"]["backend"] == "k8s"
        and smoke["trainer"]["nodes"] == 2
        and smoke["policy"]["base_model"] == "builtin:tiny-qwen2"
    )


def test_the_gpu_experiment_loads_without_its_model_and_fails_clearly_when_run(lab):
    exp = qwen()  # loading read neither the model nor the data
    assert exp.world_size == 2 and exp.backends() == {"rollout": "openai_server", "trainer": "k8s"}
    assert PodResources.model_validate({"cpu": "6"}).cpu == "6"
    with pytest.raises(ValueError, match="Kubernetes quantity"):
        PodResources.model_validate({"memory": "lots"})
    with pytest.raises(ValueError, match="needs backend: k8s"):
        type(exp).model_validate(shipped_settings("tiny_grpo", trainer={"backend": "torchrun", "nodes": 2}))
    raw = yaml.safe_load((REPO / "experiments" / "qwen25_grpo_k8s.yaml").read_text())
    result = lab("qwen", raw).run("qwen25_grpo_k8s", "0000", "0000", raise_on_error=False)
    assert not result.success
    assert "cannot load base model '/data/models/Qwen2.5-0.5B-Instruct'" in failure_message(result)


def test_the_code_location_reads_its_cluster_from_its_environment(monkeypatch):
    from assets.definitions import build_definitions

    monkeypatch.setenv(deployment.EXECUTOR, "k8s")
    monkeypatch.setenv(deployment.K8S_IMAGE, "registry.example.com/dagster-rl:0.1.0")
    monkeypatch.setenv(deployment.STORAGE_CLAIM, "dagster-rl-shared")
    monkeypatch.setenv(deployment.ROLLOUT_URL, "http://vllm:8000/v1")
    defs = build_definitions(load_experiments(REPO / "experiments"))
    assert defs.resolve_job_def("qwen25_grpo_k8s_train").executor_def.name == "k8s"
    k8s = defs.resources["trainer"].k8s
    assert (k8s.image, k8s.storage_claim, k8s.storage_mount_path, k8s.workdir) == (
        "registry.example.com/dagster-rl:0.1.0", "dagster-rl-shared", "/data", "/data/trainer-jobs",
    )  # fmt: skip
    url = defs.resources["rollout"].base_url  # an EnvVar: read where the run executes
    assert isinstance(url, EnvVar) and url.env_var_name == deployment.ROLLOUT_URL
    monkeypatch.setenv(deployment.EXECUTOR, "celery")
    with pytest.raises(SettingError, match="DAGSTER_RL_EXECUTOR='celery'"):
        deployment.executor()
    for name in (deployment.EXECUTOR, deployment.K8S_IMAGE, deployment.ROLLOUT_URL):
        monkeypatch.delenv(name)
    defs = build_definitions(load_experiments(REPO / "experiments"))
    assert defs.resources["trainer"].k8s is None and defs.resources["rollout"].endpoint() is None
    assert defs.resolve_job_def("qwen25_grpo_k8s_train").executor_def.name != "k8s"


# ---- the service account of the runs -----------------------------------------------------------------
RELEASE, NAMESPACE, VALUES, bound_rules = helm_chart.RELEASE, helm_chart.NAMESPACE, helm_chart.VALUES, helm_chart.bound_rules


def run_and_step_pods(values: dict, monkeypatch) -> tuple[dict, dict]:
    """The run pod's and the step pod's specs (`run_and_step_templates`)."""
    run, step = run_and_step_templates(values, monkeypatch)
    return run["spec"], step["spec"]


def run_and_step_templates(values: dict, monkeypatch) -> tuple[dict, dict]:
    """The driver's run pod and step pod as dagster-k8s 0.29.27 builds them on a cluster deployed
    with `values`: the K8sRunLauncher configured as the chart configures it, a run whose code
    origin carries the container context the chart gives the code server, the step of the
    experiment's driver op. dagster-k8s's own code decides what each pod gets."""
    from assets.driver import build_driver

    monkeypatch.setattr("dagster_k8s.launcher.load_kubernetes_config", lambda **_: None)
    monkeypatch.setattr("kubernetes.config.load_incluster_config", lambda: None)
    for name, value in dict(DAGSTER_HOME="/opt/dagster/dagster_home", DAGSTER_K8S_INSTANCE_CONFIG_MAP="dagster-instance",
                            DAGSTER_K8S_PG_PASSWORD_SECRET="dagster-postgresql-secret", DAGSTER_K8S_PIPELINE_RUN_ENV_CONFIGMAP="dagster-pipeline-env").items():  # fmt: skip
        monkeypatch.setenv(name, value)
    config = process_config(K8sRunLauncher.config_type(), helm_chart.run_launcher_config(values, RELEASE, NAMESPACE))
    assert config.success, config.errors
    launcher = K8sRunLauncher.from_config_value(None, config.value)

    (code,) = values["dagster-user-deployments"]["deployments"]
    image = f"{code['image']['repository']}:{code['image']['tag']}"
    origin = JobPythonOrigin(
        "qwen25_grpo_k8s_train",
        RepositoryPythonOrigin(
            executable_path="python", code_pointer=ModuleCodePointer("assets.definitions", "defs", None), container_image=image,
            entry_point=["dagster"], container_context=helm_chart.container_context(values, RELEASE, NAMESPACE, code),
        ),
    )  # fmt: skip
    run = DagsterRun(job_name="qwen25_grpo_k8s_train", run_id="5f0c3c1e-0d4b-4a77-9a7e-0123456789ab", job_code_origin=origin)

    def pod(context: K8sContainerContext, name: str, component: str) -> dict:
        job = construct_dagster_k8s_job(
            context.get_k8s_job_config(image, launcher), ["dagster", "api", "execute_run"], name, component=component,
            user_defined_k8s_config=context.run_k8s_config,
        )  # fmt: skip
        body = kubernetes.client.ApiClient().sanitize_for_serialization(job)
        validate(body)
        return body["spec"]["template"]

    run_pod = pod(launcher.get_container_context_for_run(run), "dagster-run-5f0c3c1e", "run_worker")
    driver = build_driver(qwen())
    step_key = driver.op.name
    handler = K8sStepHandler(
        image=None, container_context=K8sContainerContext(), load_incluster_config=True, kubeconfig_file=None
    )
    step_context = SimpleNamespace(
        dagster_run=run,
        instance=SimpleNamespace(run_launcher=launcher),
        execute_step_args=SimpleNamespace(step_keys_to_execute=[step_key]),
        step_tags={step_key: driver.op.tags},
        get_step_context=lambda key: SimpleNamespace(step=SimpleNamespace(op_name=driver.op.name)),
    )
    step_pod = pod(handler._get_container_context(step_context), "dagster-step-0123456789", "step_worker")
    return run_pod, step_pod


def what_the_driver_cannot_do(values: dict, monkeypatch) -> tuple[str, list[tuple[str, str, str]]]:
    """(the account the run and step pods get from the chart, the calls of the trainer's launcher
    that deploy/k8s/rbac.yaml does not allow that account)."""
    run_pod, step_pod = run_and_step_pods(values, monkeypatch)
    assert run_pod["serviceAccountName"] == step_pod["serviceAccountName"]
    account = step_pod["serviceAccountName"]
    rules = bound_rules(account)
    needed = [  # what resources.PipesK8sJobLauncher and dagster-k8s's Pipes client call (tests/fake_kubernetes.py PERMISSION)
        ("batch", "jobs", "create"), ("batch", "jobs", "get"), ("batch", "jobs", "list"), ("batch", "jobs", "delete"),
        ("batch", "jobs/status", "get"), ("", "services", "create"), ("", "services", "patch"), ("", "services", "delete"),
        ("", "pods", "list"), ("", "pods", "delete"), ("", "pods/log", "get"),
        ("networking.k8s.io", "networkpolicies", "create"), ("networking.k8s.io", "networkpolicies", "patch"),
        ("networking.k8s.io", "networkpolicies", "delete"),
        # and dagster_rl.sandbox.pods: a pod per episode, execs into it (get: websocket execs before Kubernetes 1.30)
        ("", "pods", "create"), ("", "pods", "get"), ("", "pods", "patch"), ("", "pods/exec", "create"), ("", "pods/exec", "get"),
    ]  # fmt: skip
    return account, [n for n in needed if not allows(rules, *n)]


def test_the_run_and_step_pods_run_as_the_account_that_rbac_binds(monkeypatch):
    """Set once (global.serviceAccountName): the chart's webserver/daemon account, the run launcher's,
    the code server's, the run pod's and the driver's step pod's are one account, the one
    deploy/k8s/rbac.yaml binds to the Role that lets the driver create the trainer's Jobs and Services."""
    values = yaml.safe_load(VALUES.read_text())
    account, missing = what_the_driver_cannot_do(values, monkeypatch)
    assert missing == [], f"the run and step pods run as {account}, which deploy/k8s/rbac.yaml does not allow {missing}"
    assert account == (values.get("global") or {}).get("serviceAccountName") == "dagster-rl"
    (code,) = values["dagster-user-deployments"]["deployments"]
    assert (
        helm_chart.top_service_account(values, RELEASE)
        == helm_chart.code_server_service_account(values, RELEASE, code)
        == account
    )
    assert helm_chart.created_service_accounts(values, RELEASE) == [account]  # the chart creates it, once
    assert helm_chart.run_launcher_config(values, RELEASE, NAMESPACE)["service_account_name"] == account
    run_pod, step_pod = run_and_step_pods(values, monkeypatch)
    # the run pod has the code location's resources: its container context wins over the run launcher's
    assert run_pod["containers"][0]["resources"] == code["resources"]
    # the step pod is the driver's: the experiment's driver_pod, the code location's env and volume
    container = step_pod["containers"][0]
    assert container["resources"] == {"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"memory": "16Gi"}}
    assert {"name": deployment.EXECUTOR, "value": "k8s"} in container["env"]
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/data"}


def test_an_account_set_anywhere_but_global_leaves_the_runs_on_an_account_without_rbac(monkeypatch):
    """The defect this replaces: the top-level serviceAccount.name is the webserver's and daemon's, not
    the runs' (the code location's container context overrides the run launcher's), so the run and
    step pods ran as the subchart's default account, which deploy/k8s/rbac.yaml does not bind: the
    driver's first Service creation was a 403."""
    values = yaml.safe_load(VALUES.read_text())
    old = copy.deepcopy(values)
    old.pop("global", None)
    old["serviceAccount"] = {"create": True, "name": "dagster-rl"}
    account, missing = what_the_driver_cannot_do(old, monkeypatch)
    assert account == "dagster-dagster-user-deployments-user-deployments"
    assert ("", "services", "create") in missing and ("batch", "jobs", "create") in missing
    # the subchart's own account only when named there, and then the chart makes it, not rbac.yaml's
    named = copy.deepcopy(old)
    named["dagster-user-deployments"]["serviceAccount"] = {"create": True, "name": "dagster-rl-code"}
    account, missing = what_the_driver_cannot_do(named, monkeypatch)
    assert account == "dagster-rl-code" and ("", "services", "create") in missing


# ---- deploy/smoke-test.sh's check of the runs' account, against a stand-in kubectl ----------------
KUBECTL = """#!{python}
# A stand-in kubectl for deploy/smoke-test.sh: the release's objects exist, the code location's
# Deployment carries the container context the chart renders, `auth can-i` answers as the rules of
# deploy/k8s/rbac.yaml do (given), `exec` ends the script (the cluster part is not played).
import json, sys
args = sys.argv[1:]
if "auth" in args:
    asked = " ".join(args[args.index("can-i") + 1: args.index("can-i") + 3])
    account = next(a for a in args if a.startswith("--as=")).split("=", 1)[1]
    print("yes" if asked in {allowed}.get(account, ()) else "no")
elif "CONTAINER_CONTEXT" in " ".join(args):
    print(json.dumps({context}, separators=(",", ":")), end="")
elif "-o" in args and "name" in args:
    print("deployment.apps/dagster-dagster-user-deployments-dagster-rl")
elif "exec" in args:
    sys.exit(42)
"""
SMOKE_CHECKS = ("create services", "patch services", "delete services", "create jobs.batch", "get jobs.batch", "list jobs.batch",
                "delete jobs.batch", "get jobs.batch/status", "list pods", "delete pods", "get pods/log",
                "create networkpolicies.networking.k8s.io", "patch networkpolicies.networking.k8s.io",
                "delete networkpolicies.networking.k8s.io", "create pods", "get pods", "patch pods", "create pods/exec")  # fmt: skip


def smoke_test_until_exec(values: dict, tmp_path) -> subprocess.CompletedProcess:
    """deploy/smoke-test.sh against the stand-in kubectl, on a release deployed with `values` and
    deploy/k8s/rbac.yaml applied."""
    (code,) = values["dagster-user-deployments"]["deployments"]
    context = helm_chart.container_context(values, RELEASE, NAMESPACE, code)
    account = context["k8s"]["service_account_name"]
    granted = []
    for check in SMOKE_CHECKS:
        verb, what = check.split()
        resource, _, sub = what.partition("/")
        kind, _, group = resource.partition(".")
        if allows(bound_rules(account), group, kind + (f"/{sub}" if sub else ""), verb):
            granted.append(check)
    allowed = {f"system:serviceaccount:{NAMESPACE}:{account}": granted}
    stub = tmp_path / "bin" / "kubectl"
    stub.parent.mkdir()
    stub.write_text(KUBECTL.format(python=sys.executable, context=repr(context), allowed=repr(allowed)))
    stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{stub.parent}{os.pathsep}{os.environ['PATH']}", "NAMESPACE": NAMESPACE}
    return subprocess.run(["bash", str(REPO / "deploy" / "smoke-test.sh")], env=env, capture_output=True, text=True, timeout=120)


def test_the_smoke_test_checks_that_the_runs_account_may_create_the_trainers_objects(tmp_path):
    values = yaml.safe_load(VALUES.read_text())
    done = smoke_test_until_exec(values, tmp_path)
    assert "runs and steps run as: dagster-rl" in done.stdout, done.stdout + done.stderr
    assert "may not" not in done.stderr and done.returncode == 42  # past the check, on to the experiment's upload
    old = copy.deepcopy(values)
    old.pop("global", None)
    old["serviceAccount"] = {"create": True, "name": "dagster-rl"}
    (tmp_path / "old").mkdir()
    done = smoke_test_until_exec(old, tmp_path / "old")
    assert done.returncode == 1 and "runs and steps run as: dagster-dagster-user-deployments-user-deployments" in done.stdout
    assert "may not:\n  create services" in done.stderr and "global.serviceAccountName: dagster-rl" in done.stderr, done.stderr
    assert "kubectl -n dagster-rl apply -f deploy/k8s/rbac.yaml" in done.stderr


def test_a_trainer_sessions_job_lives_for_the_range():
    """`trainer.session: range`: the pods run the worker on a session folder and live for the range;
    the Job's deadline is the backstop of a whole range (the driver holds each step to
    `active_deadline_s`, the workers stop when idle), and the name says which session of the run it is."""
    exp = qwen()
    spec = LMTrainer(nproc_per_node=1).pod_job(exp, Path("/data/trainer-jobs/dagster-rl-session-x"), step=17, session=1)
    assert spec.name == f"{exp.name}-s0017-1" and spec.active_deadline_s == exp.trainer.active_deadline_s * exp.n_steps
    name = job_name(spec.name, "5f0c3c1e-0d4b-4a77-9a7e-0123456789ab", 0)
    job = indexed_job(spec, CLUSTER, name, extra_env={"DAGSTER_PIPES_CONTEXT": "x", "DAGSTER_PIPES_MESSAGES": "y"})
    validate(job)
    validate(headless_service(spec, CLUSTER, name))
    assert job["spec"]["activeDeadlineSeconds"] == 3600 * exp.n_steps and job["spec"]["backoffLimit"] == 0
    assert job["spec"]["template"]["spec"]["containers"][0]["command"][-3:] == [
        "-m",
        "dagster_rl.tasks.lm.train.entrypoint",
        "/data/trainer-jobs/dagster-rl-session-x",
    ]
    assert LMTrainer(nproc_per_node=1).pod_job(exp, Path("/x"), step=17, session=0).name == f"{exp.name}-s0017"


# ---- the sandbox tier, and who may reach what ----------------------------------------------------------
def selects(selector: dict, labels: dict) -> bool:
    """A label selector (matchLabels, matchExpressions) against a pod's labels, as Kubernetes reads it."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        has, value = e["key"] in labels, labels.get(e["key"])
        ok = {"In": has and value in e.get("values", []), "NotIn": not has or value not in e.get("values", []),
              "Exists": has, "DoesNotExist": not has}[e["operator"]]  # fmt: skip
        if not ok:
            return False
    return True


def admits(policy: dict, labels: dict) -> bool:
    """Whether an ingress policy lets a pod with `labels` (of the same namespace) in."""
    return any(
        any(selects(peer["podSelector"], labels) for peer in rule.get("from", [])) for rule in policy["spec"].get("ingress", [])
    )


def deploy_object(path: str, kind: str, index: int = 0) -> dict:
    return [d for d in documents(REPO / "deploy" / "k8s" / path) if d["kind"] == kind][index]


SANDBOX_OWNER = Owner(
    id="3d3c9f4e-1b2a-4c5d-8e9f-0a1b2c3d4e5f", pod="dagster-step-0123456789-abcde", uid="3d3c9f4e-1b2a-4c5d-8e9f-0a1b2c3d4e5f"
)


def test_a_sandbox_pod_has_no_token_the_isolation_policys_labels_its_limits_and_runtime_class():
    settings = PodSandboxSettings(
        image="registry.example.com/dagster-rl:0.1.0", runtime_class_name="gvisor", host_users=False,
        node_selector={"dagster-rl/tier": "sandbox"}, tolerations=[{"key": "sandbox", "operator": "Exists", "effect": "NoSchedule"}],
        image_pull_secrets=("registry",),
    )  # fmt: skip
    pod = sandbox_pod(settings, "drl-sandbox-0123456789ab", "dagster-rl", SANDBOX_OWNER)
    validate(pod)
    spec, (container,) = pod["spec"], pod["spec"]["containers"]
    # no credentials: no token, an account bound to no Role
    account = deploy_object("sandbox.yaml", "ServiceAccount")
    assert spec["automountServiceAccountToken"] is False and account["automountServiceAccountToken"] is False
    assert spec["serviceAccountName"] == account["metadata"]["name"] and bound_rules(account["metadata"]["name"]) == []
    # the deny-all NetworkPolicy selects it, and allows nothing either way
    isolation = deploy_object("sandbox.yaml", "NetworkPolicy")["spec"]
    assert selects(isolation["podSelector"], pod["metadata"]["labels"])
    assert isolation["policyTypes"] == ["Ingress", "Egress"] and "ingress" not in isolation and "egress" not in isolation
    # the runtime class, a user of its own, nothing of the node's
    assert spec["runtimeClassName"] == "gvisor" and spec["hostUsers"] is False
    assert spec["enableServiceLinks"] is False and not (spec["hostNetwork"] or spec["hostPID"] or spec["hostIPC"])
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == 65534
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False, "privileged": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }  # fmt: skip
    # the tier's requests and limits (500m CPU, 1 GiB), its folders bounded, its life bounded
    assert container["resources"] == {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"cpu": "500m", "memory": "1Gi"}}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes[mounts["/work"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": "128Mi"}
    assert volumes[mounts["/tmp"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Mi"}
    assert spec["activeDeadlineSeconds"] == 3600 and spec["restartPolicy"] == "Never"
    assert spec["nodeSelector"] == {"dagster-rl/tier": "sandbox"} and spec["imagePullSecrets"] == [{"name": "registry"}]
    # found again, and deleted with the driver's pod
    assert pod["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Pod", "name": SANDBOX_OWNER.pod, "uid": SANDBOX_OWNER.uid, "blockOwnerDeletion": False}
    ]
    # the cluster's default runtime, and a disk-backed /work, when asked
    plain = sandbox_pod(
        PodSandboxSettings(image="python:3.11-slim", workspace_medium="Disk"), "drl-sandbox-x", "ns", Owner(id="o")
    )
    validate(plain)
    assert (
        "runtimeClassName" not in plain["spec"]
        and "hostUsers" not in plain["spec"]
        and "ownerReferences" not in plain["metadata"]
    )
    assert plain["spec"]["volumes"][0]["emptyDir"] == {"sizeLimit": "128Mi"}
    with pytest.raises(ValueError, match="Kubernetes quantity"):
        PodSandboxSettings(image="x", memory_limit="lots")


def test_each_tier_is_reached_only_by_the_pods_that_must(monkeypatch):
    """vLLM by the driver's run and step pods (as dagster-k8s labels them), on its port; a trainer Job's
    pods by each other only; a sandbox pod by nothing; and no policy shuts out the driver."""
    run, step = (t["metadata"]["labels"] for t in run_and_step_templates(yaml.safe_load(VALUES.read_text()), monkeypatch))
    spec = PodJob(name="x", nodes=2, command=("true",))
    job_a, job_b = (indexed_job(spec, CLUSTER, job_name(hint, "r", 0)) for hint in ("a", "b"))
    trainer_a, trainer_b = (j["spec"]["template"]["metadata"]["labels"] for j in (job_a, job_b))
    sandbox = sandbox_pod(PodSandboxSettings(image="x"), "drl-sandbox-x", "dagster-rl", SANDBOX_OWNER)["metadata"]["labels"]
    vllm_deployment = deploy_object("vllm.yaml", "Deployment")
    vllm = vllm_deployment["spec"]["template"]["metadata"]["labels"]

    to_vllm = deploy_object("vllm.yaml", "NetworkPolicy")
    assert selects(to_vllm["spec"]["podSelector"], vllm) and to_vllm["spec"]["policyTypes"] == ["Ingress"]
    assert admits(to_vllm, run) and admits(to_vllm, step)
    assert not any(admits(to_vllm, labels) for labels in (sandbox, trainer_a, vllm))
    (port,) = vllm_deployment["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert to_vllm["spec"]["ingress"][0]["ports"] == [{"protocol": "TCP", "port": port["containerPort"]}]

    baseline = deploy_object("trainer.yaml", "NetworkPolicy")
    assert selects(baseline["spec"]["podSelector"], trainer_a) and selects(baseline["spec"]["podSelector"], trainer_b)
    assert baseline["spec"]["policyTypes"] == ["Ingress"] and "ingress" not in baseline["spec"]
    own = job_network_policy(job_a)
    validate(own)
    assert own["metadata"]["name"] == job_a["metadata"]["name"] and selects(own["spec"]["podSelector"], trainer_a)
    assert admits(own, trainer_a) and not any(admits(own, labels) for labels in (trainer_b, sandbox, run, step, vllm))
    assert not selects(own["spec"]["podSelector"], trainer_b)

    isolation = deploy_object("sandbox.yaml", "NetworkPolicy")
    assert not any(selects(isolation["spec"]["podSelector"], labels) for labels in (run, step, trainer_a, vllm))
    assert not any(selects(baseline["spec"]["podSelector"], labels) for labels in (run, step, sandbox, vllm))


def test_vllm_requires_the_api_key_that_the_driver_sends(monkeypatch):
    """vLLM takes VLLM_API_KEY from a Secret; the code location takes the same Secret (envSecrets), as
    the variable the rollout environment reads its key from, and hands it to its run and step pods."""
    values = yaml.safe_load(VALUES.read_text())
    (code,) = values["dagster-user-deployments"]["deployments"]
    env = {e["name"]: e for e in deploy_object("vllm.yaml", "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]}
    key = env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert key["key"] == deployment.ROLLOUT_API_KEY and {"name": key["name"]} in code["envSecrets"]
    assert "optional" not in key  # no Secret, no server: never an open one
    run, step = run_and_step_pods(values, monkeypatch)
    for pod in (run, step):
        assert {"secretRef": {"name": key["name"]}} in pod["containers"][0]["envFrom"]
