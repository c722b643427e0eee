"""Launching the way users do: a real daemon and webserver, the UI's GraphQL backfill, `dagster job launch`.

Each test waits on the backfill daemon, which looks for new backfills every 30 s (not configurable
in dagster 1.13), so a backfill test takes about a minute.
"""

import json
from pathlib import Path

import pytest
import yaml

from tests.postgres import postgres_server  # noqa: F401  (fixture)
from tests.servers import DagsterServers, running_servers

REPO = Path(__file__).resolve().parent.parent
CHAIN = ("rollouts", "rewards", "weights")
N_STEPS = 10
STEPS = [f"{i:04d}" for i in range(N_STEPS)]


def small_demo(name: str) -> dict:
    """The demo experiment, small: 10 steps of 4 prompts x 4 samples."""
    raw = yaml.safe_load((REPO / "experiments" / "demo.yaml").read_text())
    raw.update(name=name, n_steps=N_STEPS, prompts_per_step=4, n_samples=4, min_trials_per_step=8)
    return raw


@pytest.fixture(scope="module")
def experiments_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("experiments")
    for name in ("ops_ui", "ops_cli"):
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(small_demo(name), sort_keys=False))
    return folder


@pytest.fixture(scope="module")
def sqlite_servers(tmp_path_factory, experiments_dir):
    with running_servers(tmp_path_factory.mktemp("home"), experiments_dir) as servers:
        yield servers


def check_ui_backfill(servers: DagsterServers, exp: str) -> None:
    """launchPartitionBackfill of 0000..0009 on the three assets -> one run, steps in order, 30 partitions."""
    gql = servers.graphql
    keys = [[exp, asset] for asset in CHAIN]
    backfill_id = gql.launch_partition_backfill(keys, partition_names=STEPS, title=f"{exp} 0000-0009")

    runs = gql.wait_for_runs({"dagster/backfill": backfill_id}, count=1, timeout_s=150)
    assert len(runs) == 1, f"a single-run backfill policy makes one run, got {[(r['runId'], r['status']) for r in runs]}"
    run = runs[0]
    assert run["status"] == "SUCCESS", servers.log("daemon")[-3000:]
    assert run["tags"]["dagster/asset_partition_range_start"] == "0000"
    assert run["tags"]["dagster/asset_partition_range_end"] == "0009"

    backfill = gql.wait_for_backfill(backfill_id, timeout_s=90)
    assert backfill["status"] == "COMPLETED_SUCCESS"
    assert [r["runId"] for r in backfill["runs"]] == [run["runId"]]

    for asset in CHAIN:
        assert gql.materialized_partitions([exp, asset]) == STEPS

    # The run went through the queue (QueuedRunCoordinator) and yielded step by step, in order.
    events = gql.run_events(run["runId"])
    kinds = [e["__typename"] for e in events]
    assert kinds.index("RunEnqueuedEvent") < kinds.index("RunStartingEvent") < kinds.index("RunStartEvent")
    in_log = [(e["partition"], e["assetKey"]["path"][1]) for e in events if e["__typename"] == "MaterializationEvent"]
    expected = [(step, asset) for step in STEPS for asset in CHAIN]
    assert in_log == expected

    from dagster import AssetKey

    with servers.instance() as instance:
        records = [
            r
            for asset in CHAIN
            for r in instance.fetch_materializations(AssetKey([exp, asset]), limit=1000).records
        ]
    records.sort(key=lambda r: r.storage_id)
    assert len(records) == 3 * N_STEPS
    assert [(r.asset_materialization.partition, r.asset_key.path[1]) for r in records] == expected
    assert {r.run_id for r in records} == {run["runId"]}
    stamps = [r.timestamp for r in records]
    assert stamps == sorted(stamps) and stamps[0] < stamps[-1], "steps are recorded as they finish, not at run end"
    last = {r.asset_materialization.partition: r for r in records if r.asset_key.path[1] == "weights"}
    versions = [last[s].asset_materialization.metadata["weights_version"].value for s in STEPS]
    assert versions == list(range(1, N_STEPS + 1))


def test_ui_backfill_of_ten_steps_is_one_ordered_run_sqlite(sqlite_servers):
    check_ui_backfill(sqlite_servers, "ops_ui")


def test_job_launch_with_partition_range_is_queued_then_started_by_daemon(sqlite_servers):
    servers, exp = sqlite_servers, "ops_cli"
    tags = {"dagster/asset_partition_range_start": "0000", "dagster/asset_partition_range_end": "0003"}
    out = servers.cli("job", "launch", "-w", str(servers.workspace), "-j", f"{exp}_train", "--tags", json.dumps(tags))
    gql = servers.graphql
    runs = gql.wait_for_runs(job_name=f"{exp}_train", count=1, timeout_s=120)
    assert len(runs) == 1
    run = runs[0]
    assert run["status"] == "SUCCESS", f"{out.stdout}\n{out.stderr}\n{servers.log('daemon')[-3000:]}"
    kinds = [e["__typename"] for e in gql.run_events(run["runId"])]
    assert kinds.index("RunEnqueuedEvent") < kinds.index("RunStartingEvent") < kinds.index("RunStartEvent")
    for asset in CHAIN:
        assert gql.materialized_partitions([exp, asset]) == STEPS[:4]


def test_ui_backfill_of_ten_steps_is_one_ordered_run_postgres(postgres_server, experiments_dir, tmp_path):  # noqa: F811
    with running_servers(tmp_path / "home", experiments_dir, storage="postgres", pg_env=postgres_server.env) as servers:
        with servers.instance() as instance:
            assert type(instance.run_storage).__name__ == "PostgresRunStorage"
            assert type(instance.event_log_storage).__name__ == "PostgresEventLogStorage"
        check_ui_backfill(servers, "ops_ui")
