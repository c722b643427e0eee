"""One run of an experiment at a time, and no run left STARTED by a dead process.

Each experiment's driver is in the Dagster concurrency pool `dagster_rl/<experiment>` with a limit
of 1, set by the executor on the pool the first time a run of the experiment executes, unless the
instance has one for it (a limit set on the pool in the UI's Concurrency page or with `dagster
instance concurrency set`, or an instance-wide `concurrency: pools: default_limit`; the shipped
instance configs set none, see deploy/dagster.yaml for why). Both executors of the code location
do it: `experiment_executor` (the multiprocess executor, one
machine) and `experiment_k8s_executor` (`k8s_job_executor`, each step in its own pod). So a second
run of an experiment, however and wherever it was launched (`dagster asset materialize`,
`dagster job launch`, a UI backfill, on one machine or a cluster), starts and waits ("Step blocked
by limit for pool ...") until the first ends, then resumes where the first stopped: its finished
steps are cache hits.

A slot is held until its run ends, so a run whose process died (SIGKILL, OOM killer, a reboot)
would block its experiment for ever. The code location's executor (the multiprocess executor or
`k8s_job_executor`, plus this) tags every run with where its orchestrating process runs, and
while a run waits for its experiment's pool it looks at the runs that hold or wait for that pool
and at the experiment's runs still marked started:
- a finished run that still holds a slot: the slot is freed;
- a run whose orchestrating process is gone (same machine and boot, pid not alive): the run is
  marked failed (its log says by whom and why), the step processes it left are killed, its slot
  is freed, and this run's log says so;
- a live run: this run's log names it and says that this run waits for it.
A run whose process ran on another machine (a Kubernetes pod) is left to run monitoring
(`K8sRunLauncher` checks its pod); once it is marked failed, its slot is freed here.

Before any of this, the executor tags a run of an experiment's steps with its range, and refuses
one that names no range (`assets.run_tags`).
"""

import os
import socket
import threading
from collections.abc import Iterator
from datetime import UTC, datetime

import psutil
from dagster import (
    DagsterEvent,
    DagsterRun,
    DagsterRunStatus,
    Executor,
    ExecutorDefinition,
    RunsFilter,
    executor,
    multiple_process_executor_requirements,
    multiprocess_executor,
)
from dagster_k8s import k8s_job_executor
from sqlalchemy.exc import IntegrityError

from assets.console import CONSOLE
from assets.run_tags import EXPERIMENT_TAG, MAX_RETRIES_TAG, RANGE_TAG, no_range, run_range
from assets.workspace_run import INTERRUPTS, cancel_if_interrupted_here
from dagster_rl.runtime.lifetime import CLOCK_SLACK_S, process_alive, process_started_at
from resources.run_launcher import kill_and_wait, leftover_processes

POOL_PREFIX = "dagster_rl/"
# host|boot time|pid|process start time of the run's orchestrating process: bookkeeping, so under
# Dagster's hidden prefix `.dagster/` (its GraphQL API, and so the UI, never shows such tags)
PROCESS_TAG = ".dagster/dagster_rl.process"
EARLIER_PROCESS_TAG = "dagster_rl/process"  # the key runs of earlier versions carry
WATCH_EVERY_S = 5.0
LIVE = (DagsterRunStatus.STARTED, DagsterRunStatus.STARTING)


def experiment_pool(name: str) -> str:
    return f"{POOL_PREFIX}{name}"


def _boot() -> str:
    """When this machine booted, in whole epoch seconds: with the host name, which machine and which
    boot of it a process ran in."""
    return str(int(psutil.boot_time()))


def _this_boot(boot: str, started: str) -> bool:
    """Whether a PROCESS_TAG's boot and start fields name a process of this machine's current boot.
    The boot field is a boot time (within the clock's slack: a clock adjustment moves it); in the
    tags of earlier versions it is the kernel's boot id (a UUID, "" where none could be read), and
    then the process's recorded start time says it: one from before this boot ran in an earlier one."""
    now = psutil.boot_time()
    if boot.isdigit():
        return abs(int(boot) - now) <= CLOCK_SLACK_S
    try:
        return float(started) >= now - CLOCK_SLACK_S if started else not boot
    except ValueError:
        return False


def this_process() -> str:
    pid = os.getpid()
    return f"{socket.gethostname()}|{_boot()}|{pid}|{process_started_at(pid) or ''}"


def process_gone(tag: str | None) -> tuple[bool, str]:
    """(gone, where) for a run's PROCESS_TAG: gone only when it ran on this machine since its last
    boot and that process is not alive; a process elsewhere, or untagged, is not known to be gone."""
    if not tag or tag.count("|") != 3:
        return False, "an unknown process"
    host, boot, pid, started = tag.split("|")
    where = f"process {pid} on {host}"
    if host != socket.gethostname() or not pid.isdigit() or not _this_boot(boot, started):
        return False, where
    now_started = process_started_at(int(pid))
    same = process_alive(int(pid)) and (not started or now_started is None or abs(now_started - float(started)) < CLOCK_SLACK_S)
    return not same, where


def ensure_limit(instance, pool: str) -> None:
    """Limit 1 on the pool unless the instance sets a limit for it (or a default limit).

    Runs that start at once on a fresh instance all find no limit and all insert one: the storage's
    unique key on the pool lets one insert win and the others raise `IntegrityError`. For them the
    limit is already set, which is all this asks; anything else is re-raised."""
    storage = instance.event_log_storage
    if storage.get_concurrency_info(pool).limit is not None:
        return
    try:
        storage.set_concurrency_slots(pool, 1)
    except IntegrityError:
        if storage.get_concurrency_info(pool).limit is None:
            raise


def release_stale_holders(instance, pool: str, experiment: str, me: DagsterRun, seen: set[str]) -> list[str]:
    """Free the slots of finished runs, fail the runs of the experiment whose process is gone;
    return what this run's log should say (each waited-for run once)."""
    info = instance.event_log_storage.get_concurrency_info(pool)
    ids = {s.run_id for s in info.claimed_slots} | {s.run_id for s in info.pending_steps}
    started = instance.get_runs(RunsFilter(statuses=list(LIVE), tags={EXPERIMENT_TAG: experiment}))
    ids |= {r.run_id for r in started}
    said = []
    for run_id in sorted(ids - {me.run_id}):
        run = instance.get_run_by_id(run_id)
        if run is None or run.status not in LIVE:
            instance.event_log_storage.free_concurrency_slots_for_run(run_id)
            continue
        gone, where = process_gone(run.tags.get(PROCESS_TAG) or run.tags.get(EARLIER_PROCESS_TAG))
        if gone:
            stopped = kill_and_wait(leftover_processes(instance, run_id))
            left = f"; killed the step process(es) {stopped} it left" if stopped else ""
            instance.report_run_failed(
                run,
                f"Marked failed by run {me.run_id} of {experiment}: its {where} is gone (killed, or the machine restarted){left}.",
            )
            instance.event_log_storage.free_concurrency_slots_for_run(run_id)
            said.append(
                f"Run {run_id} of experiment {experiment} was left started by its {where}, which is gone: marked it failed{left}, freed its slot of pool {pool}."
            )
        elif run_id not in seen and run_id in {s.run_id for s in info.claimed_slots}:
            seen.add(run_id)
            since = (
                datetime.fromtimestamp(r.start_time, UTC).isoformat()
                if (r := instance.get_run_record_by_id(run_id)) and r.start_time
                else "?"
            )
            said.append(
                f"Run {run_id} of experiment {experiment} (started {since}, {where}) is running: this run waits for it "
                f"(pool {pool} admits one run of an experiment at a time), then resumes where it stopped."
            )
    return said


class ExperimentExecutor(Executor):
    """An executor (multiprocess, or k8s_job_executor's step-delegating one), plus what this
    module's doc says, for the runs of experiment drivers."""

    def __init__(self, inner: Executor):
        self._inner = inner

    @property
    def retries(self):
        return self._inner.retries

    @property
    def step_dependency_config(self):
        return self._inner.step_dependency_config

    def execute(self, plan_context, execution_plan) -> Iterator[DagsterEvent]:
        try:
            yield from self._execute(plan_context, execution_plan)
        except INTERRUPTS:  # a run `dagster-rl train` executes is canceled by Ctrl-C (`assets.workspace_run`)
            cancel_if_interrupted_here(plan_context.instance, plan_context.dagster_run)
            raise

    def _execute(self, plan_context, execution_plan) -> Iterator[DagsterEvent]:
        instance, run = plan_context.instance, plan_context.dagster_run
        steps = [execution_plan.get_step_by_key(k) for k in execution_plan.step_keys_to_execute]
        pools = sorted({s.pool for s in steps if s.pool and s.pool.startswith(POOL_PREFIX)})
        _check_range(plan_context, steps, pools)
        if not pools or not instance.event_log_storage.supports_global_concurrency_limits:
            yield from self._inner.execute(plan_context, execution_plan)
            return
        tags = {PROCESS_TAG: this_process(), EXPERIMENT_TAG: ",".join(p[len(POOL_PREFIX) :] for p in pools)}
        instance.add_run_tags(run.run_id, tags)
        for pool in pools:
            ensure_limit(instance, pool)
        stop, seen = threading.Event(), set[str]()

        def watch() -> None:  # until this run holds its pools' slots, or ends
            while True:
                try:
                    for pool in pools:
                        for message in release_stale_holders(instance, pool, pool[len(POOL_PREFIX) :], run, seen):
                            plan_context.log.info(message, extra=CONSOLE)  # the run's log, and the console
                    infos = [instance.event_log_storage.get_concurrency_info(p) for p in pools]
                    if all(run.run_id in i.active_run_ids for i in infos):
                        return
                except Exception as e:  # the watch is a help, never the run's failure
                    plan_context.log.warning(f"could not look at the runs holding pool(s) {pools}: {e!r}")
                if stop.wait(WATCH_EVERY_S):
                    return

        watcher = threading.Thread(target=watch, name="dagster-rl-pool-watch", daemon=True)
        watcher.start()
        try:
            yield from self._inner.execute(plan_context, execution_plan)
        finally:
            stop.set()


def _check_range(plan_context, steps: list, pools: list[str]) -> None:
    """Tag the run with its range of steps; refuse a run of an experiment's steps that names none,
    before any step runs, and tag it never to be retried (see `assets.run_tags`)."""
    instance, run = plan_context.instance, plan_context.dagster_run
    partitioned = any(o.properties is not None and o.properties.is_asset_partitioned for s in steps for o in s.step_outputs)
    if not partitioned or not pools:
        return
    steps_named = run_range(run.tags)
    if steps_named:
        instance.add_run_tags(run.run_id, {RANGE_TAG: steps_named})
        return
    experiment = pools[0][len(POOL_PREFIX) :]
    try:
        keys = list(plan_context.job.get_definition().partitions_def.get_partition_keys())
    except Exception:  # the steps are a help in the message, not its point
        keys = []
    instance.add_run_tags(run.run_id, {MAX_RETRIES_TAG: "0", EXPERIMENT_TAG: experiment})
    raise no_range(run.job_name, experiment, keys)


def _created(definition: ExecutorDefinition, init_context) -> Executor:
    """The executor `definition` creates for a run (what the wrapper wraps)."""
    create = definition.executor_creation_fn
    if create is None:  # never for an `@executor` definition, which both wrapped ones are
        raise TypeError(f"executor {definition.name!r} has no creation function to wrap")
    return create(init_context)


@executor(
    name="multiprocess",
    config_schema=multiprocess_executor.config_schema.as_field(),
    requirements=multiple_process_executor_requirements(),
)
def experiment_executor(init_context) -> ExperimentExecutor:
    """Dagster's multiprocess executor (same config), for experiment runs: see `assets.concurrency`."""
    return ExperimentExecutor(_created(multiprocess_executor, init_context))


@executor(
    name=k8s_job_executor.name,  # "k8s": run config and run tags written for k8s_job_executor keep working
    config_schema=k8s_job_executor.config_schema.as_field(),
    requirements=k8s_job_executor.get_requirements,
)
def experiment_k8s_executor(init_context) -> ExperimentExecutor:
    """dagster-k8s's `k8s_job_executor` (same config: each step in its own pod), for experiment runs:
    see `assets.concurrency`. Its step-delegating executor claims the pool's slot before it creates
    a step's pod, so a second run of an experiment waits in its run pod, before any step pod."""
    return ExperimentExecutor(_created(k8s_job_executor, init_context))
