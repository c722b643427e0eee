"""A process that must not outlive its parent: the driver, in a step process of Dagster's
multiprocess executor.

A SIGKILL of the run worker (or of `dagster asset materialize`, which orchestrates in its own
process) does not reach the step process it started: reparented to pid 1, the driver would go on
walking its range of steps and writing into a run nobody watches. `die_with_parent()` watches the
parent from a thread, through the pipe `multiprocessing` keeps open between them (it reads as
closed the moment the parent dies, whatever killed it), and then kills the process's own children
(a trainer's `torchrun` and its workers) and the process itself, at once.

A trainer session's workers outlive a step, not the driver: they are not always its descendants
when it dies (a SIGKILL of the driver itself reparents them), so they watch it by its identity
(`identity()`: pid and start time, never a later process that reuses the pid) and stop once it is
gone (`alive()`).
"""

import multiprocessing
import os
import signal
import threading
from pathlib import Path


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


def children(pid: int) -> list[int]:
    """Every descendant of `pid` (Linux /proc), deepest first."""
    by_parent: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        by_parent.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found: list[int] = []

    def walk(p: int) -> None:
        for child in by_parent.get(p, []):
            walk(child)
            found.append(child)

    walk(pid)
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL the descendants of `pid`, then `pid`."""
    for child in children(pid):
        try:
            os.kill(child, signal.SIGKILL)
        except OSError:
            pass
    os.kill(pid, signal.SIGKILL)


def identity(pid: int | None = None) -> str:
    """`<pid>:<start time in clock ticks since boot>` of a process (this one by default), Linux /proc."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}:{_started(pid)}"


def alive(ident: str) -> bool:
    """Whether the process `identity()` named is still running (the same process, not a zombie)."""
    pid, _, started = ident.partition(":")
    if not pid.isdigit():
        raise ValueError(f"{ident!r} is not a process identity (<pid>:<start time>)")
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z" and _started(int(pid)) == started


def _started(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""
