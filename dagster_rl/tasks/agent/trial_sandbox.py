"""What an environment gets for one trial: its own folder, and a sandbox for the programs it runs.

    class MyEnvironment:
        def __init__(self, settings, world, seed, sandbox: TrialSandbox):
            (sandbox.folder / "state.json").write_text("{}")     # the environment's own files
            sandbox.write("data.csv", b"...")                      # a file the programs will see
        def step(self, action):
            call = sandbox.run(Program(python=code), settings.limits)   # a program, in the sandbox
            return Outcome(call.text(settings.limits), tool="python", argument=code)

`folder` is the environment's: a folder on the machine the environment runs on, made for the trial
and removed when it ends; the programs never see it. `run` runs a program in the trial's
workspace (`dagster_rl.sandbox`: bubblewrap on this machine, a pod on a cluster), opened at the
first call and kept for the trial's later calls, closed with the trial. Every call is recorded
(`calls`): the episode writes them into the turn that made them. A trial sandbox stands for its
folder where a path is expected (`sandbox / "notes.txt"`), as the `sandbox` argument of
environments was a folder before programs ran in one.
"""

import os
from pathlib import Path

from dagster_rl.sandbox.calls import Call, Program
from dagster_rl.sandbox.limits import SandboxLimits
from dagster_rl.sandbox.placement import Sandboxes, Workspace


class TrialSandbox:
    def __init__(self, folder: Path, sandboxes: Sandboxes | None, label: str):
        self.folder, self.sandboxes, self.label = folder, sandboxes, label
        self.calls: list[tuple[Program, Call]] = []
        self._workspace: Workspace | None = None

    def __truediv__(self, name: str) -> Path:
        return self.folder / name

    def __fspath__(self) -> str:
        return os.fspath(self.folder)

    def workspace(self) -> Workspace:
        if self.sandboxes is None:
            raise RuntimeError(
                f"trial {self.label} has no sandbox for programs: the rollout was started without a sandbox environment"
            )
        if self._workspace is None:
            self._workspace = self.sandboxes.open(self.label)
        return self._workspace

    def write(self, name: str, data: bytes) -> None:
        """A file (a plain relative name) where the trial's programs see it."""
        self.workspace().write(name, data)

    def run(self, program: Program, limits: SandboxLimits) -> Call:
        """Run a program in the trial's workspace; a `SandboxUnavailable` when none could be made."""
        call = self.workspace().run(program, limits)
        self.calls.append((program, call))
        return call

    def taken(self) -> list[tuple[Program, Call]]:
        """The calls made since the last time they were taken."""
        taken, self.calls = self.calls, []
        return taken

    def close(self) -> None:
        if self._workspace is not None:
            self._workspace.close()
            self._workspace = None
