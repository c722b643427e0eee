"""The experiment's pool limit is set once, race-free (finding 4 of issue 20): four processes that
set it at once on a fresh instance all succeed, and the pool ends with limit 1."""

import multiprocessing
import shutil
import traceback

from dagster import DagsterInstance

from assets.concurrency import ensure_limit, experiment_pool
from tests.harness import new_dagster_home

PROCESSES, TRIALS = 4, 20


def _set_limit(home: str, pool: str, barrier, errors) -> None:
    try:
        with DagsterInstance.from_config(home) as instance:
            barrier.wait(timeout=60)  # every process opened the instance: now all at once
            ensure_limit(instance, pool)
    except BaseException:  # reported to the test, which fails with it
        errors.put(traceback.format_exc())


def test_four_processes_setting_the_pool_limit_at_once_all_succeed(tmp_path):
    fork = multiprocessing.get_context("fork")  # dagster is imported once, here: a trial takes a second, not an import each
    pool = experiment_pool("race")
    fresh = new_dagster_home(tmp_path / "fresh")
    DagsterInstance.from_config(str(fresh)).dispose()  # the schema exists; no pool has a limit yet
    for trial in range(TRIALS):
        home = str(shutil.copytree(fresh, tmp_path / f"home{trial}"))  # a fresh instance per trial, in a millisecond
        barrier, errors = fork.Barrier(PROCESSES), fork.Queue()
        procs = [fork.Process(target=_set_limit, args=(home, pool, barrier, errors)) for _ in range(PROCESSES)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
        failures = [errors.get(timeout=5) for _ in range(errors.qsize())] if not errors.empty() else []
        assert not failures, f"trial {trial}: {len(failures)} of {PROCESSES} processes failed:\n{failures[0]}"
        assert [p.exitcode for p in procs] == [0] * PROCESSES, f"trial {trial}"
        with DagsterInstance.from_config(home) as instance:
            info = instance.event_log_storage.get_concurrency_info(pool)
            assert info.limit == 1 and info.slot_count == 1, (trial, info.limit, info.slot_count)
