"""`dagster-rl sandbox run FILE`: what the program printed, then one `outcome:` line; exit status 0
whenever the sandbox ran, 1 with the reason when the command line or the sandbox is wrong."""

import shutil
import subprocess
import sys

import pytest

from tests import REPO
from tests.machine import missing


def sandbox_run(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "assets.cli", "sandbox", "run", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)


@pytest.fixture
def bubblewrap():
    """The commands need bubblewrap; the timeout's wording (the last test) does not."""
    if shutil.which("bwrap") is None:
        missing("bubblewrap is not installed (apt-get install bubblewrap)")


def test_a_program_that_fails_is_reported_and_the_command_succeeds(bubblewrap, tmp_path):
    program = tmp_path / "fails.py"
    program.write_text("print(6 * 7)\nraise SystemExit(3)\n")
    done = sandbox_run(str(program))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "42"
    assert lines[-1].startswith("outcome: exit (exit status 3, ")


def test_a_sleeping_program_ends_at_the_wall_clock_and_says_so(bubblewrap, tmp_path):
    program = tmp_path / "sleeps.py"
    program.write_text("import time\nprint('started', flush=True)\ntime.sleep(60)\n")
    done = sandbox_run(str(program), "--timeout", "1", "--wall", "2")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "started"
    assert done.stdout.splitlines()[-1].startswith("outcome: timeout (Timeout: still running after 2 s of wall time, ")


def test_bad_limits_and_a_missing_file_exit_1_naming_what_was_wrong(bubblewrap, tmp_path):
    program = tmp_path / "ok.py"
    program.write_text("print(1)\n")
    bad = sandbox_run(str(program), "--timeout", "-1", "--memory", "3")
    assert bad.returncode == 1 and "outcome:" not in bad.stdout
    assert "--timeout -1.0: input should be greater than 0" in bad.stderr
    assert "--memory 3: input should be greater than or equal to 16" in bad.stderr
    absent = sandbox_run(str(tmp_path / "absent.py"))
    assert absent.returncode == 1 and f"{tmp_path / 'absent.py'} is not a file" in absent.stderr


@pytest.mark.parametrize(
    "sig,seconds,reads",
    [
        (None, 20.01, "Timeout: still running after 20 s of wall time"),  # bubblewrap's backstop stopped it
        (9, 20.5, "Timeout: still running after 20 s of wall time"),  # a pod's launcher killed it at the wall time
        (9, 5.2, "Timeout after 5 s"),  # the hard CPU limit's SIGKILL
        (24, 5.0, "Timeout after 5 s"),  # SIGXCPU
        (24, 25.0, "Timeout after 5 s"),  # SIGXCPU on a loaded machine: still the CPU seconds
    ],
)
def test_a_timeout_names_the_limit_that_stopped_it(sig, seconds, reads):
    from dagster_rl.sandbox.calls import Call
    from dagster_rl.sandbox.limits import SandboxLimits

    call = Call(
        stdout="", stderr="", stdout_cut=0, stderr_cut=0, outcome="timeout", exit_status=None, signal=sig, seconds=seconds
    )
    assert call.ending(SandboxLimits(cpu_s=5, wall_s=20)) == reads
