"""Workers: the processes a trainer session holds across calls, for a range of steps, and how a
launcher keeps them.

A trainer session (`dagster_rl.tasks.lm.train.session`) starts its workers once per range of steps,
each running the trainer entrypoint (`dagster_rl.tasks.lm.train.entrypoint`): `torchrun` on this
machine (a `Start`: `ProcessWorkers` here, `resources.trainer_launcher.PipesWorkers` through
Dagster Pipes), or an Indexed Job of pods (`dagster_rl.runtime.pods.PodLauncher.start`:
`resources.k8s_launcher.SessionPods`). The launcher hands back a `Workers`: the backend polls it
while it waits for a result, and closes it when the range ends, after it has told the workers to stop.
"""

import os
import signal
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from dagster_rl.base.errors import DagsterRLError
from dagster_rl.runtime.lifetime import alive, children, identity


class WorkersGone(DagsterRLError):
    """The workers of a session ended (a killed process, a lost pod, an idle timeout) or were ended."""


class Workers(Protocol):
    def check(self) -> None:
        """Return while the workers live (a launcher may restart them here, as a whole set); raise
        `WorkersGone` (or the launcher's own error: a terminated run) once they are gone for good."""

    def stepped(self) -> None:
        """A step completed: the launcher's budget of whole-set restarts starts again."""

    def close(self, grace_s: float) -> None:
        """Give the workers `grace_s` to exit (they were told to stop), end what is left, clean up."""


Start = Callable[[list[str], dict[str, str]], Workers]  # start a command (torchrun) with extra env, not waiting for it


class ProcessWorkers:
    """A command (torchrun and its workers) run as a subprocess of this process until it exits or
    is closed; its output goes to a file whose tail says why it died."""

    def __init__(self, command: list[str], env: dict[str, str], cwd: Path | str | None = None):
        self.command = command
        self.output = tempfile.TemporaryFile(prefix="dagster-rl-workers-")
        self.proc = subprocess.Popen(command, env=env, cwd=cwd, stdout=self.output, stderr=subprocess.STDOUT)

    def tail(self, n: int = 4000) -> str:
        self.output.seek(0, os.SEEK_END)
        size = self.output.tell()
        self.output.seek(max(0, size - n))
        return self.output.read().decode(errors="replace")

    def check(self) -> None:
        rc = self.proc.poll()
        if rc is not None:
            raise WorkersGone(f"the trainer workers ({' '.join(self.command[:3])} ...) exited with code {rc}:\n{self.tail()}")

    def stepped(self) -> None:
        pass

    def close(self, grace_s: float) -> None:
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            end(self.proc)
        finally:
            self.output.close()


def end(proc: subprocess.Popen, term_s: float = 5.0) -> None:
    """SIGTERM a process (torchrun passes it on to its workers), then SIGKILL it and what it left
    (each descendant by its identity: never a later process that reuses a pid)."""
    left = {identity(pid) for pid in children(proc.pid)}
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(term_s)
    except subprocess.TimeoutExpired:
        left |= {identity(pid) for pid in children(proc.pid)}
        proc.kill()
        proc.wait()
    for ident in left:
        if alive(ident):
            try:
                os.kill(int(ident.split(":")[0]), signal.SIGKILL)
            except OSError:
                pass
