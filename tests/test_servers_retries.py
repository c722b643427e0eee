"""Run retries with the real daemon: a crashed run and a killed run process are retried by the daemon
and end with the weights of an uninterrupted run; the LLM judge is paid once per trial.

One daemon + webserver for the module. Instance (tests/instance_config.py): the production run
retries (max_retries 2, retry_on_asset_or_op_failure true), run monitoring polling every second,
and `resources.run_launcher.LocalProcessRunLauncher`. The code location's judge is the LLM judge
(backend `openai`, chosen by DAGSTER_RL_JUDGE_URL in the servers' environment) over the
OpenAI-compatible stub that this test process serves on 127.0.0.1; the stub counts its calls.
Runs are launched the way the Launchpad does (GraphQL `launchRun` with partition-range tags) and
dequeued by the daemon within a second. Each experiment has its own seed, so none reuses another's
artifacts from the shared store; the reference runs the same settings without faults, in-process,
in a separate home and artifact store.
"""

import os
import signal
import time
from pathlib import Path

import pytest

from dagster_rl.store.artifact_store import DATA, ArtifactStore
from resources.run_launcher import process_alive, run_worker_pid, step_worker_pids
from tests.harness import CHAIN, new_dagster_home, open_lab
from tests.openai_stub import STUB_MODEL, OpenAIStub, judge_on
from tests.servers import LOCATION, DagsterServers, running_servers, wait_until
from tests.settings import demo_settings, write_experiments

TRIALS = 16  # 4 prompts x 4 samples
LAUNCHER = "resources.run_launcher.LocalProcessRunLauncher"
TERMINAL = ("SUCCESS", "FAILURE", "CANCELED")


def settings(name: str, seed: int, n_steps: int, **faults) -> dict:
    return demo_settings(
        name=name, seed=seed, n_steps=n_steps, prompts_per_step=4, n_samples=4, min_trials_per_step=8, faults=faults
    )


EXPERIMENTS = {
    "crash": settings("crash", 11, 8, crash_driver_at_step=3),
    # 2 s per computed step: a kill after step 0001 lands in step 0002, with time to spare
    "kill_worker": settings("kill_worker", 12, 5, step_delay_s=2.0),
    "kill_step": settings("kill_step", 13, 5, step_delay_s=2.0),
    "judged": settings("judged", 14, 4, judge_flake_rate=0.3),
    "unranged": settings("unranged", 15, 4),
}


def steps(n: int) -> list[str]:
    return [f"{i:04d}" for i in range(n)]


@pytest.fixture(scope="module")
def stub():
    with OpenAIStub() as server:
        yield server


@pytest.fixture(scope="module")
def servers(tmp_path_factory, stub):
    folder = write_experiments(tmp_path_factory.mktemp("experiments"), *EXPERIMENTS.values())
    env = {"DAGSTER_RL_JUDGE_URL": stub.base_url, "DAGSTER_RL_JUDGE_MODEL": STUB_MODEL}
    with running_servers(tmp_path_factory.mktemp("home"), folder, extra_env=env, run_launcher=LAUNCHER) as running:
        yield running


@pytest.fixture(scope="module")
def reference(tmp_path_factory, stub):
    """Uninterrupted in-process runs of the crash and kill experiments, without faults, own artifact store."""
    home = new_dagster_home(tmp_path_factory.mktemp("reference") / "home")
    clean = [{**EXPERIMENTS[name], "faults": {}} for name in ("crash", "kill_worker", "kill_step")]
    lab = open_lab(home, write_experiments(home / "experiments", *clean), judge=judge_on(stub))
    for raw in clean:
        lab.run(raw["name"], "0000", steps(raw["n_steps"])[-1])
    yield lab
    lab.close()


# ---- helpers -------------------------------------------------------------------------------


def launch(servers: DagsterServers, exp: str, n_steps: int) -> str:
    tags = {"dagster/asset_partition_range_start": "0000", "dagster/asset_partition_range_end": steps(n_steps)[-1]}
    return servers.graphql.launch_run(f"{exp}_train", tags)


def wait_for_retried(servers: DagsterServers, root: str, timeout_s: float = 150) -> list[dict]:
    """[the root run, its retry] once the retry has finished; times out if the root is not retried."""
    gql = servers.graphql

    def done():
        retries = gql.runs(tags={"dagster/root_run_id": root})
        if retries and all(r["status"] in TERMINAL for r in retries):
            return [*gql.runs(run_ids=[root]), *reversed(retries)]
        return None

    def describe() -> str:
        runs = gql.runs(run_ids=[root]) + gql.runs(tags={"dagster/root_run_id": root})
        return f"{[(r['runId'][:8], r['status']) for r in runs]}\n{servers.log('daemon')[-3000:]}"

    return wait_until(done, timeout_s, 1.0, describe)


def wait_for_run(servers: DagsterServers, run_id: str, timeout_s: float = 120) -> dict:
    gql = servers.graphql
    return wait_until(lambda: (r := gql.runs(run_ids=[run_id])[0])["status"] in TERMINAL and r, timeout_s, 1.0)


def metadata_by_run(servers: DagsterServers, exp: str) -> dict[str, dict[str, dict[str, dict]]]:
    """run id -> asset -> partition -> metadata values of the run's materialization."""
    from dagster import AssetKey

    out: dict = {}
    with servers.instance() as instance:
        for asset in CHAIN:
            for r in instance.fetch_materializations(AssetKey([exp, asset]), limit=1000, ascending=True).records:
                m = r.asset_materialization
                out.setdefault(r.run_id, {}).setdefault(asset, {})[m.partition] = {k: v.value for k, v in m.metadata.items()}
    return out


def final_weights(store_url: str, meta: dict) -> tuple[str, bytes]:
    return meta["content_hash"], ArtifactStore(store_url).get("weights", meta["artifact_key"], DATA)


def assert_weights_identical(servers: DagsterServers, reference, exp: str, retry_meta: dict) -> None:
    last = steps(EXPERIMENTS[exp]["n_steps"])[-1]
    served = final_weights(f"file://{servers.home}/artifacts", retry_meta["weights"][last])
    ref_meta = reference.latest(exp, "weights", last)
    ref = final_weights(reference.store().url, ref_meta)
    assert served[0] == ref[0], "content hash of the final weights differs from the uninterrupted run"
    assert served[1] == ref[1] and len(served[1]) > 100, "data.json of the final weights differs from the uninterrupted run"
    for step in steps(EXPERIMENTS[exp]["n_steps"]):
        assert retry_meta["weights"][step]["content_hash"] == reference.latest(exp, "weights", step)["content_hash"], step


def failure_messages(servers: DagsterServers, run_id: str) -> list[str]:
    return [e["message"] for e in servers.graphql.run_events(run_id, {"RunFailureEvent", "EngineEvent"})]


# ---- (a) a crash mid-range -----------------------------------------------------------------


def test_a_run_crashed_mid_range_is_retried_by_the_daemon_and_ends_as_if_uninterrupted(servers, reference, stub):
    calls = stub.count
    root = launch(servers, "crash", 8)
    first, retry = wait_for_retried(servers, root)
    assert first["status"] == "FAILURE" and retry["status"] == "SUCCESS", servers.log("daemon")[-3000:]
    assert retry["tags"]["dagster/retry_number"] == "1" and retry["tags"]["dagster/parent_run_id"] == root

    meta = metadata_by_run(servers, "crash")
    assert sorted(meta[root]["weights"]) == steps(4), "the driver crashed after step 0003 (faults.crash_driver_at_step)"
    again = meta[retry["runId"]]
    assert sorted(again["weights"]) == steps(8)
    for step in steps(4):  # finished steps: cache hits, nothing regenerated or re-judged
        for asset in CHAIN:
            m = again[asset][step]
            assert (m["cache"], m["trials_executed"], m["judge_calls"]) == ("hit", 0, 0), (step, asset, m)
    for step in steps(8)[4:]:
        assert again["weights"][step]["cache"] == "miss" and again["weights"][step]["trials_executed"] == TRIALS

    every = [m for run in (root, retry["runId"]) for asset in CHAIN for m in meta[run][asset].values()]
    assert len({m["started_at"] for m in every}) == 1, "started_at is recorded once per root run"
    assert {m["attempt"] for a in CHAIN for m in meta[root][a].values()} == {0}
    assert {m["attempt"] for a in CHAIN for m in again[a].values()} == {1}
    assert_weights_identical(servers, reference, "crash", again)
    assert stub.count - calls == 8 * TRIALS, "each trial judged once across the crash and the retry"


# ---- (b) a killed run process --------------------------------------------------------------


def parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def launch_and_wait_for_step(servers: DagsterServers, exp: str, step: str) -> tuple[str, int, int]:
    """Launch 0000..0004; return (run id, run worker pid, step worker pid) once `step`'s weights are in."""
    gql = servers.graphql
    root = launch(servers, exp, 5)
    wait_until(lambda: step in gql.materialized_partitions([exp, "weights"]), 120, 0.2, lambda: servers.log("daemon")[-2000:])
    with servers.instance() as instance:
        worker, step_workers = run_worker_pid(instance, root), step_worker_pids(instance, root)
    assert worker and len(step_workers) == 1, (worker, step_workers)
    # The run worker is the code server's child that runs the job; the multiprocess executor runs
    # the job's one step (the driver) in a child process of the run worker.
    assert parent_pid(step_workers[0]) == worker
    return root, worker, step_workers[0]


def check_resumed(servers: DagsterServers, reference, exp: str, root: str, retry: dict) -> dict:
    """The retry reuses every step the killed run finished and computes the rest; weights identical."""
    meta = metadata_by_run(servers, exp)
    finished = sorted(meta[root]["weights"])
    assert finished == steps(len(finished)) and 2 <= len(finished) < 5, finished
    again = meta[retry["runId"]]
    assert sorted(again["weights"]) == steps(5)
    for step in finished:
        for asset in CHAIN:
            m = again[asset][step]
            assert (m["cache"], m["trials_executed"]) == ("hit", 0), (step, asset, m)
    # The step that was running when the process died is computed again from what it had stored
    # (its rollouts and rewards, when the kill landed in its update); every later step is new.
    # (A step whose weights were stored in the instant between its artifact write and its
    # materialization event would be a hit: a window of microseconds, allowed at the boundary only.)
    boundary = steps(5)[len(finished)]
    assert again["weights"][boundary]["cache"] in ("miss", "hit")
    for step in steps(5)[len(finished) + 1 :]:
        assert again["weights"][step]["cache"] == "miss" and again["weights"][step]["trials_executed"] == TRIALS
    assert_weights_identical(servers, reference, exp, again)
    every = [m for run in (root, retry["runId"]) for a in CHAIN for m in meta[run][a].values()]
    assert len({m["started_at"] for m in every}) == 1
    return {"finished_before_kill": len(finished), "boundary": again["weights"][boundary]}


def test_a_sigkilled_run_worker_is_failed_by_the_daemon_and_retried_from_the_first_unfinished_step(servers, reference, stub):
    """SIGKILL of the run worker (`dagster api` run process of the code server) during step 0002."""
    calls = stub.count
    root, worker, step_worker = launch_and_wait_for_step(servers, "kill_worker", "0001")
    os.kill(worker, signal.SIGKILL)
    killed_at = time.monotonic()
    first, retry = wait_for_retried(servers, root)
    assert first["status"] == "FAILURE" and retry["status"] == "SUCCESS", servers.log("daemon")[-3000:]

    # Who noticed: the code server polls its run worker and fails the run when it is alive;
    # run monitoring's LocalProcessRunLauncher check fails it otherwise (within one poll). Both count.
    messages = failure_messages(servers, root)
    detected = [m for m in messages if f"run worker process {worker} is gone" in m or "terminated by signal 9" in m]
    assert detected, messages
    # The orphaned step process (the driver) does not outlive its run worker: it dies with its parent
    # (dagster_rl.runtime.lifetime); one that did not would be killed by the launcher when its health check
    # finds the worker gone, or before it launches the retry (tests/test_run_launcher.py).
    assert not process_alive(step_worker), f"orphaned driver process {step_worker} still running"
    print(f"kill -> retry finished in {time.monotonic() - killed_at:.1f} s; detected by: {detected}")
    resumed = check_resumed(servers, reference, "kill_worker", root, retry)
    judged = stub.count - calls
    # One call per trial, but a kill can land between a judge's reply and its journal write: at
    # most the trials of the killed step may be judged twice.
    assert 5 * TRIALS <= judged <= 6 * TRIALS, judged
    print(f"resumed: {resumed}; judge calls {judged} for {5 * TRIALS} trials")


def test_a_sigkilled_step_process_fails_the_run_which_the_daemon_retries(servers, reference):
    """SIGKILL of the step process that runs the driver: the run worker reports the step failed."""
    root, worker, step_worker = launch_and_wait_for_step(servers, "kill_step", "0001")
    os.kill(step_worker, signal.SIGKILL)
    first, retry = wait_for_retried(servers, root)
    assert first["status"] == "FAILURE" and retry["status"] == "SUCCESS", servers.log("daemon")[-3000:]
    steps_failed = [e["message"] for e in servers.graphql.run_events(root, {"ExecutionStepFailureEvent"})]
    assert steps_failed, "the run worker saw its step process die"
    assert not process_alive(worker), "the run worker ended after failing the run"
    check_resumed(servers, reference, "kill_step", root, retry)


# ---- (c) the LLM judge under flakes --------------------------------------------------------


def test_the_judge_server_counts_one_call_per_trial_under_judge_flakes(servers, stub):
    calls = stub.count
    root = launch(servers, "judged", 4)
    run = wait_for_run(servers, root)
    assert run["status"] == "SUCCESS", servers.log("daemon")[-3000:]
    rewards = metadata_by_run(servers, "judged")[root]["rewards"]
    assert stub.count - calls == 4 * TRIALS, "the judge server received exactly one call per trial"
    assert all(rewards[s]["n_trials"] == TRIALS for s in steps(4))
    attempts = sum(rewards[s]["judge_calls"] for s in steps(4))
    assert attempts > 4 * TRIALS, "with judge_flake_rate 0.3 some judgements flaked and were replayed from the journal"
    print(f"judge attempts {attempts}, judge server calls {stub.count - calls}, trials {4 * TRIALS}")


# ---- (d) a launch that names no range of steps ---------------------------------------------


def test_a_job_launch_without_a_range_fails_before_any_step_says_what_to_run_and_is_not_retried(servers):
    """`dagster job launch -j <exp>_train` without the range tags: the executor refuses the run
    before any step starts, its error gives the command to use, and the daemon does not retry it
    (before: "Cannot access partition_key for a non-partitioned run", three failed runs)."""
    from dagster import DagsterEventType

    servers.cli("job", "launch", "-w", str(servers.workspace), "-l", LOCATION, "-j", "unranged_train")
    gql = servers.graphql

    def finished() -> list[dict]:
        runs = gql.runs(job_name="unranged_train")
        return runs if runs and all(r["status"] in TERMINAL for r in runs) else []

    [run] = wait_until(finished, 120, 1.0, lambda: servers.log("daemon")[-3000:])
    assert run["status"] == "FAILURE"
    assert run["tags"]["dagster/max_retries"] == "0" and run["tags"]["dagster/will_retry"] == "false"
    kinds = [e["__typename"] for e in gql.run_events(run["runId"])]
    assert "ExecutionStepStartEvent" not in kinds and "MaterializationEvent" not in kinds, kinds
    with servers.instance() as instance:
        [failure] = instance.all_logs(run["runId"], of_type=DagsterEventType.RUN_FAILURE)
    error = failure.dagster_event.event_specific_data.error
    assert error.cls_name == "NoRangeError", error.to_string()
    assert "this run of unranged_train names no range of steps" in error.message
    tags = '{"dagster/asset_partition_range_start": "0000", "dagster/asset_partition_range_end": "0003"}'
    assert f"dagster job launch -w workspace.yaml -l dagster_rl -j unranged_train --tags '{tags}'" in error.message
    time.sleep(8)  # the retry daemon polls every few seconds: it had its chances
    assert len(gql.runs(job_name="unranged_train")) == 1, "the daemon retried a run that cannot succeed"
