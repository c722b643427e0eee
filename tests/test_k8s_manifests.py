"""Every Kubernetes object of the deployment: the manifests in deploy/, the Job and Service the
trainer's launcher creates, the driver's step pod, and the pod the Helm values give the code
location, all valid for Kubernetes 1.33 (kubernetes-validate, strict), with the rules across
fields that schemas cannot check: the Service is the pods' subdomain, pod 0's address is
<job>-0.<service>, names fit their limits."""

import re
import shutil
import subprocess
from pathlib import Path

import kubernetes
import kubernetes_validate
import pytest
import yaml
from dagster import EnvVar
from dagster_k8s.job import DagsterK8sJobConfig, construct_dagster_k8s_job, get_user_defined_k8s_config

from assets import deployment
from dagster_rl.experiment_files import load_experiments
from dagster_rl.k8s_manifests import INDEX_LABEL, MAX_LABEL, ClusterSettings, expand, headless_service, indexed_job, job_name
from dagster_rl.lm.backends import LMTrainer
from dagster_rl.pods import COMPLETION_INDEX, MASTER_ADDR, MASTER_PORT, PodJob, PodResources
from tests.conftest import shipped_settings
from tests.harness import failure_message

REPO = Path(__file__).resolve().parent.parent
K8S = "1.33.0"
DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def validate(obj: dict) -> None:
    kubernetes_validate.validate(obj, K8S, strict=True)


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def qwen():
    return load_experiments(REPO / "experiments")["qwen25_grpo_k8s"]


CLUSTER = ClusterSettings(
    namespace="dagster-rl", image="registry.example.com/dagster-rl:0.1.0", service_account="dagster-rl-trainer",
    image_pull_secrets=("registry",), storage_claim="dagster-rl-shared", storage_mount_path="/data",
)  # fmt: skip


def test_every_manifest_in_deploy_is_valid_for_kubernetes_1_33():
    found = {p.relative_to(REPO).as_posix(): [d["kind"] for d in documents(p)] for p in sorted((REPO / "deploy" / "k8s").glob("*.yaml"))}
    assert found == {
        "deploy/k8s/rbac.yaml": ["ServiceAccount", "Role", "RoleBinding"],
        "deploy/k8s/storage.yaml": ["PersistentVolumeClaim"],
        "deploy/k8s/vllm.yaml": ["Deployment", "Service"],
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
    # the pod command: torchrun, node rank = completion index, static rendezvous at pod 0, the worker entrypoint
    cmd = container["command"]
    assert cmd[:3] == ["python", "-m", "torch.distributed.run"]
    assert cmd[cmd.index("--nnodes") + 1] == "2" and cmd[cmd.index("--nproc-per-node") + 1] == "1"
    assert cmd[cmd.index("--node-rank") + 1] == "$(JOB_COMPLETION_INDEX)" and cmd[cmd.index("--rdzv-backend") + 1] == "static"
    assert cmd[cmd.index("--master-addr") + 1] == "$(MASTER_ADDR)" and cmd[cmd.index("--master-port") + 1] == "$(MASTER_PORT)"
    assert cmd[-3:] == ["-m", "dagster_rl.lm.worker", "/data/trainer-jobs/dagster-rl-train-x/job.json"]
    # what the experiment asked of each pod, and where the deployment puts it
    assert container["resources"] == {"requests": {"cpu": "6", "memory": "48Gi"}, "limits": {"memory": "48Gi", "nvidia.com/gpu": 1}}
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
    assert body["spec"]["template"]["spec"]["containers"][0]["resources"] == {"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"memory": "16Gi"}}
    assert "dagster-k8s/config" not in build_driver(load_experiments(REPO / "experiments")["demo"]).op.tags


def test_the_helm_values_deploy_the_code_location_the_launcher_and_postgres():
    values = yaml.safe_load((REPO / "deploy" / "helm" / "values.yaml").read_text())
    (code,) = values["dagster-user-deployments"]["deployments"]
    assert code["dagsterApiGrpcArgs"] == ["-m", "assets.definitions"] and code["includeConfigInLaunchedRuns"] == {"enabled": True}
    assert values["runLauncher"]["type"] == "K8sRunLauncher" and values["postgresql"]["enabled"] is True
    assert values["postgresql"]["postgresqlScheme"] == "postgresql+psycopg2"
    env = {e["name"]: e["value"] for e in code["env"]}
    known = {deployment.ARTIFACTS, deployment.ROLLOUT_URL, deployment.K8S_IMAGE, deployment.K8S_SERVICE_ACCOUNT,
             deployment.STORAGE_CLAIM, deployment.STORAGE_PATH, deployment.EXECUTOR, "DAGSTER_RL_EXPERIMENTS", "HF_HUB_OFFLINE"}  # fmt: skip
    assert set(env) == known and env[deployment.EXECUTOR] == "k8s"
    assert env[deployment.K8S_IMAGE] == f"{code['image']['repository']}:{code['image']['tag']}"
    storage = documents(REPO / "deploy" / "k8s" / "storage.yaml")[0]
    assert code["volumes"][0]["persistentVolumeClaim"]["claimName"] == storage["metadata"]["name"] == env[deployment.STORAGE_CLAIM]
    assert code["volumeMounts"][0]["mountPath"] == env[deployment.STORAGE_PATH]
    rbac = {d["kind"]: d for d in documents(REPO / "deploy" / "k8s" / "rbac.yaml")}
    assert rbac["RoleBinding"]["subjects"][0]["name"] == values["serviceAccount"]["name"]
    assert rbac["ServiceAccount"]["metadata"]["name"] == env[deployment.K8S_SERVICE_ACCOUNT]
    # the code location's pod, as the chart would make it from these values
    pod = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "dagster-rl"},
        "spec": {"serviceAccountName": values["serviceAccount"]["name"], "volumes": code["volumes"], "containers": [{
            "name": "dagster-rl", "image": env[deployment.K8S_IMAGE], "env": code["env"],
            "volumeMounts": code["volumeMounts"], "resources": code["resources"],
        }]},
    }  # fmt: skip
    validate(pod)
    # vLLM reads the adapters and the model on the same volume, at the same path
    vllm = documents(REPO / "deploy" / "k8s" / "vllm.yaml")[0]["spec"]["template"]["spec"]
    assert {v["persistentVolumeClaim"]["claimName"] for v in vllm["volumes"] if "persistentVolumeClaim" in v} == {storage["metadata"]["name"]}
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
    assert smoke["trainer"]["backend"] == "k8s" and smoke["trainer"]["nodes"] == 2 and smoke["policy"]["base_model"] == "builtin:tiny-qwen2"


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
    with pytest.raises(ValueError, match="DAGSTER_RL_EXECUTOR='celery'"):
        deployment.executor()
    for name in (deployment.EXECUTOR, deployment.K8S_IMAGE, deployment.ROLLOUT_URL):
        monkeypatch.delenv(name)
    defs = build_definitions(load_experiments(REPO / "experiments"))
    assert defs.resources["trainer"].k8s is None and defs.resources["rollout"].endpoint() is None
    assert defs.resolve_job_def("qwen25_grpo_k8s_train").executor_def.name != "k8s"
