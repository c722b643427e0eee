"""Hostile programs in the local sandbox (bubblewrap): each escape is contained, the call returns
within its limit with the outcome that names what happened, and the host is left as it was (no
process of the program's, no file of it outside its folder, no connection received).

Each program carries a marker (`MARK`) in its source: the processes it starts show it in their
command line, and the files it tries to leave carry it in their names, so "nothing is left" is
checked against the program's own traces, whatever else this machine runs.
"""

import os
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from dagster_rl.sandbox.bubblewrap import BubblewrapSandboxes
from dagster_rl.sandbox.calls import Program, SandboxUnavailable
from dagster_rl.sandbox.folders import remove_tree
from dagster_rl.sandbox.limits import SandboxLimits
from tests import REPO
from tests.machine import missing

MARK = "escape_probe_7f3a"
LIMITS = SandboxLimits(cpu_s=2, wall_s=6, memory_mb=256, processes=16, output_bytes=1024)
SYSTEM = {"bin", "sbin", "lib", "lib32", "lib64", "libx32"}  # the merged-/usr links, or folders, of the host
SLACK_S = 3.0  # a call returns within its limit plus this (the sandbox's start and teardown, a loaded machine)


@pytest.fixture
def sandboxes() -> Iterator[BubblewrapSandboxes]:
    """Sandboxes under a root of their own in /tmp (pytest's tmp_path lies in a folder only root may enter)."""
    root = Path(tempfile.mkdtemp(prefix="sandboxes-"))
    root.chmod(0o711)
    s = BubblewrapSandboxes(root)
    try:
        s.check()
    except SandboxUnavailable as e:
        missing(str(e))
    yield s
    remove_tree(root)


def traces() -> list[str]:
    """The program's processes still on this machine (their command lines show the marker)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(p.info["cmdline"] or [])
        if MARK in cmdline and p.pid != os.getpid():
            found.append(f"{p.pid}: {cmdline[:120]}")
    return found


def marked_files(*roots: Path) -> list[Path]:
    return [p for root in roots if root.exists() for p in root.rglob(f"*{MARK}*")]


def run_hostile(sandboxes: BubblewrapSandboxes, source: str, limits: SandboxLimits = LIMITS):
    """Run a program in a fresh workspace; return its call and what its folder held after it."""
    with sandboxes.open("hostile") as ws:
        call = ws.run(Program(python=f"# {MARK}\n{source}"), limits)
        left = sorted(p.name for p in ws.folder.iterdir())
    time.sleep(0.2)
    assert traces() == [], "a process of the program outlived its call"
    assert marked_files(Path("/tmp"), sandboxes.root, REPO) == []
    return call, left


def test_a_connect_to_a_server_on_the_host_is_refused(sandboxes):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.5)
    port = server.getsockname()[1]
    accepted = []

    def accept() -> None:
        try:
            accepted.append(server.accept())
        except OSError:
            pass

    listener = threading.Thread(target=accept)
    listener.start()
    call, _ = run_hostile(
        sandboxes,
        f"import socket\ns = socket.socket()\ntry:\n    s.connect(('127.0.0.1', {port}))\n    print('connected')\n"
        "except OSError as e:\n    print('refused', e.errno)\n"
        "try:\n    socket.getaddrinfo('example.com', 80)\n    print('resolved')\nexcept OSError:\n    print('no dns')",
    )
    listener.join()
    server.close()
    assert call.outcome == "exit" and call.stdout == "refused 111\nno dns\n"
    assert accepted == []


def test_the_store_home_experiments_and_repository_are_not_there(sandboxes, tmp_path, monkeypatch):
    store_file = tmp_path / "store" / "weights" / "abc" / "adapter.safetensors"
    store_file.parent.mkdir(parents=True)
    store_file.write_bytes(b"secret weights")
    paths = [store_file, Path.home(), Path(os.environ["DAGSTER_HOME"]), REPO / "experiments", REPO, Path("/etc/passwd")]
    probe = "\n".join(f"print(os.path.exists({str(p)!r}))" for p in paths)
    call, _ = run_hostile(sandboxes, f"import os\n{probe}\nprint(sorted(os.listdir('/')))")
    *exists, top = call.stdout.splitlines()
    assert call.outcome == "exit" and exists == ["False"] * len(paths)
    assert {"usr", "work", "tmp", "proc", "dev"} <= set(eval(top)) <= SYSTEM | {"usr", "work", "tmp", "proc", "dev"}


def test_writes_outside_its_folder_fail_or_vanish(sandboxes):
    call, left = run_hostile(
        sandboxes,
        "import os\n"
        f"for path in ['/usr/{MARK}', '/{MARK}', '/work/../{MARK}', '/proc/{MARK}']:\n"
        "    try:\n        open(path, 'w').write('x')\n        print('wrote', path)\n"
        "    except OSError as e:\n        print('refused', e.errno)\n"
        f"open('/tmp/{MARK}', 'w').write('x')\n"  # its private /tmp: gone with the call
        f"open('{MARK}.txt', 'w').write('kept')\n",  # its own folder: kept for the episode
    )
    assert call.outcome == "exit" and call.stdout.startswith("refused 30\nrefused 30\nrefused 30\nrefused")
    assert "wrote" not in call.stdout and left == [f"{MARK}.txt"]


def test_a_fork_bomb_is_contained_and_stopped(sandboxes):
    call, _ = run_hostile(sandboxes, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    assert call.outcome == "timeout"
    # the call's own wall time, sandbox start and teardown included, as the other bounds here; not the
    # helper's scan of the host for traces after it (under CI's load the whole test took 9.4 s)
    assert call.seconds < LIMITS.wall_s + SLACK_S


def test_a_12_gib_allocation_is_out_of_memory(sandboxes):
    call, _ = run_hostile(sandboxes, "x = bytearray(12 * 2**30)\nprint('allocated')")
    assert call.outcome == "memory" and call.exit_status == 1 and "MemoryError" in call.stderr
    assert call.text().endswith("[Out of memory]")


def test_a_detached_background_process_is_gone_when_the_call_returns(sandboxes):
    call, left = run_hostile(
        sandboxes,
        "import os, time\n"
        "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        f"        time.sleep(2)\n        open('late_{MARK}', 'w').write('x')\n    os._exit(0)\n"
        "print('detached')",
    )
    assert call.outcome == "exit" and call.stdout == "detached\n" and left == []
    time.sleep(2.5)  # past the daemon's sleep: had it survived, its file would be here
    assert traces() == [] and marked_files(sandboxes.root) == []


def test_an_endless_loop_ends_at_its_cpu_seconds(sandboxes):
    call, _ = run_hostile(sandboxes, "print('looping')\nwhile True:\n    pass")
    assert call.outcome == "timeout" and call.signal == 24 and call.stdout == "looping\n"  # SIGXCPU
    assert LIMITS.cpu_s - 0.5 < call.seconds < LIMITS.cpu_s + SLACK_S
    assert call.text(LIMITS) == "looping\n[Timeout after 2 s]"


def test_a_sleeping_program_ends_at_the_wall_clock_backstop(sandboxes):
    call, _ = run_hostile(sandboxes, "import time\ntime.sleep(60)")
    assert call.outcome == "timeout" and LIMITS.wall_s <= call.seconds < LIMITS.wall_s + SLACK_S
    assert call.text(LIMITS) == "[Timeout: still running after 6 s of wall time]"  # not the CPU seconds it never used


def test_a_flood_of_output_is_cut_and_stopped(sandboxes):
    call, _ = run_hostile(sandboxes, "import sys\nwhile True:\n    sys.stdout.write('y' * 4096)")
    assert call.outcome == "output_limit" and call.stdout == "y" * LIMITS.output_bytes and call.stdout_cut > 0
    assert call.seconds < SLACK_S
    assert call.text().endswith(f"[stdout cut: {call.stdout_cut} more bytes]\n[Output limit: the program was stopped]")


def test_a_large_file_stops_at_the_file_size_limit(sandboxes):
    limits = LIMITS.model_copy(update={"file_size_mb": 1})
    call, left = run_hostile(sandboxes, f"open('big_{MARK}', 'wb').write(b'x' * (8 << 20))", limits)
    assert call.outcome == "file_size" and left == [f"big_{MARK}"]


def test_the_same_program_prints_the_same_in_two_episodes(sandboxes):
    """No hidden state between episodes: its pid, its host name, /tmp, its folder and a set's order
    are the same in every fresh workspace."""
    source = (
        "import os, socket\n"
        "print(os.getpid(), socket.gethostname(), os.getuid(), sorted(os.listdir('/tmp')), sorted(os.listdir('.')))\n"
        "print({'apple', 'river', 'stone', 'cloud', 'x'})\n"
        "open('/tmp/t', 'w').write('x'); open('here', 'w').write('x')"
    )
    outputs = []
    for _ in range(2):
        with sandboxes.open("same") as ws:
            outputs.append(ws.run(Program(python=source), LIMITS).stdout)
    assert outputs[0] == outputs[1] and "[] []" in outputs[0]


def test_an_episode_keeps_its_folder_across_calls_and_loses_it_at_close(sandboxes):
    with sandboxes.open("kept") as ws:
        ws.write("data.txt", b"1 2 3\n")
        first = ws.run(Program(python="open('sum.txt', 'w').write(str(sum(map(int, open('data.txt').read().split()))))"), LIMITS)
        second = ws.run(Program(python="print(open('sum.txt').read())"), LIMITS)
        folder = ws.folder
    assert first.outcome == second.outcome == "exit" and second.stdout == "6\n"
    assert not folder.exists()


def test_a_root_the_sandbox_user_cannot_reach_is_refused_saying_why(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("sandboxes run as this user when it is not root: it can reach its own folders")
    with pytest.raises(SandboxUnavailable, match=r"sandboxes run as uid 65534, which must be able to enter every folder above"):
        BubblewrapSandboxes(tmp_path / "private").check()


def test_bubblewrap_missing_is_refused_naming_the_package(tmp_path):
    with pytest.raises(
        SandboxUnavailable,
        match=r"bubblewrap .*not installed: install bubblewrap \(Debian and Ubuntu: `apt-get install bubblewrap`",
    ):
        BubblewrapSandboxes(tmp_path, bwrap="bwrap-not-installed").check()


def test_the_folders_of_a_killed_owner_are_removed_by_the_next(sandboxes):
    """A process killed with its episodes open leaves their folders; the next process that opens the
    root removes them (their owner is gone)."""
    import subprocess
    import sys

    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, sys; from pathlib import Path; from dagster_rl.sandbox.bubblewrap import BubblewrapSandboxes\n"
            f"ws = BubblewrapSandboxes(Path({str(sandboxes.root)!r})).open('doomed'); ws.write('x', b'x')\n"
            "print(ws.folder, flush=True); os.kill(os.getpid(), 9)",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    doomed = Path(child.stdout.strip())
    assert child.returncode == -9 and doomed.is_dir()
    BubblewrapSandboxes(sandboxes.root).open("next").close()
    assert not doomed.exists() and not doomed.parent.exists()
