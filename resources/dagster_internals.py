"""Dagster's private API that the Dagster layer uses, in one place: no other module of `assets/` or
`resources/` imports `dagster._core` (tests/test_layout.py checks it). Checked against dagster
1.13.27 and dagster-k8s 0.29.27; on an upgrade, check these first.

- `CheckRunHealthResult`, `WorkerStatus` (`dagster._core.launcher.base`): what a run launcher's
  `check_run_worker_health` answers run monitoring (`resources.run_launcher`).
- `AssetCheckEvaluationTargetMaterializationData`
  (`dagster._core.definitions.asset_checks.asset_check_evaluation`): names the materialization an
  asset check's evaluation checked, so the UI shows the check on that step (`assets.weights_checks`).
- `WorkspaceFileTarget` (`dagster._core.workspace.load_target`): reads `workspace.yaml` with the
  loader of the webserver and the daemon; `RemoteRepositoryOrigin`, `RemoteJobOrigin`
  (`dagster._core.remote_origin`): the code-location origin a run needs for the UI to list it
  under its job; `ReconstructableRepository` (`dagster._core.definitions.reconstruct`): the job as
  a code server loads it from `assets.definitions`; `execute_run` (`dagster._core.execution.api`):
  executes that run in this process (`assets.workspace_run`, what `dagster-rl train` runs).

What `dagster` exports at its top level (`DagsterRun`, `DagsterEvent`, `DagsterRunStatus`,
`DagsterExecutionInterruptedError`, `open_pipes_session`, `PipesClientCompletedInvocation`) is
imported from `dagster` where it is used. `deploy/dagster.yaml` names the run coordinator's module
(`dagster._core.run_coordinator`), as Dagster's instance configuration does. Tests that build
Dagster's internal records to drive a launcher import them themselves.
"""

from dagster._core.definitions.asset_checks.asset_check_evaluation import AssetCheckEvaluationTargetMaterializationData
from dagster._core.definitions.reconstruct import ReconstructableRepository
from dagster._core.execution.api import execute_run
from dagster._core.launcher.base import CheckRunHealthResult, WorkerStatus
from dagster._core.remote_origin import RemoteJobOrigin, RemoteRepositoryOrigin
from dagster._core.workspace.load_target import WorkspaceFileTarget

__all__ = [
    "AssetCheckEvaluationTargetMaterializationData",
    "CheckRunHealthResult",
    "ReconstructableRepository",
    "RemoteJobOrigin",
    "RemoteRepositoryOrigin",
    "WorkerStatus",
    "WorkspaceFileTarget",
    "execute_run",
]
