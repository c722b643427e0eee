"""Test instances derived from the production instance config (deploy/dagster.yaml).

`write_dagster_yaml(home, storage="sqlite")` writes `<home>/dagster.yaml` with the production run
coordinator, run retries and run monitoring, SQLite storage under `home`, and poll intervals short
enough for tests. `storage="postgres"` keeps the production PostgreSQL storage section, which reads
DAGSTER_PG_HOST/_PORT/_USER/_PASSWORD/_DB from the environment of every process that opens it.
"""

from pathlib import Path
from typing import Any, Literal

import yaml

from tests import REPO

PRODUCTION = REPO / "deploy" / "dagster.yaml"
PG_ENV = ("DAGSTER_PG_HOST", "DAGSTER_PG_PORT", "DAGSTER_PG_USER", "DAGSTER_PG_PASSWORD", "DAGSTER_PG_DB")


def production_config() -> dict[str, Any]:
    return yaml.safe_load(PRODUCTION.read_text())


def instance_config(
    home: Path,
    storage: Literal["sqlite", "postgres"] = "sqlite",
    *,
    max_retries: int = 2,
    retry_on_asset_or_op_failure: bool = True,
    run_retries: bool = True,
    run_monitoring: bool = True,
    poll_interval_seconds: int = 1,
    dequeue_interval_seconds: int = 1,
    start_timeout_seconds: int = 60,
    max_runtime_seconds: int = 0,
    max_concurrent_runs: int | None = None,
    run_launcher: str | None = None,
) -> dict[str, Any]:
    """The production config with test storage and test intervals; `run_launcher` "module.Class"."""
    config = production_config()
    if run_launcher is not None:
        module, _, cls = run_launcher.rpartition(".")
        config["run_launcher"] = {"module": module, "class": cls}
    if storage == "sqlite":
        config["storage"] = {"sqlite": {"base_dir": str(home)}}
    elif storage != "postgres":
        raise ValueError(f"storage is 'sqlite' or 'postgres', not {storage!r}")
    coordinator = config["run_coordinator"]["config"]
    coordinator["dequeue_interval_seconds"] = dequeue_interval_seconds
    if max_concurrent_runs is not None:
        coordinator["max_concurrent_runs"] = max_concurrent_runs
    config["run_retries"] = {
        "enabled": run_retries,
        "max_retries": max_retries,
        "retry_on_asset_or_op_failure": retry_on_asset_or_op_failure,
    }
    config["run_monitoring"] = {
        **config["run_monitoring"],
        "enabled": run_monitoring,
        "poll_interval_seconds": poll_interval_seconds,
        "start_timeout_seconds": start_timeout_seconds,
        "max_runtime_seconds": max_runtime_seconds,
    }
    return config


def write_dagster_yaml(home: Path, storage: Literal["sqlite", "postgres"] = "sqlite", **overrides: Any) -> Path:
    """Write `<home>/dagster.yaml` (see `instance_config` for the knobs); return its path."""
    home.mkdir(parents=True, exist_ok=True)
    path = home / "dagster.yaml"
    path.write_text(yaml.safe_dump(instance_config(home, storage, **overrides), sort_keys=False))
    return path
