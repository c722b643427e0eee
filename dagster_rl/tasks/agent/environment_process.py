"""One trial's environment in a process of its own: every call timed alone, and stopped when it
outlives its trial.

A rollout plays many trials together (a turn of every live trial is one batch). An environment's
`step` that blocks, loops or eats memory must fail its own trial at its trial's time limit and
nothing else: so each trial's environment is made and called in a child process (forked by the
environments' host, `environment_host`: a clean process that imports the environments' modules
once), and each call waits at most until the trial's deadline. Past it,
the child is killed and the call raises `TrialTimeout`; the other trials of the batch go on.

What crosses between the two is plain data: the environment's settings, world and seed in, and
back the observation (cut in the child to `max_observation_chars`, so that a 5 MB observation is
never sent, let alone tokenized whole), the outcome, the verdict, and the programs the
environment ran in its sandbox during the call (`TrialSandbox.taken`). An exception of the
environment comes back as its type and message (`EnvironmentFailed`).

The child dies with the process that started it: it watches that process by its identity (pid
and start time) and exits once it is gone, whatever the environment's code is doing; the host
exits with it too. The environment's module must be importable by name in the
child (a registered environment's `make.__module__`, and the experiment's plugins): an environment
defined in `__main__` or registered in a function's body is refused, naming where to move it.
"""

import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from dagster_rl.base.errors import DagsterRLError
from dagster_rl.runtime.lifetime import alive, identity
from dagster_rl.sandbox.calls import Call, Program
from dagster_rl.sandbox.placement import Sandboxes
from dagster_rl.tasks.agent.environment import (
    EnvironmentSettings,
    EnvironmentSpec,
    JudgeValue,
    Outcome,
    World,
    registered_by,
)
from dagster_rl.tasks.agent.environment_host import Host

WATCH_S = 0.5  # how often a child looks for its parent


class EnvironmentFailed(DagsterRLError):
    """The environment's own code raised (in its process): a failed trial, retried, never cached."""


class TrialTimeout(TimeoutError):
    """A trial ran longer than `task.episode.trial_timeout_s`."""


@dataclass(frozen=True)
class Returned:
    """A cut observation: the text kept, and how long it was."""

    text: str
    length: int

    @property
    def cut(self) -> bool:
        return self.length > len(self.text)


def module_of(spec: EnvironmentSpec) -> str:
    """The module a child imports to find `spec` registered: the one that registered it."""
    module = registered_by(spec.name)
    if not module or module == "__main__":
        raise EnvironmentFailed(
            f"environment {spec.name} is registered from {module or 'no module'}: a trial's environment runs in a process "
            "of its own, which imports the module that registers it; register it at the top level of an importable module "
            "(or a plugin file named in the experiment's `plugins`)"
        )
    return module


class EnvironmentProcess:
    """A trial's environment, made in a child process; each call returns within `seconds_left()`
    or kills the child and raises `TrialTimeout`."""

    def __init__(
        self,
        spec: EnvironmentSpec,
        settings: EnvironmentSettings,
        world: World,
        seed: int,
        folder: Path,
        sandboxes: Sandboxes | None,
        label: str,
        max_observation_chars: int,
        seconds_left: Callable[[], float],
        plugins: tuple[tuple[str, str | None], ...] = (),
    ):
        self.spec, self.label, self.seconds_left = spec, label, seconds_left
        preload = [*plugins, (module_of(spec), None)]
        args = (spec.name, settings.model_dump_json(), world, seed, folder, sandboxes, label, max_observation_chars, identity())
        self.pid, sock = Host.get().fork(f"{__name__}:serve", preload, args)
        self._pidfd = _pidfd_of(self.pid)
        self._conn = Connection(sock.detach())
        try:
            self._call("made")
        except BaseException:
            self.kill()  # an environment that could not be made leaves no process behind
            raise

    def reset(self) -> Returned:
        return self._call("reset")

    def step(self, action: str) -> tuple[Outcome, Returned, list[tuple[Program, Call]]]:
        return self._call("step", action)

    def verdict(self) -> Any:
        return self._call("verdict")

    def calls(self) -> list[tuple[Program, Call]]:
        """The programs the environment ran since the last call that returned them (made, reset)."""
        return self._call("calls")

    def _call(self, what: str, *args: Any) -> Any:
        if self._conn.closed:
            raise EnvironmentFailed(f"trial {self.label}: the environment's process was stopped")
        try:
            self._conn.send((what, args))
        except (BrokenPipeError, OSError) as e:
            raise EnvironmentFailed(f"trial {self.label}: the environment's process is gone ({e})") from None
        left = self.seconds_left()
        if left <= 0 or not self._conn.poll(None if left == float("inf") else left):
            self.kill()
            raise TrialTimeout(
                f"trial {self.label}: environment {self.spec.name}'s {what}() was still running at the trial's time limit "
                "(task.episode.trial_timeout_s): its process was stopped"
            )
        try:
            status, value = self._conn.recv()
        except (EOFError, OSError):
            self.kill()
            raise EnvironmentFailed(
                f"trial {self.label}: environment {self.spec.name}'s process died during {what}() (killed, or out of memory)"
            ) from None
        if status == "error":
            raise EnvironmentFailed(f"trial {self.label}: environment {self.spec.name}'s {what}() raised {value}")
        return value

    def close(self) -> None:
        """Close the environment (its `close()`, its sandbox) within its time, then stop the process."""
        if not self._conn.closed:
            try:
                self._conn.send(("close", ()))
                if self._conn.poll(min(5.0, max(self.seconds_left(), 1.0))):
                    self._conn.recv()
            except (EOFError, OSError):
                pass
        self.kill()

    def kill(self) -> None:
        """SIGKILL the child through its pidfd: the host's children are reaped the moment they exit, so
        a child that already left may have handed its pid to another process, which `kill(pid)` would hit."""
        if self._pidfd is not None:
            if self._pidfd >= 0:
                try:
                    signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                os.close(self._pidfd)
                self._pidfd = -1
        else:  # no pidfds here (not Linux, or older than 5.3)
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not self._conn.closed:
            self._conn.close()


def _pidfd_of(pid: int) -> int | None:
    """A pidfd of the child (it waits for its first call: its pid is still its own); -1 when it has
    already exited (nothing to kill); None where there are no pidfds."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return -1
    except (AttributeError, OSError):
        return None


def _watch_parent(parent: str) -> None:
    while alive(parent):
        time.sleep(WATCH_S)
    os._exit(70)


def serve(
    sock: Any,
    name: str,
    settings_json: str,
    world: World,
    seed: int,
    folder: Path,
    sandboxes: Sandboxes | None,
    label: str,
    max_chars: int,
    parent: str,
) -> None:
    """The child: make the environment, answer calls until `close`, then close it and its sandbox
    (the environment's module and plugins are imported: the host did, before it forked)."""
    import functools

    from dagster_rl.tasks.agent.environment import environment_of
    from dagster_rl.tasks.agent.trial_sandbox import TrialSandbox

    conn = Connection(sock.detach())
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    env = None
    sandbox = TrialSandbox(folder, sandboxes, label)

    def answer(fn) -> None:
        try:
            conn.send(("ok", fn()))
        except BaseException as e:  # the environment's failure, reported to the parent as text
            frames = traceback.extract_tb(e.__traceback__)
            where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
            conn.send(("error", f"{type(e).__name__}: {e}{where}"))

    def made() -> None:
        nonlocal env
        spec = environment_of(name)
        env = spec.make(spec.settings.model_validate_json(settings_json), world, seed, sandbox)

    def cut(text: Any) -> Returned:
        if not isinstance(text, str):
            raise TypeError(f"an observation is text (str), not {type(text).__name__}")
        return Returned(text[:max_chars], len(text))

    def step(action: str) -> tuple[Outcome, Returned, list]:
        outcome = env.step(action)  # type: ignore[union-attr]
        if not isinstance(outcome, Outcome):
            raise TypeError(f"step() returns an Outcome, not {type(outcome).__name__}")
        returned = cut(outcome.observation)
        return Outcome(returned.text, outcome.done, outcome.end_reason, outcome.tool, outcome.argument), returned, sandbox.taken()

    handlers: dict[str, Callable[..., Any]] = {
        "made": made,
        "reset": lambda: cut(env.reset()),  # type: ignore[union-attr]
        "step": step,
        "verdict": lambda: plain_verdict(env.verdict()),  # type: ignore[union-attr]
        "calls": sandbox.taken,
        "close": lambda: env.close() if env is not None else None,
    }
    try:
        while True:
            try:
                what, args = conn.recv()
            except EOFError:
                return
            answer(functools.partial(handlers[what], *args))
            if what == "close":
                return
    finally:
        sandbox.close()


def plain_verdict(verdict: Any) -> dict[str, JudgeValue]:
    """The verdict as the judge takes it: a dict of text keys to text, numbers, booleans or None.
    One error per cause, naming the key and the type found."""
    if not isinstance(verdict, dict):
        raise TypeError(f"verdict() returns a dict (with `success` at least), not {type(verdict).__name__}")
    bad = [
        f"{key!r}: {type(value).__name__}"
        for key, value in verdict.items()
        if not isinstance(key, str) or not (value is None or isinstance(value, (str, int, float, bool)))
    ]
    if bad:
        raise TypeError(
            f"verdict() holds values the judge cannot take ({', '.join(bad)}): a verdict maps text keys to str, int, float, "
            "bool or None (turn a set or a list into a count or a string)"
        )
    if "success" not in verdict:
        raise TypeError(f"verdict() has no `success` key (it has {sorted(verdict)}): the judge needs it")
    return verdict
