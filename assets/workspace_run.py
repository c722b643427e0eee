"""A run of an experiment's `<exp>_train` job that belongs to the workspace's code location,
executed in this process: what `dagster-rl train` launches.

The UI finds a run through its code-location origin (`remote_job_origin`): a job's *Runs* tab
filters on the repository it names (the hidden tag `.dagster/repository`), the *Overview* timeline
leaves out a run without one, and *Re-execute* launches the job of the location it names, without
a warning when the loaded job has the run's snapshot. Dagster's in-process `execute_job` (and so
`dagster asset materialize`) creates runs without one. Here the origin is read from
`workspace.yaml` by Dagster's own loader, as the webserver and the daemon read it: the code
location that loads `assets.definitions`, its repository, the job. The run is created from the
job as this process loads it (the code server loads the same code: the same snapshot) and executed
here, as `execute_job` executes one: no code server, no daemon.

When a daemon runs on the instance, the run is one of its runs: run monitoring watches this
process, and run retries re-execute the run when it fails. An interrupt at the terminal (Ctrl-C)
cancels it instead (`cancel_if_interrupted_here`): a person stopped it, the daemon leaves it.

It runs on Dagster's private API (`resources.dagster_internals` says which names, and the Dagster
version they were checked against).
"""

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dagster import DagsterExecutionInterruptedError, DagsterInstance

from assets import REPO
from dagster_rl.base.errors import DagsterRLError
from resources.dagster_internals import (
    ReconstructableRepository,
    RemoteJobOrigin,
    RemoteRepositoryOrigin,
    WorkspaceFileTarget,
    execute_run,
)

WORKSPACE = REPO / "workspace.yaml"
MODULE, ATTRIBUTE = "assets.definitions", "defs"
REPOSITORY = "__repository__"  # the name Dagster gives the repository of a `Definitions`
INTERRUPTS = (KeyboardInterrupt, DagsterExecutionInterruptedError)
_here: set[str] = set()  # the runs this process executes for a person at a terminal
_canceled_here: set[str] = set()  # those of them an interrupt at the terminal canceled


def job_origin(job_name: str, workspace: Path = WORKSPACE) -> RemoteJobOrigin:
    """The job's origin in the code location of `workspace` that loads `assets.definitions`."""
    origins = WorkspaceFileTarget(paths=[str(workspace)]).create_origins()
    found = [o for o in origins if getattr(getattr(o, "loadable_target_origin", None), "module_name", None) == MODULE]
    if not found:
        names = ", ".join(o.location_name for o in origins) or "none"
        raise DagsterRLError(
            f"{workspace} names no code location that loads the module {MODULE} (its locations: {names}): add the "
            f"`python_module: {{module_name: {MODULE}, working_directory: ., location_name: dagster_rl}}` entry of the repository's workspace.yaml"
        )
    return RemoteJobOrigin(RemoteRepositoryOrigin(found[0], REPOSITORY), job_name)


def execute_here(instance: DagsterInstance, job_name: str, run_config: dict, tags: dict[str, str]):
    """Create a run of `job_name` with the workspace's origin, execute it in this process; its result."""
    job = ReconstructableRepository.for_module(MODULE, ATTRIBUTE, working_directory=str(REPO)).get_reconstructable_job(job_name)
    definition = job.get_definition()
    run = instance.create_run_for_job(
        definition,
        run_config=run_config,
        tags={**definition.run_tags, **tags},
        remote_job_origin=job_origin(job_name),
        job_code_origin=job.get_python_origin(),
    )
    with _executed_here(run.run_id):
        return execute_run(job, run, instance)


@contextmanager
def _executed_here(run_id: str) -> Iterator[None]:
    _here.add(run_id)
    try:
        yield
    finally:
        _here.discard(run_id)


def cancel_if_interrupted_here(instance: DagsterInstance, run) -> None:
    """For an interrupt of a run this process executes for a person at a terminal: mark it canceling,
    so that Dagster records it canceled (not failed, which a daemon's run retries would re-execute)."""
    if run.run_id in _here:
        _canceled_here.add(run.run_id)
        instance.report_run_canceling(run, message="Interrupted at the terminal (Ctrl-C): the run is canceled and not retried.")


def interrupted_here(run_id: str | None) -> bool:
    """Whether an interrupt at this process's terminal canceled the run (the console says to resume)."""
    return run_id in _canceled_here
