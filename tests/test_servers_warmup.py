"""The usual launches of a group with a warm-up (`<exp>/sft`), against a real daemon and webserver:
`dagster asset materialize --select group:<exp> --partition-range`, `dagster job launch` of
`<exp>_train` with the range tags, and the UI's backfill of the whole group. Each includes the
warm-up when it is missing, and runs it before the steps.
"""

import json

import pytest
import yaml
from dagster import AssetKey

from tests.harness import LM_CHAIN
from tests.servers import running_servers
from tests.settings import shipped_settings

STEPS = [f"{i:04d}" for i in range(4)]


def warm_experiment(name: str) -> dict:
    return shipped_settings(
        "tiny_grpo",
        name=name,
        n_steps=4,
        prompts_per_step=4,
        n_samples=4,
        min_trials_per_step=8,
        warmup={"demos": 16, "steps": 10, "batch_size": 8},
    )


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("experiments")
    for name in ("wu_cli", "wu_ui"):
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(warm_experiment(name), sort_keys=False))
    with running_servers(tmp_path_factory.mktemp("home"), folder) as running:
        yield running


def records(servers, exp: str, asset: str) -> list:
    with servers.instance() as instance:
        return list(instance.fetch_materializations(AssetKey([exp, asset]), limit=1000, ascending=True).records)


def test_cli_materialize_of_the_group_then_job_launch_include_the_warmup(servers):
    exp = "wu_cli"
    out = servers.cli(
        "asset",
        "materialize",
        "-m",
        "assets.definitions",
        "--select",
        f"group:{exp}",
        "--partition-range",
        "0000...0001",
        timeout_s=600,
    )
    assert "RUN_SUCCESS" in out.stdout + out.stderr
    [sft] = records(servers, exp, "sft")
    rollouts = records(servers, exp, "rollouts")
    assert [r.asset_materialization.partition for r in rollouts] == STEPS[:2]
    assert sft.run_id == rollouts[0].run_id and sft.storage_id < rollouts[0].storage_id  # one run, the warm-up first

    tags = {"dagster/asset_partition_range_start": "0002", "dagster/asset_partition_range_end": "0003"}
    servers.cli(
        "job", "launch", "-w", str(servers.workspace), "-l", "dagster_rl", "-j", f"{exp}_train", "--tags", json.dumps(tags)
    )
    [run] = servers.graphql.wait_for_runs(job_name=f"{exp}_train", count=1, timeout_s=300)
    assert run["status"] == "SUCCESS", servers.log("daemon")[-3000:]
    sfts = records(servers, exp, "sft")
    assert len(sfts) == 2 and sfts[1].run_id == run["runId"]
    assert sfts[1].asset_materialization.metadata["cache"].value == "hit"  # the launch re-checks it: a cache hit
    for asset in LM_CHAIN:
        assert servers.graphql.materialized_partitions([exp, asset]) == STEPS


def test_ui_backfill_of_the_group_runs_the_warmup_then_the_range(servers):
    exp = "wu_ui"
    gql = servers.graphql
    keys = [[exp, "sft"], *([exp, asset] for asset in LM_CHAIN)]
    backfill_id = gql.launch_partition_backfill(keys, partition_names=STEPS, title=f"{exp} with warm-up")
    backfill = gql.wait_for_backfill(backfill_id, timeout_s=240)
    assert backfill["status"] == "COMPLETED_SUCCESS", servers.log("daemon")[-3000:]
    runs = sorted(gql.runs(tags={"dagster/backfill": backfill_id}), key=lambda r: r["startTime"])
    assert [r["status"] for r in runs] == ["SUCCESS", "SUCCESS"]
    warmup_run, range_run = runs
    assert "dagster/asset_partition_range_start" not in warmup_run["tags"]
    assert (range_run["tags"]["dagster/asset_partition_range_start"], range_run["tags"]["dagster/asset_partition_range_end"]) == (
        "0000",
        "0003",
    )
    assert warmup_run["endTime"] <= range_run["startTime"]
    [sft] = records(servers, exp, "sft")
    assert sft.run_id == warmup_run["runId"]
    for asset in LM_CHAIN:
        assert gql.materialized_partitions([exp, asset]) == STEPS
    first = records(servers, exp, "rollouts")[0].asset_materialization.metadata["behavior_policy"].value
    assert first["partition"] == "sft" and first["content_hash"] == sft.asset_materialization.metadata["content_hash"].value
