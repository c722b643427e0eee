"""Runs as processes, the way a person at a terminal runs them (findings 2, 3 and 8 of issue 10).

`make demo` prints a line per step and the table; a SIGKILLed `dagster asset materialize` takes
its step process with it, and the next run of the experiment marks the dead run failed and says
so; a second run of an experiment waits for the first (the experiment's concurrency pool) and
then finds every step done. While a step runs, its progress reaches the run's log.
"""

import os
import re
import select
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from dagster import DagsterEventType, DagsterInstance, DagsterRunStatus

from assets.concurrency import experiment_pool, process_gone, this_process
from resources.run_launcher import process_alive, step_worker_pids
from tests import REPO
from tests.cli_runs import BIN, CONSOLE, home_with, materialize, train_until, weights_steps
from tests.openai_stub import OpenAIStub, judge_on
from tests.servers import wait_until
from tests.settings import demo_settings, served

STEP_LINE = re.compile(r"^\d\d:\d\d:\d\d step (\d{4})  24/24 trials  mean reward \d\.\d{3}  cache ([a-z, ]+)  \d+\.\d\d s$")


def test_make_demo_prints_a_line_per_step_and_the_table(tmp_path):
    home = tmp_path / "demo_home"
    env = {**os.environ, "DAGSTER_HOME": str(home)}
    env.pop("DAGSTER_RL_EXPERIMENTS", None)
    done = subprocess.run(
        ["make", "demo", "DEMO_RANGE=0000...0002"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in (done.stdout + done.stderr).splitlines() if not line.startswith(("make", "mkdir", "cp ", "/"))]
    steps = [m.groups() for line in lines if (m := STEP_LINE.match(line))]
    assert steps == [("0000", "miss"), ("0001", "miss"), ("0002", "miss")], lines
    assert "experiment demo: 3 of 16 steps materialized" in done.stdout
    assert re.search(r"^0002 +materialized +miss +24/24 +1\.715 ", done.stdout, re.M), done.stdout
    assert re.search(r"^0003\.\.\.0015 +not materialized$", done.stdout, re.M), done.stdout  # every step, the rest as one row
    assert not any("DEBUG" in line or "did not yield" in line for line in lines), lines
    assert len(lines) < 25, lines  # migrate's notices, 3 step lines, the table
    with DagsterInstance.from_config(str(home)) as instance:  # the full log stays in the run
        run = instance.get_runs()[0]
        log = instance.all_logs(run.run_id)
    kinds = [e.dagster_event.event_type_value for e in log if e.dagster_event]
    assert kinds.count("ASSET_MATERIALIZATION") == 9 and "STEP_START" in kinds and kinds.count("ASSET_CHECK_EVALUATION") == 9
    assert not [e.message for e in log if "did not yield" in (e.message or "")]  # each check's output, as Dagster expects
    assert run.remote_job_origin.location_name == "dagster_rl"  # a run of the code location's job: the UI's job page lists it


def test_a_range_after_a_gap_prints_the_error_and_its_fix_on_the_terminal_and_the_traceback_in_the_run(tmp_path):
    """Issue 19, point 1: the documented command (`dagster asset materialize` with the concise console)
    for a range that starts after a gap: the terminal says why and what to do, in a few lines."""
    home, env = home_with(tmp_path, demo_settings())
    done = subprocess.run(
        [str(BIN / "dagster"), "asset", "materialize", "-m", "assets.definitions", "--select", "group:demo",
         "--partition-range", "0002...0003", "--config-json", CONSOLE],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    error = (
        "ERROR demo_driver: MissingPredecessorError: step 0002 of demo starts from the weights of step 0001, which are "
        "not materialized (steps 0000, 0001 are missing). Run step 0000 first, e.g. the range 0000...0002."
    )
    assert [line[9:] for line in lines if "MissingPredecessorError" in line] == [error], done.stderr
    with DagsterInstance.from_config(str(home)) as instance:
        [run] = instance.get_runs()
        [failure] = instance.all_logs(run.run_id, of_type=DagsterEventType.STEP_FAILURE)
    assert re.fullmatch(rf"\d\d:\d\d:\d\d run {run.run_id[:8]} started \(steps 0002\.\.\.0003\)", lines[0]), lines
    assert run.tags["dagster_rl/range"] == "0002...0003"  # the UI's Runs page shows the range beside the run
    failed = f"ERROR run {run.run_id[:8]} failed (steps 0002...0003). Its full log, with the traceback, is on the run's page"
    assert any(line[9:].startswith(failed) for line in lines), lines
    assert lines[-1] == "Error: Materialization failed." and len(lines) == 4, lines  # Dagster's CLI says the last line
    assert not any("Traceback" in line or 'File "' in line for line in lines)
    assert "starting_weights" in "".join(failure.dagster_event.step_failure_data.error.cause.stack)  # in the run's log


def test_dagster_rl_train_checks_first_then_runs_the_range_with_the_console(tmp_path, monkeypatch, capsys):
    """`dagster-rl train <exp> [RANGE]`: a range past the end, after a gap, or a relative DAGSTER_HOME
    gets one line that says what to do, before any run; a good range runs as one run of <exp>_train."""
    from assets.cli import main

    home, env = home_with(tmp_path, demo_settings(n_steps=4))
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    monkeypatch.setenv("DAGSTER_RL_EXPERIMENTS", str(home / "experiments"))

    def refused(*argv: str) -> str:
        with pytest.raises(SystemExit) as exit_:
            main(["train", *argv])
        return str(exit_.value.code)

    assert refused("demo", "0000...0020") == (
        "dagster-rl: the range 0000...0020 goes past the last step of demo, 0003 (n_steps: 4 in its experiment file): "
        "give a range within 0000...0003, or raise n_steps"
    )
    assert refused(
        "demo", "2...3", "--run-here"
    ).startswith(  # checked by the process that runs the range (it reads the instance)
        "dagster-rl: step 0002 of demo starts from the weights of step 0001, which are not materialized (missing: 0000, 0001). "
        "Run from step 0000, e.g.\n    .venv/bin/dagster-rl train demo 0000...0003"
    )
    assert "not a range of steps: give FIRST...LAST (e.g. 0008...0011)" in refused("demo", "0..3")
    assert "no experiment named 'demoo'" in refused("demoo")
    monkeypatch.setenv("DAGSTER_HOME", "home")
    assert "DAGSTER_HOME=home is a relative path, which Dagster refuses" in refused("demo")
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    with DagsterInstance.from_config(str(home)) as instance:
        assert instance.get_runs() == []  # nothing ran

    done = subprocess.run(
        [str(BIN / "dagster-rl"), "train", "demo", "0000...0001"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stderr.splitlines()
    with DagsterInstance.from_config(str(home)) as instance:
        [run] = instance.get_runs()
    assert run.job_name == "demo_train" and run.tags["dagster_rl/range"] == "0000...0001"
    origin = run.remote_job_origin.repository_origin  # the workspace's code location, as the webserver names it
    assert (origin.code_location_origin.location_name, origin.repository_name, run.remote_job_origin.job_name) == (
        "dagster_rl",
        "__repository__",
        "demo_train",
    )
    assert lines[0][9:] == f"run {run.run_id[:8]} started (demo_train, steps 0000...0001)", lines
    assert [m.group(1) for line in lines if (m := STEP_LINE.match(line))] == ["0000", "0001"], lines
    assert lines[-1][9:] == f"run {run.run_id[:8]} succeeded (demo_train, steps 0000...0001)" and len(lines) == 4, lines

    main(["runs", "demo"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["run", "status", "steps", "started"] and out[1].split()[:3] == [
        run.run_id,
        "SUCCESS",
        "0000...0001",
    ]


def test_ctrl_c_cancels_a_dagster_rl_train_run(tmp_path):
    """Ctrl-C at the terminal: the run is canceled, not failed (a daemon's run retries would re-execute
    a failed run of the code location's job), and the console says to resume."""
    home, env = home_with(tmp_path, demo_settings(name="slow", n_steps=8, faults={"step_delay_s": 1.5}))
    train = subprocess.Popen([str(BIN / "dagster-rl"), "train", "slow"], cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    said = [train.stderr.readline()]
    while said[-1] and not STEP_LINE.match(said[-1].rstrip("\n")):  # until step 0000's line
        said.append(train.stderr.readline())
    train.send_signal(signal.SIGINT)
    err = "".join(said) + train.communicate(timeout=120)[1]
    assert train.returncode == 130, err
    with DagsterInstance.from_config(str(home)) as instance:
        [run] = instance.get_runs()
    assert run.status == DagsterRunStatus.CANCELED and run.tags.get("dagster/will_retry") != "true"
    assert re.search(
        rf"^\d\d:\d\d:\d\d run {run.run_id[:8]} \(slow_train, steps 0000\.\.\.0007\) interrupted; re-run the same range to resume$",
        err,
        re.M,
    ), err


def test_a_killed_materialize_takes_its_step_process_along_and_the_next_run_fails_it(tmp_path):
    slow = demo_settings(name="slow", n_steps=12, faults={"step_delay_s": 1.5})
    home, env = home_with(tmp_path, slow)
    first = materialize(env, "slow", "0000", "0011")
    wait_until(lambda: len(weights_steps(home, "slow")) >= 1, 180, 0.3)
    with DagsterInstance.from_config(str(home)) as instance:
        run = instance.get_runs()[0]
        [step_process] = step_worker_pids(instance, run.run_id)
    os.kill(first.pid, signal.SIGKILL)
    first.wait(10)
    wait_until(lambda: not process_alive(step_process), 10, 0.1, lambda: f"step process {step_process} outlived its parent")
    done = len(weights_steps(home, "slow"))
    time.sleep(4)  # more than two steps' time: nothing trains on
    assert len(weights_steps(home, "slow")) == done < 12
    with DagsterInstance.from_config(str(home)) as instance:
        assert instance.get_run_by_id(run.run_id).status == DagsterRunStatus.STARTED  # nobody was left to say otherwise
        assert instance.event_log_storage.get_concurrency_info(experiment_pool("slow")).active_run_ids == {run.run_id}

    second = materialize(env, "slow", "0000", "0002")
    out, _ = second.communicate(timeout=300)
    assert second.returncode == 0, out
    assert f"Run {run.run_id} of experiment slow was left started by its process {first.pid} on " in out
    assert "which is gone: marked it failed" in out and "freed its slot of pool dagster_rl/slow" in out
    with DagsterInstance.from_config(str(home)) as instance:
        dead = instance.get_run_by_id(run.run_id)
        assert dead.status == DagsterRunStatus.FAILURE
        failure = [e.dagster_event.message for e in instance.all_logs(run.run_id, of_type=DagsterEventType.RUN_FAILURE)]
        assert failure and f"its process {first.pid} on" in failure[-1] and "is gone" in failure[-1]
    assert [m.group(1) for line in out.splitlines() if (m := STEP_LINE.match(line))] == ["0000", "0001", "0002"], out


def running(process: psutil.Process) -> bool:
    """Whether the process runs (the same process: psutil checks its start time), not a zombie."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def step_running(home: Path) -> bool:
    """Whether the newest run of the instance has a step process."""
    with DagsterInstance.from_config(str(home)) as instance:
        runs = instance.get_runs(limit=1)
        return bool(runs) and bool(step_worker_pids(instance, runs[0].run_id))


@pytest.mark.parametrize("step", ["slow", "deaf"])
def test_a_killed_dagster_rl_train_takes_every_process_it_started_along(tmp_path, step):
    """Finding 2 of issue 36: after `kill -9` of `dagster-rl train`, its child (the run's process)
    went on running the step for minutes. Every process it started is gone within seconds: with a
    slow step (`slow`: the demo's step delay), and with a step that does not answer its interruption
    (`deaf`: its generation waits on a rollout server that never answers, in a thread the step must
    wait for)."""
    with socket.create_server(("127.0.0.1", 0)) as deaf:  # accepts connections (the kernel does) and never answers
        if step == "slow":
            home, env = home_with(tmp_path, demo_settings(name="slow", n_steps=8, faults={"step_delay_s": 60.0}))
        else:
            home, env = home_with(tmp_path, served(name="deaf", n_steps=2, warmup=None))
            env["DAGSTER_RL_ROLLOUT_URL"] = f"http://127.0.0.1:{deaf.getsockname()[1]}/v1"
        train = subprocess.Popen(
            [str(BIN / "dagster-rl"), "train", step], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        started: list[psutil.Process] = []
        try:
            wait_until(lambda: step_running(home), 120, 0.3, lambda: "no step process started")
            if step == "slow":
                time.sleep(3)  # step 0000 judged, in its delay
            else:  # step 0000's generation has asked the server
                wait_until(lambda: select.select([deaf], [], [], 0)[0], 120, 0.3, lambda: "nothing asked the rollout server")
            started += psutil.Process(train.pid).children(recursive=True)
            assert len(started) >= 3, started  # the run's process, its step process, Dagster's log tails
            os.kill(train.pid, signal.SIGKILL)
            train.wait(10)
            t0 = time.monotonic()
            wait_until(
                lambda: not [p for p in started if running(p)],
                20,
                0.2,
                lambda: f"still running: {[p.pid for p in started if running(p)]}",
            )
            print(f"{step}: every process `dagster-rl train` started was gone {time.monotonic() - t0:.1f} s after its kill")
            with DagsterInstance.from_config(str(home)) as instance:
                [run] = instance.get_runs()
            if step == "slow":  # interrupted in time: canceled, as a Ctrl-C cancels it
                assert run.status == DagsterRunStatus.CANCELED, run.status
            else:  # killed (its step never stopped): the next run of the experiment marks it failed (as below)
                assert run.status == DagsterRunStatus.STARTED, run.status
        finally:  # whatever the test found, nothing of it outlives the test
            for p in started:
                if running(p):
                    p.kill()
            train.kill()


def test_a_runs_process_tag_says_whether_its_process_is_gone_and_tags_of_earlier_versions_read_the_same():
    """host|boot time|pid|start time: gone only for a process of this machine and boot that is not
    alive. Earlier versions wrote the kernel's boot id in place of the boot time: their tags of this
    boot still say gone or alive, and those of an earlier boot (a process started before this boot) say unknown."""
    host, boot, pid, started = this_process().split("|")
    assert host == socket.gethostname() and pid == str(os.getpid()) and abs(float(started) - time.time()) < 3600
    ended = subprocess.Popen(["true"])
    ended.wait()
    where = f"process {ended.pid} on {host}"
    assert process_gone(this_process()) == (False, f"process {pid} on {host}")
    assert process_gone(f"{host}|{boot}|{ended.pid}|{started}") == (True, where)
    assert process_gone(f"{host}|{int(boot) - 3600}|{ended.pid}|{started}") == (False, where), "another boot: not known here"
    assert process_gone(f"elsewhere|{boot}|{ended.pid}|{started}") == (False, f"process {ended.pid} on elsewhere")
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()  # what earlier versions wrote
    except OSError:
        pytest.skip("no kernel boot id here: no tag of an earlier version to read")
    assert process_gone(f"{host}|{boot_id}|{pid}|{started}") == (False, f"process {pid} on {host}")
    assert process_gone(f"{host}|{boot_id}|{ended.pid}|{started}") == (True, where)
    earlier = "0" * 8 + boot_id[8:]  # another boot's id, and a process that started before this boot
    assert process_gone(f"{host}|{earlier}|{ended.pid}|{int(boot) - 3600}") == (False, where)


def test_a_second_run_of_an_experiment_waits_for_the_first_and_computes_nothing(tmp_path):
    """Two `dagster asset materialize` of one range, started two seconds apart: whichever claims the
    experiment's pool first computes; the other says which run it waits for, then finds every step done."""
    slow = demo_settings(name="slow", n_steps=8, faults={"step_delay_s": 1.5})  # about 14 s of steps
    home, env = home_with(tmp_path, slow)
    procs = [materialize(env, "slow", "0000", "0007")]
    time.sleep(2)
    procs.append(materialize(env, "slow", "0000", "0007"))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    records = weights_steps(home, "slow")
    runs = list(dict.fromkeys(r for _, r in records))
    steps = [f"{i:04d}" for i in range(8)]
    assert (
        len(runs) == 2 and [p for p, r in records if r == runs[0]] == steps and [p for p, r in records if r == runs[1]] == steps
    )
    assert records.index(("0000", runs[1])) > records.index(("0007", runs[0])), "the second run started after the first ended"
    waited = [
        out for out in outs if f"Run {runs[0]} of experiment slow (started " in out and "is running: this run waits for it" in out
    ]
    computed = [out for out in outs if out not in waited]
    assert len(waited) == len(computed) == 1, outs
    assert [m.group(2) for line in waited[0].splitlines() if (m := STEP_LINE.match(line))] == ["hit"] * 8
    assert [m.group(2) for line in computed[0].splitlines() if (m := STEP_LINE.match(line))] == ["miss"] * 8


def test_a_long_step_reports_its_progress_in_the_run_log(lab, monkeypatch):
    """A slow judge (0.25 s a call, one at a time) makes step 0000 last about 4 s: the run's log shows
    its progress every 0.5 s here (every 30 s by default), trials judged climbing."""
    import assets.driver

    assert assets.driver.PROGRESS_EVERY_S <= 30
    monkeypatch.setattr(assets.driver, "PROGRESS_EVERY_S", 0.5)
    with OpenAIStub(delay_s=0.25) as stub:
        judge = judge_on(stub, model="slow-judge", max_concurrency=1)
        slow = lab("progress", demo_settings(n_steps=2, prompts_per_step=4, n_samples=4, min_trials_per_step=8), judge=judge)
        result = slow.run("demo", "0000", "0000")
    assert result.success
    lines = [e.message for e in slow.instance.all_logs(result.run_id) if e.message.startswith("step 0000: ")]
    assert len(lines) >= 4, lines
    judged = [int(re.search(r", (\d+)/16 judged;", line).group(1)) for line in lines]
    assert judged == sorted(judged) and judged[0] < 16 and all(re.search(r"\d+/16 trials generated", line) for line in lines)
    assert all(re.search(r"; (generating|judging|training), \d+ s into the step$", line) for line in lines), lines
    # every trial generated, judgements still out (the slow judge): the step says judging, not generating
    waiting = [line for line in lines if "16/16 trials generated" in line and ", 16/16 judged" not in line]
    assert waiting and all("; judging, " in line for line in waiting), lines


def assert_ended_cleanly(code: int, lines: list[str]) -> None:
    """Exit 130 and one last line that says to resume; no traceback, error, warning or notice of the interruption."""
    assert code == 130, lines
    assert re.fullmatch(
        r"\d\d:\d\d:\d\d run [0-9a-f]{8} \(slow_train, steps 0000\.\.\.0011\) interrupted; re-run the same range to resume",
        lines[-1],
    ), lines
    noise = [
        line for line in lines if re.search(r"Traceback|Error|Warning|WARNING|ERROR|KeyboardInterrupt|did not receive", line)
    ]
    assert not noise, lines


def test_ctrl_c_or_sigterm_of_train_ends_with_one_line_that_says_to_resume(tmp_path):
    """Issue 24: Ctrl-C ended with a bare DagsterExecutionInterruptedError (and Dagster's log tails'
    KeyboardInterrupt tracebacks); SIGTERM as well. The range resumes where it stopped."""
    home, env = home_with(tmp_path, demo_settings(name="slow", n_steps=12, faults={"step_delay_s": 1.0}))
    code, lines = train_until(env, tmp_path, ["slow", "0000...0011"], "step 0001 ", signal.SIGINT, group=True)
    assert_ended_cleanly(code, lines)
    done = [m.group(1) for line in lines if (m := STEP_LINE.match(line))]
    code, lines = train_until(
        env, tmp_path, ["slow", "0000...0011"], f"step {int(done[-1]) + 2:04d} ", signal.SIGTERM, group=False
    )
    assert_ended_cleanly(code, lines)
    steps = {m.group(1): m.group(2) for line in lines if (m := STEP_LINE.match(line))}
    assert all(steps[s] == "hit" for s in done), lines  # resumed: what the first run stored is reused


def test_an_interruption_inside_the_instances_connection_close_prints_no_traceback(capsys):
    """CI caught it once: Ctrl-C of a range with a trainer session ended with SQLAlchemy's
    `Exception closing connection` and a DagsterExecutionInterruptedError traceback, when Dagster's
    interruption was raised while the SQLite pool closed a connection. Other pool errors still print."""
    import logging

    from dagster._core.errors import DagsterExecutionInterruptedError

    import assets.definitions  # noqa: F401 - loading the code location quiets them

    pool = logging.getLogger("sqlalchemy.pool.impl.NullPool")
    for error in (DagsterExecutionInterruptedError(), KeyboardInterrupt(), OSError("disk I/O error")):
        try:
            raise error
        except BaseException:  # as SQLAlchemy's _close_connection catches it
            pool.error("Exception closing connection %r", "<conn>", exc_info=True)
    err = capsys.readouterr().err
    assert err.count("Exception closing connection") == 1 and "OSError: disk I/O error" in err, err
    assert "Interrupt" not in err, err
