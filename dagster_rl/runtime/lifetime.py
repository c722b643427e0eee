"""A process that must not outlive its parent: the driver, in a step process of Dagster's
multiprocess executor; the run's process that `dagster-rl train` starts.

A SIGKILL of the run worker (or of `dagster asset materialize`, which orchestrates in its own
process) does not reach the step process it started: reparented to pid 1, the driver would go on
walking its range of steps and writing into a run nobody watches. `die_with_parent()` watches the
parent from a thread, through the pipe `multiprocessing` keeps open between them (it reads as
closed the moment the parent dies, whatever killed it), and then kills the process's own children
(a trainer's `torchrun` and its workers) and the process itself, at once.

`dagster-rl train` runs its run in a child process of a session of its own, which watches the
end of a pipe that only `dagster-rl train` holds open (`interrupt_when_gone`): once it reads closed,
the child interrupts itself, as a Ctrl-C would (Dagster records the run canceled, its steps stop
their workers), and if that has not ended it within `GRACE_S` (a step that does not answer its
interruption: inside a native call, or waiting for a thread that waits on a server) it kills its
descendants and itself, as `die_with_parent` does.

A trainer session's workers outlive a step, not the driver: they are not always its descendants
when it dies (a SIGKILL of the driver itself reparents them), so they watch it by its identity
(`identity()`: pid and start time, never a later process that reuses the pid) and stop once it is
gone (`alive()`).
"""

import multiprocessing
import os
import signal
import threading
import time

import psutil

TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100  # the unit of `identity()`'s start time
CLOCK_SLACK_S = 2.0  # the boot time in `process_started_at` is whole seconds, and a clock adjustment can move it by one


def die_with_parent() -> bool:
    """Arm the watch when this process was started by `multiprocessing` (a step process); return
    whether it is armed. Elsewhere (in-process execution, a run worker) it does nothing."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return False
    if not getattr(die_with_parent, "_armed", False):
        die_with_parent._armed = True  # type: ignore[attr-defined]
        threading.Thread(target=_watch, args=(parent,), name="dagster-rl-die-with-parent", daemon=True).start()
    return True


def _watch(parent) -> None:
    parent.join()  # returns when the pipe to the parent closes: the parent is gone
    kill_tree(os.getpid())


GRACE_S = 5.0  # an interrupted run's process ends in about 1.5 s here (its steps stop, Dagster records the run)


def interrupt_when_gone(fd: int, grace_s: float = GRACE_S) -> None:
    """Watch, from a thread, the read end `fd` of a pipe whose write end the parent alone holds: when
    it reads closed (the parent is gone, whatever ended it), SIGINT this process, then, if it still
    runs `grace_s` later, SIGKILL its descendants and itself."""

    def watch() -> None:
        try:
            while os.read(fd, 1):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(grace_s)
        kill_tree(os.getpid())

    threading.Thread(target=watch, name="dagster-rl-parent", daemon=True).start()


def children(pid: int) -> list[int]:
    """Every descendant of `pid`, each before its ancestors (deepest first); none when `pid` is gone."""
    try:
        found = psutil.Process(pid).children(recursive=True)  # each after its ancestors
    except psutil.Error:
        return []
    return [p.pid for p in reversed(found)]


def kill_tree(pid: int) -> None:
    """SIGKILL the descendants of `pid`, then `pid`."""
    for child in children(pid):
        try:
            os.kill(child, signal.SIGKILL)
        except OSError:
            pass
    os.kill(pid, signal.SIGKILL)


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs: it exists and is not a zombie (a process that ended and that its
    parent has not reaped yet: dead all the same)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:  # ZombieProcess too, where the platform raises it
        return False
    except psutil.AccessDenied:  # another user's process: it exists
        return True


def process_started_at(pid: int) -> float | None:
    """When process `pid` started (epoch seconds: the boot time, whole seconds, plus its start in
    clock ticks); None when there is no such process."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def identity(pid: int | None = None) -> str:
    """`<pid>:<start time in clock ticks since boot>` of a process (this one by default); `<pid>:`
    when there is no such process."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}:{_started(pid)}"


def alive(ident: str) -> bool:
    """Whether the process `identity()` named is still running (the same process, not a zombie)."""
    pid, _, started = ident.partition(":")
    if not pid.isdigit():
        raise ValueError(f"{ident!r} is not a process identity (<pid>:<start time>)")
    return process_alive(int(pid)) and _started(int(pid)) == started


def _started(pid: int) -> str:
    """The process's start in clock ticks since boot ("" when it is gone): what the kernel records,
    unmoved by clock changes. psutil gives it as the boot time plus that start, so the boot time,
    read on both sides, is taken off again (and read again when the clock moved it in between)."""
    try:
        process = psutil.Process(pid)
        for _ in range(3):
            boot = psutil.boot_time()
            created = process.create_time()
            if psutil.boot_time() == boot:
                return str(round((created - boot) * TICKS_PER_S))
    except psutil.Error:
        pass
    return ""
