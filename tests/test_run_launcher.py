"""LocalProcessRunLauncher without servers: its health check and its cleanup before a retry.

Stand-in processes (`sleep`) play the run worker and the step worker; their pids go into the run's
event log exactly where Dagster puts them ("Started process for run" engine event, step worker
started event). tests/test_servers_retries.py kills real ones under a real daemon.
"""

import subprocess
import time

import pytest
import yaml
from dagster import DagsterEvent, DagsterEventType, DagsterInstance, MetadataValue
from dagster._core.events import EngineEventData
from dagster._core.launcher import LaunchRunContext
from dagster._core.launcher.base import WorkerStatus
from dagster._core.launcher.default_run_launcher import DefaultRunLauncher
from dagster._core.storage.dagster_run import DagsterRun

from resources.run_launcher import LocalProcessRunLauncher, process_alive, run_worker_pid, same_process_alive, step_worker_pids
from tests.servers import wait_until


@pytest.fixture
def instance(tmp_path):
    config = {
        "run_launcher": {"module": "resources.run_launcher", "class": "LocalProcessRunLauncher"},
        "telemetry": {"enabled": False},
    }
    (tmp_path / "dagster.yaml").write_text(yaml.safe_dump(config))
    with DagsterInstance.from_config(str(tmp_path)) as inst:
        yield inst


@pytest.fixture
def sleepers():
    procs: list[subprocess.Popen] = []

    def start() -> subprocess.Popen:
        procs.append(subprocess.Popen(["sleep", "60"]))
        return procs[-1]

    yield start
    for p in procs:
        p.kill()
        p.wait()


def started_run(instance, worker: int, step_worker: int, parent: str | None = None) -> DagsterRun:
    tags = {"dagster/parent_run_id": parent, "dagster/root_run_id": parent} if parent else {}
    run = instance.add_run(DagsterRun(job_name="demo_train", parent_run_id=parent, root_run_id=parent, tags=tags))
    instance.report_engine_event(f"Started process for run (pid: {worker}).", run, EngineEventData.in_process(worker))
    event = DagsterEvent(
        DagsterEventType.STEP_WORKER_STARTED.value,
        job_name=run.job_name,
        message='Executing step "demo_driver" in subprocess.',
        event_specific_data=EngineEventData(metadata={"pid": MetadataValue.text(str(step_worker))}),
        step_key="demo_driver",
    )
    instance.report_dagster_event(event, run.run_id)
    return run


def test_alive_run_worker_is_running_and_a_dead_one_fails_the_run_and_takes_its_step_process_with_it(instance, sleepers):
    worker, step = sleepers(), sleepers()
    run = started_run(instance, worker.pid, step.pid)
    launcher = instance.run_launcher
    assert isinstance(launcher, LocalProcessRunLauncher) and launcher.supports_check_run_worker_health
    assert (run_worker_pid(instance, run.run_id), step_worker_pids(instance, run.run_id)) == (worker.pid, [step.pid])
    assert launcher.check_run_worker_health(run).status == WorkerStatus.RUNNING

    worker.kill()  # not reaped: a zombie, dead all the same
    wait_until(lambda: not process_alive(worker.pid), 5, 0.01)
    result = launcher.check_run_worker_health(run)
    assert result.status == WorkerStatus.FAILED
    assert f"run worker process {worker.pid} is gone" in result.msg and f"[{step.pid}]" in result.msg
    step.wait(5)
    assert step.returncode == -9, "the orphaned step process was killed"


def test_a_run_without_a_recorded_pid_yet_is_running(instance):
    run = instance.add_run(DagsterRun(job_name="demo_train"))
    assert instance.run_launcher.check_run_worker_health(run).status == WorkerStatus.RUNNING


def test_a_pid_reused_by_a_later_process_is_not_the_run_worker(sleepers):
    proc = sleepers()
    assert same_process_alive(proc.pid, time.time())
    assert not same_process_alive(proc.pid, time.time() - 3600), "started an hour after its pid was recorded"
    proc.kill()
    proc.wait()
    assert not process_alive(proc.pid)


def test_launching_a_retry_kills_what_its_parent_left_running(instance, sleepers, monkeypatch):
    """Whoever failed the parent (the code server, say), its orphaned driver must not race the retry."""
    worker, step = sleepers(), sleepers()
    parent = started_run(instance, worker.pid, step.pid)
    worker.kill()
    worker.wait()
    launched = []
    monkeypatch.setattr(DefaultRunLauncher, "launch_run", lambda self, context: launched.append(context.dagster_run.run_id))
    retry = instance.add_run(DagsterRun(job_name="demo_train", parent_run_id=parent.run_id, root_run_id=parent.run_id))
    instance.run_launcher.launch_run(LaunchRunContext(dagster_run=retry, workspace=None))
    assert launched == [retry.run_id]
    step.wait(5)
    assert step.returncode == -9
    messages = [e.message for e in instance.all_logs(retry.run_id, of_type=DagsterEventType.ENGINE_EVENT)]
    assert any(f"Killed processes [{step.pid}] left running by parent run {parent.run_id}" in m for m in messages), messages
