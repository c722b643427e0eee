"""A local run launcher that run monitoring can ask whether a run's process is still alive.

Dagster's `DefaultRunLauncher` starts each run in a process of the code server but cannot tell run
monitoring when that process dies (SIGKILL, OOM killer): the run stays STARTED for ever. This one
reads the pid the run worker recorded in its "Started process for run" event and checks it, so the
daemon's run monitoring marks the run failed and run retries resume it at its first unfinished
step. It is valid where the daemon and the run processes share one machine (the embedded default);
on Kubernetes use dagster-k8s's `K8sRunLauncher`, which checks the run's pod.

Who notices first varies: the code server that started the run worker polls its child and fails
the run itself when the code server is still alive (dagster 1.13: "Run execution process for ...
was terminated by signal 9"); this check is what notices when it is not (code server restarted or
killed as well), within one run-monitoring poll interval.

A run worker that dies leaves its step processes behind (the multiprocess executor runs each step,
here the driver, in a child process, and a SIGKILL of the parent does not reach the children): an
orphaned driver goes on walking the range and writing events into the failed run while its retry
starts (measured). So the launcher kills a run's step processes that are still alive (pids from
their "Executing step ... in subprocess" events) when its health check finds the run worker gone,
and, whoever failed the run, before it launches a retry (a run with a parent run): the parent's
run worker and step processes still alive are killed first, and the retry's log says so.

A pid is only trusted for the process that recorded it: a process that started after the event that
named its pid is another process that reuses the number.
"""

import os
import signal
import time

from dagster import DagsterEventType, DagsterRun, DefaultRunLauncher

from dagster_rl.runtime.lifetime import CLOCK_SLACK_S, process_alive, process_started_at
from resources.dagster_internals import CheckRunHealthResult, WorkerStatus


def recorded_pids(instance, run_id: str, event_type: DagsterEventType) -> list[tuple[int, float]]:
    """(pid, event timestamp) of each event of `event_type` of the run whose metadata carries a pid."""
    found = []
    for entry in instance.all_logs(run_id, of_type=event_type):
        data = entry.dagster_event.event_specific_data if entry.dagster_event else None
        metadata = getattr(data, "metadata", None) or {}
        if metadata.get("pid") is not None:
            found.append((int(metadata["pid"].value), entry.timestamp))
    return found


def run_worker(instance, run_id: str) -> tuple[int, float] | None:
    """The pid in the run's first engine event that carries one (the run worker's), and when it was logged."""
    found = recorded_pids(instance, run_id, DagsterEventType.ENGINE_EVENT)
    return found[0] if found else None


def run_worker_pid(instance, run_id: str) -> int | None:
    worker = run_worker(instance, run_id)
    return worker[0] if worker else None


def step_worker_pids(instance, run_id: str) -> list[int]:
    """Pids of the run's step processes (multiprocess executor), in the order they started."""
    return [pid for pid, _ in recorded_pids(instance, run_id, DagsterEventType.STEP_WORKER_STARTED)]


def same_process_alive(pid: int, recorded_at: float) -> bool:
    """The process that recorded `pid` at `recorded_at` is alive (not a later one with its number)."""
    if not process_alive(pid):
        return False
    started = process_started_at(pid)
    return started is None or started <= recorded_at + CLOCK_SLACK_S


def kill_and_wait(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    """SIGKILL each pid; wait until they are gone; return those signalled."""
    killed = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + timeout_s
    while any(process_alive(p) for p in killed) and time.monotonic() < deadline:
        time.sleep(0.05)
    return killed


def leftover_processes(instance, run_id: str) -> list[int]:
    """The run's run worker and step processes that are still alive (the same processes, not reused pids)."""
    recorded = recorded_pids(instance, run_id, DagsterEventType.ENGINE_EVENT)[:1]
    recorded += recorded_pids(instance, run_id, DagsterEventType.STEP_WORKER_STARTED)
    return [pid for pid, at in recorded if same_process_alive(pid, at)]


class LocalProcessRunLauncher(DefaultRunLauncher):
    def launch_run(self, context) -> None:
        run = context.dagster_run
        if run.parent_run_id:  # a retry or re-execution: its parent's processes must not race it
            stopped = kill_and_wait(leftover_processes(self._instance, run.parent_run_id))
            if stopped:
                self._instance.report_engine_event(
                    f"Killed processes {stopped} left running by parent run {run.parent_run_id} before launching this one",
                    run,
                )
        super().launch_run(context)

    @property
    def supports_check_run_worker_health(self) -> bool:
        return True

    def check_run_worker_health(self, run: DagsterRun) -> CheckRunHealthResult:
        worker = run_worker(self._instance, run.run_id)
        if worker is None:  # started, but its process has not said who it is yet
            return CheckRunHealthResult(WorkerStatus.RUNNING, "no run worker pid recorded yet")
        pid, recorded_at = worker
        if same_process_alive(pid, recorded_at):
            return CheckRunHealthResult(WorkerStatus.RUNNING, f"run worker pid {pid} is alive")
        stopped = kill_and_wait(leftover_processes(self._instance, run.run_id))
        detail = f"; killed its orphaned step process(es) {stopped} so a retry does not race them" if stopped else ""
        return CheckRunHealthResult(WorkerStatus.FAILED, f"run worker process {pid} is gone (killed or crashed){detail}")
