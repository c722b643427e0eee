"""The instance configs in deploy/: what they turn on, that they load, and that the cluster's
instance (the Helm values, as the chart renders them) is the same as deploy/dagster.yaml."""

import json
import os
from pathlib import Path

import jsonschema
import pytest
import sqlalchemy
import yaml
from dagster import DagsterInstance

from assets.concurrency import ensure_limit, experiment_pool
from resources.run_launcher import LocalProcessRunLauncher
from tests import REPO, helm_chart
from tests.instance_config import production_config, write_dagster_yaml

# The official chart's values.schema.json at the pinned version (Dagster's chart ships one). It is
# not vendored in this repository (public repositories' files stay out of it); the steering repo's
# shared/ can hold it, or DAGSTER_HELM_SCHEMA can name a copy.
CHART_SCHEMA = Path(
    os.environ.get("DAGSTER_HELM_SCHEMA", REPO.parent / "shared" / "reference" / "dagster-helm-1.13.27" / "values.schema.json")
)


def resolve_env(value, env: dict[str, str]):
    """{env: NAME} leaves of an instance config replaced by env[NAME]."""
    if isinstance(value, dict):
        if set(value) == {"env"}:
            return env[value["env"]]
        return {k: resolve_env(v, env) for k, v in value.items()}
    return value


def test_production_postgres_url_uses_psycopg2_the_driver_dagster_postgres_ships():
    """SQLAlchemy 2.1 maps a bare postgresql:// to psycopg 3, which dagster-postgres does not install."""
    from dagster_postgres.utils import pg_url_from_config

    env = {f"DAGSTER_PG_{k}": v for k, v in dict(HOST="127.0.0.1", PORT="5432", USER="u", PASSWORD="p", DB="d").items()}
    url = pg_url_from_config(resolve_env(production_config()["storage"]["postgres"], env))
    assert url.startswith("postgresql+psycopg2://u:p@127.0.0.1:5432/d")
    engine = sqlalchemy.create_engine(url)  # imports the DBAPI; connects only when used
    assert engine.dialect.driver == "psycopg2"
    engine.dispose()


def test_the_local_instance_retries_runs_and_monitors_them_with_the_local_process_launcher(tmp_path):
    config = yaml.safe_load((REPO / "deploy" / "dagster.local.yaml").read_text())
    assert config["run_retries"] == {"enabled": True, "max_retries": 2, "retry_on_asset_or_op_failure": True}
    (tmp_path / "dagster.yaml").write_text(yaml.safe_dump(config))
    with DagsterInstance.from_config(str(tmp_path)) as instance:
        assert isinstance(instance.run_launcher, LocalProcessRunLauncher)
        assert instance.run_retries_enabled and instance.run_retries_max_retries == 2
        assert instance.run_monitoring_enabled and instance.run_monitoring_poll_interval_seconds == 5
        assert type(instance.run_storage).__name__ == "SqliteRunStorage"


def test_the_cluster_instance_is_configured_as_deploy_dagster_yaml():
    """Run retries, run monitoring (with free_slots_after_run_end_seconds), the run queue and the
    concurrency pools: what the Helm values render to (tests/helm_chart.py) equals dagster.yaml."""
    production = production_config()
    rendered = helm_chart.instance_settings(yaml.safe_load(helm_chart.VALUES.read_text()))
    assert rendered["run_retries"] == production["run_retries"]
    assert rendered["run_monitoring"] == production["run_monitoring"]
    assert rendered["run_monitoring"]["free_slots_after_run_end_seconds"] > 0  # a killed run's slot is freed
    assert rendered["run_coordinator"]["class"] == production["run_coordinator"]["class"]
    assert rendered["run_coordinator"]["config"] == production["run_coordinator"]["config"]
    assert rendered.get("concurrency") == production.get("concurrency")  # pool limits: both leave them to the executor


def test_the_pool_limit_of_every_experiment_is_one_on_the_production_instance(tmp_path):
    """The production instance sets no pool limit itself (see deploy/dagster.yaml); the code location's
    executors set 1 on an experiment's pool the first time it runs, and keep a limit set by hand."""
    write_dagster_yaml(tmp_path)
    with DagsterInstance.from_config(str(tmp_path)) as instance:
        storage = instance.event_log_storage
        assert storage.supports_global_concurrency_limits
        assert storage.get_concurrency_info(experiment_pool("a")).limit is None
        ensure_limit(instance, experiment_pool("a"))
        assert storage.get_concurrency_info(experiment_pool("a")).limit == 1
        storage.set_concurrency_slots(experiment_pool("b"), 3)  # an operator's choice is kept
        ensure_limit(instance, experiment_pool("b"))
        assert storage.get_concurrency_info(experiment_pool("b")).limit == 3


@pytest.mark.skipif(
    not CHART_SCHEMA.exists(), reason=f"the official chart's values.schema.json (1.13.27) is not at {CHART_SCHEMA}"
)
def test_the_helm_values_are_valid_for_the_official_chart_schema():
    """Every key we set is one the chart knows, of the type it takes. Helm validates the values
    merged over the chart's defaults, which fill the schema's required fields; without the chart's
    values.yaml here, `required` is left out and everything else is checked."""
    schema = _without_required(json.loads(CHART_SCHEMA.read_text()))
    values = yaml.safe_load(helm_chart.VALUES.read_text())
    registry = _offline_registry(schema)
    errors = sorted(jsonschema.Draft7Validator(schema, registry=registry).iter_errors(values), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)


def _without_required(schema):
    if isinstance(schema, dict):
        return {k: _without_required(v) for k, v in schema.items() if k != "required"}
    if isinstance(schema, list):
        return [_without_required(v) for v in schema]
    return schema


def _offline_registry(schema: dict):
    """The chart's schema refers to Kubernetes' definitions by URL; offline, each resolves to the
    definitions kubernetes-validate ships for Kubernetes 1.33."""
    import kubernetes_validate
    from referencing import Registry, Resource

    shipped = json.loads(
        (Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / "v1.33.0-local" / "_definitions.json").read_text()
    )
    # the chart's refs say #/definitions/<name>; kubernetes-validate's file says $defs (and refers to itself so)
    definitions = {
        "definitions": shipped["$defs"],
        "$defs": shipped["$defs"],
        "$schema": "http://json-schema.org/draft-07/schema#",
    }

    def retrieve(uri: str) -> Resource:
        if not uri.endswith("/_definitions.json"):
            raise ValueError(f"the chart's schema refers to {uri}, which is not a set of Kubernetes definitions")
        return Resource.from_contents(definitions)

    return Registry(retrieve=retrieve)


def test_kubernetes_definitions_the_chart_schema_refers_to_resolve_offline():
    """The chart's schema $refs Kubernetes' definitions by URL (kubernetesjsonschema.dev); offline they
    resolve to kubernetes-validate's, so a wrong pod field in the values fails the schema test."""
    ref = "https://kubernetesjsonschema.dev/v1.18.0/_definitions.json#/definitions/io.k8s.api.core.v1.ResourceRequirements"
    schema = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "properties": {"resources": {"$ref": ref}}}
    validator = jsonschema.Draft7Validator(schema, registry=_offline_registry(schema))
    (code,) = yaml.safe_load(helm_chart.VALUES.read_text())["dagster-user-deployments"]["deployments"]
    assert list(validator.iter_errors({"resources": code["resources"]})) == []
    assert [e.message for e in validator.iter_errors({"resources": {"limits": ["2Gi"]}})] == [
        "['2Gi'] is not of type 'object', 'null'"
    ]
