"""Launching the way users do: a real daemon and webserver, the UI's GraphQL backfill, `dagster job launch`.

Each test waits on the backfill daemon, which looks for new backfills every 30 s (not configurable
in dagster 1.13), so a backfill test takes about a minute. The experiments folder also holds an
invalid file: the `invalid_experiment_files` code location shows its error, the others are unaffected.
"""

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from assets.concurrency import experiment_pool
from tests import REPO
from tests.harness import CHAIN
from tests.servers import FILES_LOCATION, LOCATION, DagsterServers, executable, running_servers, wait_until

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
    for name in ("ops_ui",):
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(small_demo(name), sort_keys=False))
    # 10 steps: over 40 s of work; its own seed, or its keys would be those of ops_ui's steps (cache hits)
    pool = {**small_demo("ops_pool"), "seed": 7, "faults": {"step_delay_s": 4.0}}
    (folder / "ops_pool.yaml").write_text(yaml.safe_dump(pool, sort_keys=False))
    (folder / "ops_cli.yaml").write_text(yaml.safe_dump({**small_demo("ops_cli"), "seed": 11}, sort_keys=False))
    (folder / "broken.yaml").write_text(yaml.safe_dump({**small_demo("broken"), "n_samples": 1}, sort_keys=False))
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
        records = [r for asset in CHAIN for r in instance.fetch_materializations(AssetKey([exp, asset]), limit=1000).records]
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


def test_a_backfill_and_a_job_launch_of_one_experiment_compute_its_steps_once(sqlite_servers):
    """Finding 3 of issue 10: a UI backfill and a `dagster job launch` of the same steps, launched at
    once. Whichever run comes second waits for the first: in the queue, while the pool (as the UI's
    Concurrency page shows it) names the run holding it, or, when it left the queue before the pool
    had its limit, at its step, its log naming that run. It then finds every step done."""
    servers, exp = sqlite_servers, "ops_pool"
    gql = servers.graphql
    tags = {"dagster/asset_partition_range_start": "0000", "dagster/asset_partition_range_end": "0009"}
    argv = [executable("dagster"), "job", "launch", "-w", str(servers.workspace), "-l", LOCATION, "-j", f"{exp}_train"]
    launching = subprocess.Popen(
        [*argv, "--tags", json.dumps(tags)],
        env=servers.env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    backfill_id = gql.launch_partition_backfill([[exp, a] for a in CHAIN], partition_names=STEPS, title=f"{exp} 0000-0009")
    out, _ = launching.communicate(timeout=180)
    assert launching.returncode == 0, out

    seen = []  # (status by run id, pool holders), while the runs go

    def both_done():
        runs = gql.runs({"dagster/backfill": backfill_id}) + gql.runs(job_name=f"{exp}_train")
        seen.append(({r["runId"]: r["status"] for r in runs}, pool_holders(gql, experiment_pool(exp))))
        return len(runs) == 2 and all(r["status"] in ("SUCCESS", "FAILURE", "CANCELED") for r in runs) and runs

    runs = {r["runId"]: r for r in wait_until(both_done, 300, 0.5, lambda: str(seen[-1:]))}
    assert [r["status"] for r in runs.values()] == ["SUCCESS", "SUCCESS"], servers.log("daemon")[-3000:]
    for run_id in runs:  # both went through the queue (QueuedRunCoordinator), the CLI's launch as the UI's
        kinds = [e["__typename"] for e in gql.run_events(run_id)]
        assert kinds.index("RunEnqueuedEvent") < kinds.index("RunStartingEvent") < kinds.index("RunStartEvent")
    from dagster import AssetKey

    with servers.instance() as instance:
        records = instance.fetch_materializations(AssetKey([exp, "weights"]), limit=100, ascending=True).records
    by_run: dict[str, list] = {}
    for r in records:  # in the order they were recorded: the run that held the pool first comes first
        md = r.asset_materialization.metadata
        by_run.setdefault(r.run_id, []).append(
            (r.asset_materialization.partition, md["cache"].value, md["trials_executed"].value)
        )
    first, second = (runs[run_id] for run_id in by_run)
    assert by_run[first["runId"]] == [(s, "miss", 16) for s in STEPS]  # computed once ...
    assert by_run[second["runId"]] == [(s, "hit", 0) for s in STEPS]  # ... and found done by the run that waited
    assert [r.run_id for r in records].index(second["runId"]) == N_STEPS, "no step of the second run before the first's last"
    assert second["creationTime"] < first["endTime"], "the second run was launched while the first ran (else: nothing to test)"
    print(
        f"the second run ({second['jobName']}) waited {'at its step' if second['startTime'] < first['endTime'] else 'in the queue'}"
    )
    if second["startTime"] < first["endTime"]:  # left the queue before the pool had a limit: it waited at its step
        messages = [e["message"] for e in gql.run_events(second["runId"], {"LogMessageEvent"})]
        assert any(f"Run {first['runId']} of experiment {exp}" in m and "this run waits for it" in m for m in messages), messages
    else:  # it waited in the queue, and the pool named the run holding it
        assert any(st.get(second["runId"]) == "QUEUED" and holders == [first["runId"]] for st, holders in seen), seen


def test_a_dagster_rl_train_run_is_on_its_jobs_runs_tab_and_re_executes_from_the_ui(sqlite_servers):
    """Issue 28: `dagster-rl train` (in its own process, no daemon needed) makes a run of the code
    location's job: the job's *Runs* tab lists it, with the origin the Overview timeline needs and
    the snapshot of the loaded job (so *Re-execute all* shows no warning); its re-execution from the
    UI runs (queued, by the daemon) and finds every step done; bookkeeping tags stay hidden."""
    servers, exp = sqlite_servers, "ops_cli"
    gql = servers.graphql
    done = subprocess.run(
        [executable("dagster-rl"), "train", exp, "0000...0001"],
        env=servers.env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    [run] = gql.job_runs(f"{exp}_train")
    assert f" run {run['id'][:8]} started ({exp}_train, steps 0000...0001)\n" in done.stderr, done.stderr
    assert run["runStatus"] == "SUCCESS"
    assert run["repositoryOrigin"] == {"repositoryLocationName": LOCATION, "repositoryName": "__repository__"}
    assert run["pipelineSnapshotId"] == gql.job_snapshot_id(f"{exp}_train") and run["parentPipelineSnapshotId"] is None
    assert {k: v for k, v in run["tags"].items() if not k.startswith("dagster/")} == {
        "dagster_rl/experiment": exp,
        "dagster_rl/range": "0000...0001",
    }

    again = gql.reexecute(run["id"])
    [rerun] = gql.wait_for_runs(tags={"dagster/parent_run_id": run["id"]}, count=1, timeout_s=180)
    assert rerun["runId"] == again and rerun["status"] == "SUCCESS", servers.log("daemon")[-3000:]
    assert [r["id"] for r in gql.job_runs(f"{exp}_train")] == [again, run["id"]]
    assert rerun["tags"]["dagster_rl/range"] == "0000...0001"
    from dagster import AssetKey

    with servers.instance() as instance:
        records = instance.fetch_materializations(AssetKey([exp, "weights"]), limit=10, ascending=True).records
    steps = [(r.run_id, r.asset_materialization.partition, r.asset_materialization.metadata["cache"].value) for r in records]
    assert steps == [(run["id"], "0000", "miss"), (run["id"], "0001", "miss"), (again, "0000", "hit"), (again, "0001", "hit")]


def pool_holders(gql, pool: str) -> list[str]:
    """The runs holding a slot of `pool`: what the UI's Concurrency page lists."""
    data = gql.query(
        "query Pool($key: String) { instance { concurrencyLimit(concurrencyKey: $key) { claimedSlots { runId } } } }", key=pool
    )
    return [s["runId"] for s in data["instance"]["concurrencyLimit"]["claimedSlots"]]


def test_an_invalid_experiment_file_is_a_code_location_problem_and_the_others_work(sqlite_servers):
    """Finding 7 of issue 10: one invalid file no longer makes every experiment unusable."""
    gql = sqlite_servers.graphql
    entry = wait_until(lambda: (e := gql.code_location(FILES_LOCATION))["loadStatus"] == "LOADED" and e, 60, 0.5)
    error = entry["locationOrLoadError"]
    assert error["__typename"] == "PythonError"
    shown = "\n".join([error["message"], *(c["message"] for c in error["causes"])])  # what the UI's error dialog shows
    assert "1 invalid experiment file (skipped; the valid experiments are unaffected)" in shown
    assert "broken.yaml: invalid experiment: field 'n_samples': Value error, GRPO normalizes rewards" in shown
    assert gql.code_location(LOCATION)["locationOrLoadError"]["__typename"] != "PythonError"
    assert gql.partition_statuses(["ops_ui", "weights"]) is not None  # the valid experiments are served


def test_ui_backfill_of_ten_steps_is_one_ordered_run_postgres(postgres_server, experiments_dir, tmp_path):
    with running_servers(tmp_path / "home", experiments_dir, storage="postgres", pg_env=postgres_server.env) as servers:
        with servers.instance() as instance:
            assert type(instance.run_storage).__name__ == "PostgresRunStorage"
            assert type(instance.event_log_storage).__name__ == "PostgresEventLogStorage"
        check_ui_backfill(servers, "ops_ui")
