"""A program to run in a sandbox, and what running it returned: the record of one tool call.

Why a call ended (`outcome`), in the words an agent's observation uses:

    exit          the program ended by itself (any exit status)
    timeout       it used its CPU seconds, or ran past the wall-clock backstop, and was stopped
    memory        it ran out of its memory (a MemoryError, or killed by the kernel for memory)
    output_limit  it wrote more than the output limit to stdout or stderr, and was stopped
    file_size     it wrote a file larger than the file-size limit, and was stopped
    disk_limit    it ended, and its episode's folder holds more than the folder limit
    killed        a signal ended it that none of the limits sent (it killed itself, say)

Each is the program's doing, never the sandbox's: a call that returns one of these is an
observation, and the episode goes on. A sandbox that cannot be made raises `SandboxUnavailable`
instead (infrastructure: the trial fails, is retried, and is never cached).
"""

import signal
from dataclasses import dataclass
from typing import Literal

from dagster_rl.base.errors import DagsterRLError
from dagster_rl.base.strict import Record
from dagster_rl.sandbox.limits import SandboxLimits

CallOutcome = Literal["exit", "timeout", "memory", "output_limit", "file_size", "disk_limit", "killed"]
MAX_SOURCE_BYTES = 100_000  # a program's source travels as one argument (Linux allows 128 KiB)


class SandboxUnavailable(DagsterRLError):
    """No sandbox could be made (bubblewrap missing, a pod not scheduled, the cluster unreachable):
    infrastructure, not the program's doing. The trial fails and is retried; never cached."""


@dataclass(frozen=True)
class Program:
    """Python source (run by the sandbox's interpreter as `python3 -c`), or a command's arguments,
    with its standard input."""

    python: str | None = None
    argv: tuple[str, ...] = ()
    stdin: bytes = b""

    def __post_init__(self) -> None:
        if (self.python is None) == (not self.argv):
            raise ValueError("a Program is Python source or a command's arguments, one of the two")
        if self.python is not None and len(self.python.encode()) > MAX_SOURCE_BYTES:
            raise ValueError(f"a program's source may hold {MAX_SOURCE_BYTES} bytes; this one holds {len(self.python.encode())}")


class Call(Record):
    """What one program run in a sandbox returned: its output (each stream bounded, with how many
    bytes were cut), how it ended, and the wall time it took."""

    stdout: str
    stderr: str
    stdout_cut: int = 0  # bytes of stdout past the output limit, not kept (at least; the program was stopped)
    stderr_cut: int = 0
    exit_status: int | None = None  # the program's, when it exited
    signal: int | None = None  # the signal that ended it, when one did
    outcome: CallOutcome
    seconds: float  # wall time of the call, sandbox start included

    def text(self, limits: SandboxLimits | None = None) -> str:
        """The call as an agent reads it: stdout, then stderr, then one line on how it ended when
        it did not exit with status 0."""
        parts = [self.stdout.rstrip("\n")] if self.stdout else []
        if self.stdout_cut:
            parts.append(f"[stdout cut: {self.stdout_cut} more bytes]")
        if self.stderr:
            parts.append(self.stderr.rstrip("\n"))
        if self.stderr_cut:
            parts.append(f"[stderr cut: {self.stderr_cut} more bytes]")
        ending = self.ending(limits)
        if ending:
            parts.append(f"[{ending}]")
        return "\n".join(parts)

    def details(self, limits: SandboxLimits | None = None) -> list[str]:
        """How it ended, for a person: the ending when it is not a plain exit, then the exit status
        or the signal (`["Timeout after 5 s", "signal SIGXCPU"]`)."""
        ending = self.ending(limits)
        shown = [ending] if ending and not ending.startswith("exit status") else []
        if self.exit_status is not None:
            shown.append(f"exit status {self.exit_status}")
        elif self.signal:
            shown.append(f"signal {signal.Signals(self.signal).name}")
        return shown

    def ending(self, limits: SandboxLimits | None = None) -> str:
        """`Timeout after 5 s`, `exit status 1`, ...: how it ended, or "" for an exit with status 0.
        A timeout by the wall clock (a program that sleeps or blocks: stopped from outside with no
        signal of its own, or killed by a pod's launcher once the wall time had passed) names that
        limit, not the CPU seconds it never used. Limits, never the measured
        time, so that the same program reads the same every time."""
        if self.outcome == "exit":
            return "" if self.exit_status == 0 else f"exit status {self.exit_status}"
        if self.outcome == "timeout":
            if limits is None:
                return "Timeout"
            stopped_outside = self.signal is None and self.exit_status is None  # bubblewrap's backstop
            killed_late = self.signal not in (None, signal.SIGXCPU) and self.seconds >= limits.wall_s  # a pod's launcher
            if stopped_outside or killed_late:
                return f"Timeout: still running after {limits.wall_s:g} s of wall time"
            return f"Timeout after {limits.cpu_s:g} s"
        name = signal.Signals(self.signal).name if self.signal else None
        return {
            "memory": "Out of memory",
            "output_limit": "Output limit: the program was stopped",
            "file_size": "File size limit: the program was stopped",
            "disk_limit": "Folder size limit: the episode's folder holds too much",
            "killed": f"Killed by {name}" if name else "Killed",
        }[self.outcome]
