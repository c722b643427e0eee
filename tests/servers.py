"""A real `dagster-daemon` and `dagster-webserver` on 127.0.0.1 for tests, and a GraphQL client on httpx.

    def test_x(dagster_servers, tmp_path):                    # a fixture (pytest_plugins in conftest.py)
        servers = dagster_servers(experiments_dir)            # SQLite home under tmp_path
        bid = servers.graphql.launch_partition_backfill([["demo", "rollouts"], ...], partition_names=[...])
        run = servers.graphql.wait_for_runs({"dagster/backfill": bid}, count=1)[0]

`start_servers(home, experiments_dir, storage="sqlite"|"postgres", pg_env=...)` writes the instance
(tests/instance_config.py: the production config with test storage and intervals) and a workspace
file into `home`, runs `dagster instance migrate` (the daemon and webserver race on a fresh
schema otherwise), starts the daemon and the webserver in their own process groups with
DAGSTER_HOME, DAGSTER_RL_EXPERIMENTS and PYTHONPATH set (the code servers and run workers they
start inherit them), and waits until the webserver answers and the code location has loaded.
`DagsterServers.stop()` ends both process groups: SIGTERM, then SIGKILL after a grace period.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest
import yaml

from tests import REPO
from tests.instance_config import PG_ENV, write_dagster_yaml
from tests.machine import free_port

LOCATION = "dagster_rl"
FILES_LOCATION = "invalid_experiment_files"
BIN = Path(sys.executable).parent
TERMINAL_RUN_STATUSES = {"SUCCESS", "FAILURE", "CANCELED"}
TERMINAL_BACKFILL_STATUSES = {"COMPLETED", "COMPLETED_SUCCESS", "COMPLETED_FAILED", "FAILED", "CANCELED"}


def executable(name: str) -> str:
    """A Dagster console script next to this interpreter (the project's venv), else on PATH."""
    path = BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if not found:
        raise RuntimeError(f"{name} not found next to {sys.executable} nor on PATH; install the project (make install)")
    return found


def write_workspace(home: Path, module: str = "assets.definitions") -> Path:
    """A workspace file in `home` like the repo's: the code location that loads `module` from the
    repo, and the `invalid_experiment_files` location that fails naming every invalid experiment file."""
    path = home / "workspace.yaml"
    locations = [
        {"python_module": {"module_name": module, "working_directory": str(REPO), "location_name": LOCATION}},
        {
            "python_module": {
                "module_name": "assets.experiment_errors",
                "working_directory": str(REPO),
                "location_name": FILES_LOCATION,
            }
        },
    ]
    path.write_text(yaml.safe_dump({"load_from": locations}, sort_keys=False))
    return path


class GraphQLError(RuntimeError):
    pass


class GraphQLClient:
    """What the UI sends, as plain GraphQL over HTTP."""

    def __init__(self, url: str, timeout_s: float = 60.0):
        self.url = url.rstrip("/") + "/graphql"
        self.timeout_s = timeout_s

    def query(self, text: str, **variables: Any) -> dict[str, Any]:
        resp = httpx.post(self.url, json={"query": text, "variables": variables}, timeout=self.timeout_s)
        if resp.status_code != 200:
            raise GraphQLError(f"HTTP {resp.status_code} from {self.url}: {resp.text[:2000]}")
        body = resp.json()
        if body.get("errors"):
            raise GraphQLError(f"GraphQL errors: {json.dumps(body['errors'])[:4000]}")
        return body["data"]

    def query_union(self, text: str, field: str, expected: str, **variables: Any) -> dict[str, Any]:
        """Run a query whose root `field` is a union; return it if its __typename is `expected`, else raise.

        `...ERRORS` in `text` stands for `__typename` and the message of the members that are errors.
        """
        data = self.query(text.replace("...ERRORS", "__typename ... on Error { message }"), **variables)[field]
        if data["__typename"] != expected:
            stack = "".join(data.get("stack") or [])
            raise GraphQLError(f"{field}: {data['__typename']}: {data.get('message')}\n{stack}".rstrip())
        return data

    # ---- launching -------------------------------------------------------------------------

    def launch_partition_backfill(
        self,
        asset_keys: list[list[str]],
        partition_names: list[str] | None = None,
        partition_range: tuple[str, str] | None = None,
        tags: dict[str, str] | None = None,
        title: str | None = None,
    ) -> str:
        """The UI's "Materialize" dialog on partitioned assets: `launchPartitionBackfill`; returns the backfill id.

        `partition_names` is what the dialog sends (the selected keys, spelled out, with
        `assetSelection`); `partition_range` sends a `partitionsByAssets` range for each asset.
        """
        if (partition_names is None) == (partition_range is None):
            raise ValueError("give exactly one of partition_names and partition_range")
        params: dict[str, Any] = {"fromFailure": False, "tags": [{"key": k, "value": v} for k, v in (tags or {}).items()]}
        if title:
            params["title"] = title
        if partition_names is not None:
            params["assetSelection"] = [{"path": k} for k in asset_keys]
            params["partitionNames"] = list(partition_names)
        else:
            start, end = partition_range
            params["partitionsByAssets"] = [
                {"assetKey": {"path": k}, "partitions": {"range": {"start": start, "end": end}}} for k in asset_keys
            ]
        return self.query_union(
            """
            mutation Launch($backfillParams: LaunchBackfillParams!) {
              launchPartitionBackfill(backfillParams: $backfillParams) {
                ...ERRORS
                ... on PythonError { stack }
                ... on LaunchBackfillSuccess { backfillId launchedRunIds }
              }
            }""",
            "launchPartitionBackfill",
            "LaunchBackfillSuccess",
            backfillParams=params,
        )["backfillId"]

    def launch_run(self, job_name: str, tags: dict[str, str] | None = None, location: str = LOCATION) -> str:
        """The Launchpad's `launchRun` of a job (with e.g. partition-range tags); returns the run id."""
        params = {
            "selector": {"repositoryLocationName": location, "repositoryName": "__repository__", "jobName": job_name},
            "executionMetadata": {"tags": [{"key": k, "value": v} for k, v in (tags or {}).items()]},
            "runConfigData": {},
        }
        return self._launch("launchRun", "executionParams", "ExecutionParams!", params)

    def reexecute(self, parent_run_id: str, strategy: str = "ALL_STEPS") -> str:
        """A run page's *Re-execute all* (strategy ALL_STEPS) or *from failure*: `launchPipelineReexecution`
        with the parent run's id, as the UI sends it; returns the new run's id."""
        params = {"parentRunId": parent_run_id, "strategy": strategy, "extraTags": [{"key": "dagster/from_ui", "value": "true"}]}
        return self._launch("launchPipelineReexecution", "reexecutionParams", "ReexecutionParams", params)

    def _launch(self, mutation: str, argument: str, argument_type: str, params: dict[str, Any]) -> str:
        """A mutation that launches one run, given `params` as its `argument`; the run's id."""
        text = f"""
            mutation Launch($params: {argument_type}) {{
              {mutation}({argument}: $params) {{
                ...ERRORS
                ... on PythonError {{ stack }}
                ... on LaunchRunSuccess {{ run {{ runId }} }}
              }}
            }}"""
        return self.query_union(text, mutation, "LaunchRunSuccess", params=params)["run"]["runId"]

    # ---- reading ---------------------------------------------------------------------------

    def job_runs(self, job_name: str, location: str = LOCATION) -> list[dict[str, Any]]:
        """What a job's *Runs* tab lists, newest first: its query (`runsFeedOrError`, view RUNS), filtered
        as the tab filters, on the job's name and its code location's repository (the hidden tag
        `.dagster/repository`). Each: id, runStatus, tags (a dict: what the run list can show),
        repositoryOrigin (the Overview timeline leaves out a run without one), pipelineSnapshotId."""
        data = self.query_union(
            """
            query JobRuns($filter: RunsFilter) {
              runsFeedOrError(limit: 25, filter: $filter, view: RUNS) {
                ...ERRORS
                ... on RunsFeedConnection {
                  results {
                    id runStatus jobName tags { key value }
                    ... on Run { repositoryOrigin { repositoryLocationName repositoryName } pipelineSnapshotId parentPipelineSnapshotId }
                  }
                }
              }
            }""",
            "runsFeedOrError",
            "RunsFeedConnection",
            filter={"pipelineName": job_name, "tags": [{"key": ".dagster/repository", "value": f"__repository__@{location}"}]},
        )
        return [{**r, "tags": {t["key"]: t["value"] for t in r["tags"]}} for r in data["results"]]

    def job_snapshot_id(self, job_name: str, location: str = LOCATION) -> str:
        """The snapshot id of the job as its code location loads it now (the UI's workspace data)."""
        data = self.query_union(
            """
            query Jobs($selector: RepositorySelector!) {
              repositoryOrError(repositorySelector: $selector) {
                ...ERRORS
                ... on Repository { pipelines { name pipelineSnapshotId } }
              }
            }""",
            "repositoryOrError",
            "Repository",
            selector={"repositoryLocationName": location, "repositoryName": "__repository__"},
        )
        return next(p["pipelineSnapshotId"] for p in data["pipelines"] if p["name"] == job_name)

    def backfill(self, backfill_id: str) -> dict[str, Any]:
        return self.query_union(
            """
            query Backfill($id: String!) {
              partitionBackfillOrError(backfillId: $id) {
                ...ERRORS
                ... on PartitionBackfill {
                  id status numPartitions partitionNames
                  runs(limit: 100) { runId status }
                  error { message }
                }
              }
            }""",
            "partitionBackfillOrError",
            "PartitionBackfill",
            id=backfill_id,
        )

    def runs(
        self,
        tags: dict[str, str] | None = None,
        job_name: str | None = None,
        statuses: list[str] | None = None,
        run_ids: list[str] | None = None,
    ) -> list[dict[str, Any]]:
        """Runs matching the filter, newest first: runId, status, jobName, tags (a dict), timings."""
        run_filter: dict[str, Any] = {}
        if run_ids:
            run_filter["runIds"] = list(run_ids)
        if tags:
            run_filter["tags"] = [{"key": k, "value": v} for k, v in tags.items()]
        if job_name:
            run_filter["pipelineName"] = job_name
        if statuses:
            run_filter["statuses"] = statuses
        data = self.query_union(
            """
            query Runs($filter: RunsFilter) {
              runsOrError(filter: $filter) {
                ...ERRORS
                ... on Runs { results { runId status jobName creationTime startTime endTime tags { key value } } }
              }
            }""",
            "runsOrError",
            "Runs",
            filter=run_filter,
        )
        return [{**r, "tags": {t["key"]: t["value"] for t in r["tags"]}} for r in data["results"]]

    def run_events(self, run_id: str, types: set[str] | None = None) -> list[dict[str, Any]]:
        """The run's event log in order: __typename, message, timestamp, and for asset events assetKey and partition."""
        events, cursor = [], None
        while True:
            data = self.query_union(
                """
                query Logs($runId: ID!, $cursor: String) {
                  logsForRun(runId: $runId, afterCursor: $cursor, limit: 1000) {
                    ...ERRORS
                    ... on EventConnection {
                      cursor hasMore
                      events {
                        __typename
                        ... on MessageEvent { message timestamp level }
                        ... on MaterializationEvent { assetKey { path } partition }
                      }
                    }
                  }
                }""",
                "logsForRun",
                "EventConnection",
                runId=run_id,
                cursor=cursor,
            )
            events += data["events"]
            cursor = data["cursor"]
            if not data["hasMore"]:
                break
        return [e for e in events if types is None or e["__typename"] in types]

    def partition_statuses(self, asset_key: list[str]) -> dict[str, list[str]]:
        """materializedPartitions, failedPartitions, materializingPartitions, unmaterializedPartitions."""
        data = self.query_union(
            """
            query Statuses($key: AssetKeyInput!) {
              assetNodeOrError(assetKey: $key) {
                ...ERRORS
                ... on AssetNode {
                  assetPartitionStatuses {
                    __typename
                    ... on DefaultPartitionStatuses {
                      materializedPartitions failedPartitions materializingPartitions unmaterializedPartitions
                    }
                  }
                }
              }
            }""",
            "assetNodeOrError",
            "AssetNode",
            key={"path": asset_key},
        )
        statuses = dict(data["assetPartitionStatuses"])
        statuses.pop("__typename", None)
        return statuses

    def materialized_partitions(self, asset_key: list[str]) -> list[str]:
        return sorted(self.partition_statuses(asset_key)["materializedPartitions"])

    def code_location(self, name: str = LOCATION) -> dict[str, Any]:
        data = self.query_union(
            """
            query Workspace {
              workspaceOrError {
                ...ERRORS
                ... on Workspace {
                  locationEntries {
                    name loadStatus
                    locationOrLoadError { __typename ... on PythonError { message stack causes { message } } }
                  }
                }
              }
            }""",
            "workspaceOrError",
            "Workspace",
        )
        entries = {e["name"]: e for e in data["locationEntries"]}
        if name not in entries:
            raise GraphQLError(f"no code location {name!r} in the workspace; have {sorted(entries)}")
        return entries[name]

    def daemon_health(self) -> dict[str, bool]:
        data = self.query(
            """
            query Daemons { instance { daemonHealth { allDaemonStatuses { daemonType healthy required } } } }"""
        )
        return {
            d["daemonType"]: bool(d["healthy"]) for d in data["instance"]["daemonHealth"]["allDaemonStatuses"] if d["required"]
        }

    # ---- waiting ---------------------------------------------------------------------------

    def wait_for_runs(
        self,
        tags: dict[str, str] | None = None,
        count: int = 1,
        job_name: str | None = None,
        timeout_s: float = 180.0,
        poll_s: float = 1.0,
    ) -> list[dict[str, Any]]:
        """Wait until at least `count` matching runs exist and all of them have finished; newest first."""
        return wait_until(
            lambda: (
                (rs := self.runs(tags=tags, job_name=job_name))
                and len(rs) >= count
                and all(r["status"] in TERMINAL_RUN_STATUSES for r in rs)
                and rs
            ),
            timeout_s,
            poll_s,
            lambda: (
                f"runs {tags or ''} {job_name or ''}: {[(r['runId'][:8], r['status']) for r in self.runs(tags=tags, job_name=job_name)]}"
            ),
        )

    def wait_for_backfill(self, backfill_id: str, timeout_s: float = 180.0, poll_s: float = 1.0) -> dict[str, Any]:
        """Wait until the backfill reaches a terminal status (the daemon checks every 30 s)."""
        return wait_until(
            lambda: (b := self.backfill(backfill_id))["status"] in TERMINAL_BACKFILL_STATUSES and b,
            timeout_s,
            poll_s,
            lambda: f"backfill {backfill_id}: {self.backfill(backfill_id)['status']}",
        )


def wait_until(fn: Callable[[], Any], timeout_s: float, poll_s: float = 0.5, describe: Callable[[], str] | None = None) -> Any:
    """Call fn until it returns something truthy; return that. TimeoutError (with describe()) otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            state = describe() if describe else ""
            raise TimeoutError(f"not done after {timeout_s:.0f} s {state}")
        time.sleep(poll_s)


@dataclass
class DagsterServers:
    """A running daemon and webserver over one DAGSTER_HOME."""

    home: Path
    workspace: Path
    port: int
    env: dict[str, str]
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def graphql(self) -> GraphQLClient:
        return GraphQLClient(self.url)

    def log(self, name: str) -> str:
        path = self.home / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def cli(self, *args: str, timeout_s: float = 120.0, check: bool = True) -> subprocess.CompletedProcess:
        """Run `dagster <args>` with the servers' environment (DAGSTER_HOME, experiments, PYTHONPATH)."""
        done = subprocess.run(
            [executable("dagster"), *args], env=self.env, cwd=REPO, capture_output=True, text=True, timeout=timeout_s
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"dagster {' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        return done

    @contextmanager
    def instance(self):
        """The same instance, opened in the test process (for event storage ids, run records)."""
        from dagster import DagsterInstance

        saved = {k: os.environ.get(k) for k in ("DAGSTER_HOME", *PG_ENV)}
        os.environ.update({k: self.env[k] for k in saved if k in self.env})
        try:
            instance = DagsterInstance.from_config(str(self.home))
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        try:
            yield instance
        finally:
            instance.dispose()

    def _start(self, name: str, argv: list[str]) -> None:
        log = open(self.home / f"{name}.log", "ab")
        try:
            self.procs[name] = subprocess.Popen(
                argv, env=self.env, cwd=self.home, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        finally:
            log.close()

    def start(self, timeout_s: float = 180.0) -> "DagsterServers":
        migrate = subprocess.run(
            [executable("dagster"), "instance", "migrate"],
            env=self.env,
            cwd=self.home,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if migrate.returncode != 0:
            raise RuntimeError(f"dagster instance migrate failed:\n{migrate.stdout}\n{migrate.stderr}")
        self._start("daemon", [executable("dagster-daemon"), "run", "-w", str(self.workspace)])
        self._start(
            "webserver",
            [executable("dagster-webserver"), "-h", "127.0.0.1", "-p", str(self.port), "-w", str(self.workspace)],
        )
        try:
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}; its log:\n{self.log(name)[-6000:]}")

    def wait_ready(self, timeout_s: float) -> None:
        """The webserver answers /server_info, the code location is loaded, the daemon heartbeats."""

        def webserver_up() -> bool:
            self._check_alive()
            try:
                return httpx.get(f"{self.url}/server_info", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(webserver_up, timeout_s, 0.5, lambda: f"(webserver on {self.url}):\n{self.log('webserver')[-4000:]}")

        def location_loaded() -> bool:
            self._check_alive()
            entry = self.graphql.code_location()
            error = entry["locationOrLoadError"]
            if error and error["__typename"] == "PythonError":
                raise RuntimeError(f"code location {LOCATION} failed to load: {error['message']}\n{''.join(error['stack'])}")
            return entry["loadStatus"] == "LOADED" and error is not None

        wait_until(location_loaded, timeout_s, 0.5, lambda: "(code location)")

        def daemon_healthy() -> bool:
            self._check_alive()
            health = self.graphql.daemon_health()
            return bool(health) and all(health.values())

        wait_until(
            daemon_healthy,
            timeout_s,
            0.5,
            lambda: f"(daemon health {self.graphql.daemon_health()}):\n{self.log('daemon')[-4000:]}",
        )

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM each process group, wait, then SIGKILL what is left of the group."""
        for proc in self.procs.values():
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self.procs.values():
            _signal_group(proc, signal.SIGKILL)  # children (code servers, run workers) of the group too
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.procs.clear()


def _signal_group(proc: subprocess.Popen, sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)  # start_new_session: the group id is the leader's pid
    except (ProcessLookupError, PermissionError):
        pass


def server_env(home: Path, experiments_dir: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, **(extra or {})}
    env["DAGSTER_HOME"] = str(home)
    env["DAGSTER_RL_EXPERIMENTS"] = str(experiments_dir)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["DAGSTER_DISABLE_TELEMETRY"] = "1"
    return env


def start_servers(
    home: Path,
    experiments_dir: Path,
    storage: Literal["sqlite", "postgres"] = "sqlite",
    pg_env: dict[str, str] | None = None,
    port: int | None = None,
    extra_env: dict[str, str] | None = None,
    timeout_s: float = 180.0,
    **instance_overrides: Any,
) -> DagsterServers:
    """Write the instance and workspace into `home`, start daemon + webserver; see the module doc."""
    if storage == "postgres" and not pg_env:
        raise ValueError("storage='postgres' needs pg_env (DAGSTER_PG_* settings; see tests/postgres.py)")
    home.mkdir(parents=True, exist_ok=True)
    write_dagster_yaml(home, storage, **instance_overrides)
    workspace = write_workspace(home)
    env = server_env(home, experiments_dir, {**(pg_env or {}), **(extra_env or {})})
    return DagsterServers(home, workspace, port or free_port(), env).start(timeout_s)


@contextmanager
def running_servers(home: Path, experiments_dir: Path, **kwargs: Any) -> Iterator[DagsterServers]:
    servers = start_servers(home, experiments_dir, **kwargs)
    try:
        yield servers
    finally:
        servers.stop()


@pytest.fixture
def dagster_servers(tmp_path) -> Iterator[Callable[..., DagsterServers]]:
    """dagster_servers(experiments_dir, **start_servers kwargs) -> running servers, stopped at teardown."""
    started: list[DagsterServers] = []

    def start(experiments_dir: Path, home: Path | None = None, **kwargs: Any) -> DagsterServers:
        servers = start_servers(home or tmp_path / f"dagster_home_{len(started)}", experiments_dir, **kwargs)
        started.append(servers)
        return servers

    yield start
    for servers in started:
        servers.stop()
