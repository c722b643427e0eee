"""Trainer sessions (issue 17): torchrun workers that live for a range of steps store the bytes that
a launch per step stores; a killed worker costs a restart, not a result; a killed driver takes its
workers along; the workers stop on their own when idle, told to, or orphaned.

The reference run (`session_run`, tests/conftest.py) is steps 0000..0002 of tiny_grpo (no warm-up)
with 2 torchrun ranks in one session."""

import ast
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dagster_rl.base import counters
from dagster_rl.base.retries import AttemptsExhausted, Limits
from dagster_rl.core.experiment_files import parse_experiment
from dagster_rl.runtime.lifetime import children, identity
from dagster_rl.runtime.workers import ProcessWorkers, WorkersGone
from dagster_rl.tasks.lm.backends import LMTrainer, subprocess_launch
from dagster_rl.tasks.lm.model.policy import checkpoint_bytes, load_policy
from dagster_rl.tasks.lm.train.entrypoint import serve
from dagster_rl.tasks.lm.train.session import ENDED, JOBS, STOP, SessionSpec, create_folder
from resources import PipesTorchrunLauncher, TrainerEnvironment
from resources.run_launcher import process_alive, step_worker_pids
from tests import REPO
from tests.cli_runs import home_with, materialize, weights_steps
from tests.harness import failure_message
from tests.lm_fixtures import step_batch
from tests.servers import wait_until
from tests.settings import SESSION_STEPS, session_settings

REPORTED = "trainer rank 0 reported: "


def hashes(lab, steps=SESSION_STEPS) -> list[str]:
    return [lab.latest("tiny_grpo", "weights", s)["content_hash"] for s in steps]


def reports(lab, run_id: str) -> list[dict]:
    """What rank 0 reported through Pipes, one message per step, as the run's log has them."""
    return [ast.literal_eval(e.message[len(REPORTED) :]) for e in lab.instance.all_logs(run_id) if e.message.startswith(REPORTED)]


def test_one_session_trains_the_range_from_memory(session_run):
    assert session_run.result.success, failure_message(session_run.result)
    assert session_run.counted["trainer_sessions"] == 1 and session_run.counted["train_calls"] == 3
    said = reports(session_run, session_run.result.run_id)
    # each step reports its own metrics: step 0 loaded the initial weights, later steps trained on
    # what the workers held; the checkpoint each names is the one the driver stored
    assert [m["step"] for m in said] == [0, 1, 2]
    assert [m["timings"]["from_memory"] for m in said] == [0.0, 1.0, 1.0]
    assert [m["metrics"]["version"] for m in said] == [1, 2, 3] and all(m["metrics"]["world_size"] == 2 for m in said)
    for m, step in zip(said, SESSION_STEPS, strict=True):
        assert m["metrics"]["loss"] == pytest.approx(session_run.latest("tiny_grpo", "weights", step)["loss"], abs=1e-12)


def test_cached_steps_never_start_a_session(session_run):
    before = counters.snapshot()
    again = session_run.run("tiny_grpo", SESSION_STEPS[0], SESSION_STEPS[-1])
    assert again.success and [session_run.latest("tiny_grpo", "weights", s)["cache"] for s in SESSION_STEPS] == ["hit"] * 3
    assert counters.read("trainer_sessions") == before.get("trainer_sessions", 0) and counters.read("train_calls") == before.get(
        "train_calls", 0
    )
    assert reports(session_run, again.run_id) == [] and worker_processes(os.getpid()) == {}


@pytest.mark.parametrize("lag", [0, 1, 2])
def test_a_session_stores_the_bytes_that_a_launch_per_step_stores(lab, session_run, lag):
    """Same experiment, same machine: every step's weights, under the same key, byte for byte.
    With lag 1 step k+1 generates with the weights of step k-1 while step k trains. With lag 2 (every
    step sampled by the initial weights) and `grpo.mismatch`, the workers recompute the log-probs of
    the behavior weights each stale step's job names: checked on every step."""
    extra = {"grpo": {"mismatch": {"level": "sequence", "action": "truncate", "cap": 2.0}}} if lag == 2 else {}
    per_step = lab("per_step", session_settings(max_policy_lag=lag, trainer={"session": "step"}, **extra))
    before = counters.snapshot()
    assert per_step.run("tiny_grpo", SESSION_STEPS[0], SESSION_STEPS[-1]).success
    assert counters.read("trainer_sessions") == before.get("trainer_sessions", 0)  # a launch per step, no session
    if lag == 0:
        session = session_run
    else:
        session = lab("session", session_settings(max_policy_lag=lag, **extra))
        assert session.run("tiny_grpo", SESSION_STEPS[0], SESSION_STEPS[-1]).success
        behavior = [session.latest("tiny_grpo", "rollouts", s)["behavior_policy"]["partition"] for s in SESSION_STEPS]
        assert behavior == (["initial", "initial", "0000"] if lag == 1 else ["initial"] * 3)
        if lag == 2:
            md = [session.latest("tiny_grpo", "weights", s) for s in SESSION_STEPS]
            assert [m["policy_lag"] for m in md] == [0.0, 1.0, 2.0] and all(m["logp_max_dev"] < 1e-4 for m in md), md
    keys = [lab_.latest("tiny_grpo", "weights", s)["artifact_key"] for lab_ in (per_step, session) for s in SESSION_STEPS]
    assert keys[:3] == keys[3:]
    assert hashes(per_step) == hashes(session)
    print(json.dumps({"lag": lag, "weights": hashes(session)}))


def worker_processes(root: int) -> dict[int, dict[str, str]]:
    """Descendants of `root` running the trainer entrypoint (torchrun's agent included): pid -> env."""
    found = {}
    for pid in children(root):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = dict(
                e.split("=", 1)
                for e in Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
                if "=" in e
            )
        except OSError:
            continue
        if b"dagster_rl.tasks.lm.train.entrypoint" in cmdline:
            found[pid] = {**environ, "_cmdline": " ".join(c.decode() for c in cmdline)}
    return found


def rank_process(root: int, rank: str) -> tuple[int, Path] | None:
    """(pid, session folder) of the worker of global rank `rank` below `root`."""
    for pid, env in worker_processes(root).items():
        if env.get("RANK") == rank and "torch.distributed.run" not in env["_cmdline"]:
            return pid, Path(env["_cmdline"].split()[-1])
    return None


def test_a_worker_killed_mid_range_costs_a_restart_and_the_run_ends_byte_identical(lab, session_run):
    """Rank 1 is SIGKILLed while step 0001 is handed to the session: torchrun ends the set, the
    step's attempt fails, its retry starts a new session that loads the last stored weights, and
    the range ends with the bytes of the uninterrupted run."""
    killed = {}

    def kill_rank_1_at_step_1() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not killed:
            found = rank_process(os.getpid(), "1")
            if found and (found[1] / JOBS / "000002.json").exists():
                os.kill(found[0], signal.SIGKILL)
                killed["pid"] = found[0]
            time.sleep(0.005)

    trainer = TrainerEnvironment(launcher=PipesTorchrunLauncher(), max_retries=1)
    crashy = lab("killed_worker", session_settings(), trainer=trainer)
    killer = threading.Thread(target=kill_rank_1_at_step_1, daemon=True)
    killer.start()
    before = counters.snapshot()
    result = crashy.run("tiny_grpo", SESSION_STEPS[0], SESSION_STEPS[-1])
    killer.join(5)
    assert result.success, failure_message(result)
    assert killed and not process_alive(killed["pid"])
    assert counters.read("trainer_sessions") - before.get("trainer_sessions", 0) == 2
    assert counters.read("train_calls") - before.get("train_calls", 0) == 4  # step 0001 twice
    said = reports(crashy, result.run_id)
    assert [m["step"] for m in said][-2:] == [1, 2] and said[-2]["timings"][
        "from_memory"
    ] == 0.0  # the new session loaded 0000's weights
    assert hashes(crashy) == hashes(session_run)
    assert worker_processes(os.getpid()) == {}  # the range's end stopped the second session


def test_a_killed_driver_leaves_no_worker_and_the_next_run_resumes(tmp_path):
    """`dagster asset materialize` of tiny_grpo with a torchrun session, killed two ways while the
    session runs: (1) the run worker (the materialize process): its step process, the driver, dies
    with it (lifetime.die_with_parent) and takes torchrun and the workers along; (2) the driver
    itself: the workers see their owner gone and stop, torchrun with them. Then a third run trains
    the step after the last one materialized."""
    settings = session_settings(name="sessions", n_steps=12)
    home, env = home_with(tmp_path, settings)

    def session_up(proc: subprocess.Popen) -> tuple[int, dict]:
        """Once the run's session has answered a step: (the driver's step process, its workers)."""
        from dagster import DagsterInstance

        found = {}

        def up() -> bool:
            assert proc.poll() is None, proc.communicate()[0]
            with DagsterInstance.from_config(str(home)) as instance:
                runs = instance.get_runs(limit=1)
                pids = step_worker_pids(instance, runs[0].run_id) if runs else []
            if len(pids) != 1:
                return False
            ranks = [rank_process(pids[0], r) for r in ("0", "1")]
            if None in ranks or not any((ranks[0][1] / "results").glob("*.json")):
                return False
            found.update(driver=pids[0], workers=worker_processes(pids[0]))
            return True

        wait_until(up, 600, 0.2, lambda: "the run's trainer session did not start")
        assert len(found["workers"]) == 3  # torchrun's agent and two ranks
        return found["driver"], found["workers"]

    first = materialize(env, "sessions", "0000", "0011")
    driver, workers = session_up(first)
    os.kill(first.pid, signal.SIGKILL)
    first.wait(10)
    wait_until(
        lambda: not any(process_alive(p) for p in [driver, *workers]),
        20,
        0.1,
        lambda: f"left alive: {[p for p in [driver, *workers] if process_alive(p)]}",
    )

    second = materialize(env, "sessions", "0000", "0011")
    driver, workers = session_up(second)
    os.kill(driver, signal.SIGKILL)
    started = time.monotonic()
    wait_until(
        lambda: not any(process_alive(p) for p in workers),
        30,
        0.1,
        lambda: f"workers outlived their driver: {[p for p in workers if process_alive(p)]}",
    )
    print(json.dumps({"workers_gone_after_s": round(time.monotonic() - started, 2)}))
    out, _ = second.communicate(timeout=120)
    assert second.returncode != 0, out  # its step process died: the run failed

    done = sorted(
        {int(p) for p, _ in weights_steps(home, "sessions")}
    )  # maybe none: a step's answer comes before its materialization
    step = f"{done[-1] + 1 if done else 0:04d}"
    third = materialize(env, "sessions", step, step)
    out, _ = third.communicate(timeout=600)
    assert third.returncode == 0, out
    assert sorted({p for p, _ in weights_steps(home, "sessions")}) == [f"{i:04d}" for i in range(int(step) + 1)]


# ---- the workers' side, one process (no torchrun) ------------------------------------------------


def _serve_in_thread(folder: Path) -> threading.Thread:
    thread = threading.Thread(target=serve, args=(folder,), daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("why", ["stopped", "idle", "owner gone"])
def test_workers_stop_when_told_when_idle_and_when_their_driver_is_gone(tmp_path, why):
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) if why == "owner gone" else None
    try:
        spec = SessionSpec(
            device="cpu", idle_timeout_s=1.0 if why == "idle" else 60.0, owner=identity(owner.pid) if owner else None
        )
        folder = create_folder(tmp_path, spec)
        started = time.monotonic()
        thread = _serve_in_thread(folder)
        time.sleep(0.3)
        assert thread.is_alive()
        if why == "stopped":
            (folder / STOP).write_text("")
        elif owner is not None:
            owner.kill()
            owner.wait()
        thread.join(10)
        assert not thread.is_alive() and (folder / ENDED).read_text() == why
        assert time.monotonic() - started < (3 if why == "idle" else 2)
    finally:
        if owner is not None and owner.poll() is None:
            owner.kill()


def alone(command: list[str]) -> list[str]:
    """The worker of a torchrun command without torchrun: one process, no process group."""
    return [sys.executable, "-m", "dagster_rl.tasks.lm.train.entrypoint", command[-1]]


def start_alone(command: list[str], env: dict[str, str]) -> ProcessWorkers:
    return ProcessWorkers(alone(command), {**os.environ, **env}, cwd=REPO)


def test_a_step_that_fails_in_the_session_says_why_and_leaves_nothing(tmp_path):
    """A batch the update cannot use (no rollout has a reward): rank 0 raises, leaves the job
    unanswered and says why in the folder; the step fails with that reason, on every attempt (a new
    session each), and neither a worker nor a folder is left."""
    exp = parse_experiment(session_settings(trainer={"nproc_per_node": 1}))
    policy = load_policy(exp.policy)
    rollouts, _ = step_batch(policy, step=0, prompts=2, samples=2)
    trainer = LMTrainer(limits=Limits(max_retries=1, timeout_s=600, max_concurrency=1), start=start_alone, workdir=tmp_path)
    before = counters.read("trainer_sessions")
    with pytest.raises(AttemptsExhausted) as failed:
        trainer.train(exp, checkpoint_bytes(policy, None), rollouts, [])
    trainer.close()
    assert counters.read("trainer_sessions") - before == 2 and len(failed.value.errors) == 2
    for error in failed.value.errors:
        assert isinstance(error, WorkersGone) and "exited with code 1" in str(error)
        assert any("failed at step job 1: DagsterRLError: no rollout has a reward" in note for note in error.__notes__)
    assert list(tmp_path.iterdir()) == [] and worker_processes(os.getpid()) == {}


def test_a_session_that_stopped_idle_is_replaced_and_the_step_trains_as_a_launch_would(tmp_path):
    """Workers idle longer than `session_idle_timeout_s` stop; the next step starts new ones, which
    load its input checkpoint. The updates equal those of a launch per step (the worker alone, one
    process, both ways)."""
    exp = parse_experiment(session_settings(trainer={"nproc_per_node": 1, "session_idle_timeout_s": 1}))
    policy = load_policy(exp.policy)
    rollouts, rewards = step_batch(policy, step=0, prompts=4, samples=4)
    initial = checkpoint_bytes(policy, None)

    session = LMTrainer(start=start_alone, workdir=tmp_path / "s")
    before = counters.read("trainer_sessions")
    first, _ = session.train(exp, initial, rollouts, rewards)
    time.sleep(2.5)  # the workers stop, idle
    second, metrics = session.train(exp, first, rollouts, rewards)
    session.close()
    assert counters.read("trainer_sessions") - before == 2 and [row["from_memory"] for row in session.log] == [0.0, 0.0]
    assert list((tmp_path / "s").iterdir()) == []  # both folders removed

    per_step = LMTrainer(launch=lambda command, env: subprocess_launch(alone(command), env), workdir=tmp_path / "p")
    one, _ = per_step.train(
        exp.model_copy(update={"trainer": exp.trainer.model_copy(update={"session": "step"})}), initial, rollouts, rewards
    )
    two, _ = per_step.train(exp, one, rollouts, rewards)  # no `start`: a launch per step whatever the setting
    assert one == first and two == second and metrics.version == 2


def test_the_session_folder_of_a_killed_driver_is_removed_by_the_next_driver_on_its_host(tmp_path):
    """A SIGKILLed driver cannot remove its session folder: the next one to make a folder there
    removes every folder whose owner, on this host, is gone, and no other."""
    import socket

    from dagster_rl.tasks.lm.train.session import OWNER

    gone = subprocess.run(
        [sys.executable, "-c", "from dagster_rl.runtime.lifetime import identity; print(identity())"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    host = socket.gethostname()
    owners = {"killed": f"{host} {gone}", "running": f"{host} {identity()}", "elsewhere": f"another-host {gone}", "unowned": None}
    folders = {}
    for name, owner in owners.items():
        folders[name] = tmp_path / f"dagster-rl-session-{name}"
        (folders[name] / JOBS).mkdir(parents=True)
        if owner is not None:
            (folders[name] / OWNER).write_text(owner)
    made = create_folder(tmp_path, SessionSpec(idle_timeout_s=1.0))
    assert sorted(p.name for p in tmp_path.iterdir() if p.exists()) == sorted(
        [made.name, *(folders[n].name for n in ("running", "elsewhere", "unowned"))]
    )
    assert (made / OWNER).read_text() == f"{host} {identity()}"


def test_ctrl_c_of_a_range_with_a_trainer_session_ends_with_one_line_and_leaves_no_folder(tmp_path):
    """Issue 24: a trainer session printed Dagster's PreviewWarning when it started, and on Ctrl-C
    Pipes' "did not receive closed message" besides the interruption's error."""
    from tests.cli_runs import train_until

    settings = session_settings(
        name="slow", n_steps=12, prompts_per_step=4, n_samples=4, min_trials_per_step=8, faults={"step_delay_s": 1.0}
    )
    home, env = home_with(tmp_path, settings)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    code, lines = train_until(
        {**env, "TMPDIR": str(scratch)}, tmp_path, ["slow", "0000...0011"], "step 0000 ", signal.SIGINT, group=True
    )
    assert code == 130 and lines[-1].endswith("(slow_train, steps 0000...0011) interrupted; re-run the same range to resume"), (
        lines
    )
    assert not [line for line in lines if re.search(r"Traceback|Error|Warning|WARNING|ERROR|did not receive", line)], lines
    assert not list(scratch.glob("dagster-rl-session-*")), "the session's folder is removed"
