"""What both placements share about a call: the program's environment, the workspace's file names,
output bounded as it arrives, and how the launcher's report becomes the call's record.

Whichever placement ran it (bubblewrap here, a pod on a cluster), a program sees the same
environment, its output is kept up to the same bound with the same count of what was cut, and
the same report (`dagster_rl.sandbox.launcher`) gives the same outcome: the record of a call does
not say where it ran, except in its time.
"""

import re
import signal
from collections.abc import Callable

from dagster_rl.sandbox.calls import Call, CallOutcome
from dagster_rl.sandbox.limits import SandboxLimits

WORK = "/work"  # where a program sees its episode's folder, and its working directory
NAME = re.compile(r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$")
ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": WORK,
    "TMPDIR": "/tmp",
    "LANG": "C.UTF-8",
    "PYTHONHASHSEED": "0",  # the same program prints the same set in the same order, every time
    "PYTHONUNBUFFERED": "1",  # what a program printed before a limit stopped it is kept
    "PYTHONDONTWRITEBYTECODE": "1",
}


def check_file_name(name: str) -> str:
    """A file name in a workspace: plain names (letters, digits, _ . -) joined by /, never `..`."""
    if not NAME.match(name) or ".." in name.split("/"):
        raise ValueError(f"{name!r} is not a file name in a workspace: plain names (letters, digits, _ . -) and /")
    return name


class Bounded:
    """The first `limit` bytes of a stream, and how many came after."""

    def __init__(self, limit: int):
        self.limit, self.data, self.cut = limit, bytearray(), 0

    def add(self, chunk: bytes) -> bool:
        """Keep what fits; True when the stream went past its limit."""
        room = self.limit - len(self.data)
        self.data += chunk[: max(room, 0)]
        self.cut += max(len(chunk) - max(room, 0), 0)
        return self.cut > 0

    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


def classify(ending: dict, stderr: str, limits: SandboxLimits) -> CallOutcome:
    """Why a program that was not stopped from outside ended, from the launcher's ending line.

    A SIGKILL is `timeout` when the program had used its CPU seconds (the hard CPU limit), and
    `memory` when the launcher saw its cgroup's OOM killer act during the call (`oom_kill`, in a
    pod: the pod's memory limit, all its processes together)."""
    last = next((line for line in reversed(stderr.splitlines()) if line.strip()), "")
    if "signal" in ending:
        sig = ending["signal"]
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and ending.get("cpu_s", 0.0) >= limits.cpu_s):
            return "timeout"
        if sig == signal.SIGKILL and ending.get("oom_kill", 0) > 0:
            return "memory"
        if sig == signal.SIGXFSZ:
            return "file_size"
        return "killed"
    if ending.get("exit", 0) != 0 and last.startswith("MemoryError"):
        return "memory"
    if ending.get("exit", 0) != 0 and "[Errno 27] File too large" in last:
        return "file_size"
    return "exit"


def call_record(
    out: Bounded,
    err: Bounded,
    report: list[dict],
    stopped: CallOutcome | None,
    limits: SandboxLimits,
    seconds: float,
    folder_bytes: Callable[[], int],
) -> Call:
    """The call's record from what was read and the launcher's report lines: a stop from outside
    (`stopped`) names the outcome; else the ending line does, and a folder over its limit after a
    plain exit makes it `disk_limit` (`folder_bytes` is asked only then)."""
    ending: dict = next((x for x in report if "exit" in x or "signal" in x), {})
    exec_error = next((x["exec_error"] for x in report if "exec_error" in x), None)
    stderr = err.text() + (f"{exec_error}\n" if exec_error else "")
    outcome = stopped or classify(ending, stderr, limits)
    if outcome == "exit" and folder_bytes() > limits.folder_mb << 20:
        outcome = "disk_limit"
    return Call(
        stdout=out.text(),
        stderr=stderr,
        stdout_cut=out.cut,
        stderr_cut=err.cut,
        exit_status=ending.get("exit"),
        signal=ending.get("signal"),
        outcome=outcome,
        seconds=round(seconds, 6),
    )
