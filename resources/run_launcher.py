"""A local run launcher that run monitoring can ask whether a run's process is still alive.

Dagster's `DefaultRunLauncher` starts each run in a process of the code server but cannot tell run
monitoring when that process dies (SIGKILL, OOM killer): the run stays STARTED for ever. This one
reads the pid the run worker recorded in its "Started process for run" event and checks it, so the
daemon's run monitoring marks the run failed and run retries resume it at its first unfinished
step. It is valid where the daemon and the run processes share one machine (the embedded default);
on Kubernetes use dagster-k8s's `K8sRunLauncher`, which checks the run's pod.
"""

import os
from pathlib import Path

from dagster import DagsterEventType, DefaultRunLauncher
from dagster._core.launcher.base import CheckRunHealthResult, WorkerStatus
from dagster._core.storage.dagster_run import DagsterRun


def run_worker_pid(instance, run_id: str) -> int | None:
    """The pid in the run's first engine event that carries one: the run worker's."""
    for entry in instance.all_logs(run_id, of_type=DagsterEventType.ENGINE_EVENT):
        data = entry.dagster_event.engine_event_data if entry.dagster_event else None
        pid = data.metadata.get("pid") if data and data.metadata else None
        if pid is not None:
            return int(pid.value)
    return None


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    status = Path(f"/proc/{pid}/status")
    if status.exists():  # a killed child not yet reaped by its parent is a zombie: dead all the same
        state = next((line for line in status.read_text().splitlines() if line.startswith("State:")), "")
        return "Z" not in state.split()[1:2]
    return True


class LocalProcessRunLauncher(DefaultRunLauncher):
    @property
    def supports_check_run_worker_health(self) -> bool:
        return True

    def check_run_worker_health(self, run: DagsterRun) -> CheckRunHealthResult:
        pid = run_worker_pid(self._instance, run.run_id)
        if pid is None:  # started, but its process has not said who it is yet
            return CheckRunHealthResult(WorkerStatus.RUNNING, "no run worker pid recorded yet")
        if process_alive(pid):
            return CheckRunHealthResult(WorkerStatus.RUNNING, f"run worker pid {pid} is alive")
        return CheckRunHealthResult(WorkerStatus.FAILED, f"run worker process {pid} is gone (killed or crashed)")
