"""The one interface both placements implement: `Sandboxes` opens an episode's `Workspace`.

A workspace is one episode's sandbox: a writable folder that programs see as their working
directory, kept across the episode's calls and removed when it closes. Every call starts fresh
processes (nothing of a call runs after it returns); only the folder's files carry over.

    with sandboxes.open("s3-p0-n1") as ws:    # a trial's workspace (its label is for people)
        ws.write("data.txt", b"1 2 3\n")      # a file the programs will see
        call = ws.run(Program(python="print(open('data.txt').read())"), limits)

`check()` says, before a run's first step, whether this placement can make sandboxes at all
(bubblewrap installed; the cluster reachable): a `SandboxUnavailable` naming what to install or
configure. A placement never falls back to running a program unsandboxed.
"""

from types import TracebackType
from typing import Protocol

from dagster_rl.sandbox.calls import Call, Program
from dagster_rl.sandbox.limits import SandboxLimits


class Workspace(Protocol):
    def write(self, name: str, data: bytes, mode: int = 0o644) -> None:
        """Put a file (a plain name, or a relative path of plain names) where the programs see it."""

    def run(self, program: Program, limits: SandboxLimits) -> Call:
        """Run one program to its end, within `limits`; raise `SandboxUnavailable` when no sandbox
        could be made (never for what the program did)."""

    def close(self) -> None:
        """Stop whatever is left and remove the folder."""

    def __enter__(self) -> "Workspace": ...

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None: ...


class Sandboxes(Protocol):
    """A placement: where an episode's programs run."""

    name: str  # bubblewrap, k8s

    def check(self) -> None:
        """Raise `SandboxUnavailable` naming what is missing when this placement cannot make sandboxes."""

    def identity(self) -> str:
        """What programs run on, as a cache key holds it: the interpreter's version (and the image, in
        pods), so that outputs another interpreter would word otherwise are never taken for these."""

    def open(self, label: str) -> Workspace:
        """A new, empty workspace for one episode."""
