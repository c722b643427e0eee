"""The instance configs in deploy/: what they turn on, and that they load."""

from pathlib import Path

import sqlalchemy
import yaml
from dagster import DagsterInstance

from resources.run_launcher import LocalProcessRunLauncher
from tests.instance_config import production_config

REPO = Path(__file__).resolve().parent.parent


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
