"""What Dagster's official Helm chart (chart `dagster`, 1.13.27) makes of deploy/helm/values.yaml, for
the parts this project depends on: which service account each pod runs as, the container context
the code location hands to its runs, the K8sRunLauncher's config, and the instance settings.

There is no `helm` binary and no copy of the chart here, so this is the chart's rule written out, read
from its templates (dagster-io/dagster, helm/dagster/; the copies read could not be pinned to the
tag 1.13.27's commit, see each note); `helm template dagster/dagster --version 1.13.27 -f
deploy/helm/values.yaml` on a machine with the chart is the check of this module, and
deploy/smoke-test.sh asks a real cluster which account the runs use.

The rule for service accounts, in the chart's own words:

- top-level chart, `dagster.serviceAccountName` (templates/helpers/_helpers.tpl, l. 151-152 of the
  copy at 01a33136): `global.serviceAccountName | default serviceAccount.name | default <fullname>`;
  the webserver, the daemon and the K8sRunLauncher's `service_account_name`
  (templates/helpers/instance/_run-launcher.tpl, `dagsterYaml.runLauncher.k8s`) use it;
- user-deployments subchart, `dagsterUserDeployments.serviceAccountName`
  (charts/dagster-user-deployments/templates/helpers/_helpers.tpl, l. 71-75 of the copy at
  031a3e8c): `global.serviceAccountName | default <subchart>.serviceAccount.name | default
  <subchart fullname>-user-deployments`, i.e. `<release>-dagster-user-deployments-user-deployments`;
  its container context (`dagsterUserDeployments.k8sContainerContext`, same file, l. 134) sets
  `service_account_name` to it, and the code server's Deployment passes that context to
  `dagster api grpc` when `includeConfigInLaunchedRuns.enabled` (default true;
  templates/deployment-user.yaml, l. 69-75 of the copy at 042cec96). The code server's own pod
  runs as the deployment's `serviceAccount.name` if it has one, else the same account (l. 44);
- the subchart creates its account only when `global.serviceAccountName` is unset
  (templates/serviceaccount.yaml, l. 1-7 of the copy at 5b163a24).

dagster-k8s 0.29.27 then gives run pods and step pods the container context's account over the run
launcher's: `K8sContainerContext.create_for_run` merges the run launcher's context, then the code
location's (container_context.py l. 457-512: the later merge wins), and `K8sStepHandler` starts
from that (executor.py l. 254-277). tests/test_k8s_manifests.py runs that code on what this module
returns.
"""

from typing import Any

import yaml

from tests import REPO

VALUES = REPO / "deploy" / "helm" / "values.yaml"
RELEASE, NAMESPACE = "dagster", "dagster-rl"  # as docs/kubernetes.md installs it
SUBCHART = "dagster-user-deployments"


def bound_rules(account: str) -> list[dict]:
    """The rules deploy/k8s/rbac.yaml grants the service account `account` (in the release's namespace)."""
    docs = [d for d in yaml.safe_load_all((REPO / "deploy" / "k8s" / "rbac.yaml").read_text()) if d]
    roles = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Role"}
    return [
        rule
        for d in docs
        if d["kind"] == "RoleBinding" and any(s["kind"] == "ServiceAccount" and s["name"] == account for s in d["subjects"])
        for rule in roles[d["roleRef"]["name"]]["rules"]
    ]


def fullname(release: str, chart: str, values: dict[str, Any]) -> str:
    """`dagster.fullname`: the global overrides, else <release>-<chart> (the release alone when it
    contains the chart's name), cut to 63 characters."""
    glob = values.get("global") or {}
    if glob.get("fullnameOverride"):
        return glob["fullnameOverride"][:63].rstrip("-")
    name = glob.get("nameOverride") or chart
    return (release if name in release else f"{release}-{name}")[:63].rstrip("-")


def top_service_account(values: dict[str, Any], release: str) -> str:
    glob = values.get("global") or {}
    return (
        glob.get("serviceAccountName") or (values.get("serviceAccount") or {}).get("name") or fullname(release, "dagster", values)
    )


def user_deployments_service_account(values: dict[str, Any], release: str) -> str:
    """The subchart's account: what its container context gives every run pod and step pod."""
    glob = values.get("global") or {}
    sub = values.get(SUBCHART) or {}
    return (
        glob.get("serviceAccountName")
        or (sub.get("serviceAccount") or {}).get("name")
        or f"{fullname(release, SUBCHART, values)}-user-deployments"
    )


def code_server_service_account(values: dict[str, Any], release: str, deployment: dict[str, Any]) -> str:
    own = deployment.get("serviceAccount") or {}
    return own["name"] if "name" in own else user_deployments_service_account(values, release)


def created_service_accounts(values: dict[str, Any], release: str) -> list[str]:
    """The ServiceAccounts the release itself creates."""
    made = []
    if (values.get("serviceAccount") or {}).get("create"):
        made.append(top_service_account(values, release))
    sub = values.get(SUBCHART) or {}
    if (sub.get("serviceAccount") or {}).get("create", True) and not (values.get("global") or {}).get("serviceAccountName"):
        made.append(user_deployments_service_account(values, release))
    for deployment in sub.get("deployments", []):
        own = deployment.get("serviceAccount") or {}
        if "name" in own and own.get("create"):
            made.append(own["name"])
    return made


def container_context(values: dict[str, Any], release: str, namespace: str, deployment: dict[str, Any]) -> dict[str, Any] | None:
    """`dagsterUserDeployments.k8sContainerContext`: what the code server passes to its runs (None
    when `includeConfigInLaunchedRuns` is off). Only the keys our values use."""
    if not (deployment.get("includeConfigInLaunchedRuns") or {"enabled": True}).get("enabled"):
        return None
    k8s: dict[str, Any] = {
        "image_pull_policy": deployment["image"]["pullPolicy"],
        "env_config_maps": [f"{fullname(release, SUBCHART, values)}-{deployment['name']}-user-env"],
        "namespace": namespace,
        "service_account_name": user_deployments_service_account(values, release),
    }
    secrets = [s["name"] for s in deployment.get("envSecrets") or [] if "name" in s]
    if secrets:  # the same template: `env_secrets`, the names in `envSecrets` (read at 031a3e8c)
        k8s["env_secrets"] = secrets
    for key, field in (
        ("volumeMounts", "volume_mounts"),
        ("volumes", "volumes"),
        ("labels", "labels"),
        ("resources", "resources"),
    ):
        if deployment.get(key):
            k8s[field] = deployment[key]
    if isinstance(deployment.get("env"), list) and deployment["env"]:
        k8s["env"] = deployment["env"]
    return {"k8s": k8s}


def run_launcher_config(values: dict[str, Any], release: str, namespace: str) -> dict[str, Any]:
    """`dagsterYaml.runLauncher.k8s`: the K8sRunLauncher's config in the instance's ConfigMap."""
    launcher = values["runLauncher"]["config"]["k8sRunLauncher"]
    config: dict[str, Any] = {
        "load_incluster_config": launcher["loadInclusterConfig"],
        "job_namespace": launcher.get("jobNamespace") or namespace,
        "image_pull_policy": launcher["imagePullPolicy"],
        "service_account_name": top_service_account(values, release),
        "dagster_home": {"env": "DAGSTER_HOME"},
        "instance_config_map": {"env": "DAGSTER_K8S_INSTANCE_CONFIG_MAP"},
        "postgres_password_secret": {"env": "DAGSTER_K8S_PG_PASSWORD_SECRET"},
        "env_config_maps": [
            {"env": "DAGSTER_K8S_PIPELINE_RUN_ENV_CONFIGMAP"},
            *[m["name"] for m in launcher.get("envConfigMaps", [])],
        ],
    }
    for key, field in (
        ("envSecrets", "env_secrets"),
        ("envVars", "env_vars"),
        ("volumeMounts", "volume_mounts"),
        ("volumes", "volumes"),
    ):
        if launcher.get(key):
            config[field] = [s["name"] for s in launcher[key]] if key == "envSecrets" else launcher[key]
    if launcher.get("runK8sConfig"):
        config["run_k8s_config"] = {
            _snake(k): {_snake(f): v for f, v in section.items()} for k, section in launcher["runK8sConfig"].items()
        }
    return config


def instance_settings(values: dict[str, Any]) -> dict[str, Any]:
    """The instance settings the daemon's values render to (templates/configmap-instance.yaml):
    `dagsterDaemon.runRetries`, `.runMonitoring` and `.runCoordinator` with their keys spelled as
    dagster.yaml spells them, and `concurrency` when enabled (templates/helpers/instance/_concurrency.tpl)."""
    daemon = values["dagsterDaemon"]
    out: dict[str, Any] = {}
    if daemon.get("enabled", True) and daemon["runRetries"].get("enabled"):
        out["run_retries"] = {_snake(k): v for k, v in daemon["runRetries"].items()}
    if daemon.get("enabled", True) and daemon["runMonitoring"].get("enabled"):
        out["run_monitoring"] = {_snake(k): v for k, v in daemon["runMonitoring"].items()}
    coordinator = daemon["runCoordinator"]
    if daemon.get("enabled", True) and coordinator.get("enabled"):
        config = coordinator["config"].get("queuedRunCoordinator") or {}
        out["run_coordinator"] = {"class": coordinator["type"], "config": {_snake(k): v for k, v in config.items()}}
    concurrency = values.get("concurrency") or {}
    if concurrency.get("enabled"):
        out["concurrency"] = {
            section: {_snake(k): v for k, v in (concurrency.get(section) or {}).items()}
            for section in ("pools", "runs")
            if concurrency.get(section)
        }
    return out


def _snake(name: str) -> str:
    out = "".join(f"_{c.lower()}" if c.isupper() else c for c in name)
    return out.lstrip("_")
