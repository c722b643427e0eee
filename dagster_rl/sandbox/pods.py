"""The Kubernetes placement: one fresh pod of the sandbox tier per episode, taken from a small pool
of pods started ahead, deleted when the episode ends, never given to another episode.

    sandboxes = PodSandboxes(PodSandboxSettings(image="registry.example.com/dagster-rl:0.1.0"),
                             max_concurrency=16, max_retries=2)
    sandboxes.check()                          # a pod made, `print(6 * 7)` run in it, or SandboxUnavailable
    with sandboxes.open("s3-p0-n1") as ws:     # a warm pod of the pool, this episode's alone
        ws.write("data.txt", b"1 2 3\\n")
        call = ws.run(Program(python="print(open('data.txt').read())"), limits)
    sandboxes.close()                          # the pool's pods deleted (also at exit)

**Why a pod per episode, from a pool.** A pod cannot be made per call: starting one is seconds
(Kubernetes' own SLO for a schedulable pod whose image is on the node is 5 s at the 99th
percentile, image pull excluded: kubernetes/community, sig-scalability/slos/pod_startup_latency.md;
gVisor and Kata add their sandbox's start to it), where a call is about 0.1 s (bench/sandbox_pods.py:
the exec path against the fake cluster, as a bubblewrap call; a cluster adds its API server's and
kubelet's round trips). Reusing a pod across the episodes of a step would hide that cost too, but
an episode's state can outlive its processes in places a reset cannot all reach (SysV IPC objects
of the pod's IPC namespace, files a program leaves in memory-backed mounts, the uid's process
count): episodes would then see each other, and a retried episode would not run in the sandbox its
first attempt had. So a pod is never reused; the pool (`pool_size`, refilled as episodes take pods)
starts pods while earlier episodes run, and an episode that finds it empty waits for a cold start.
Size it as episodes started per second times the start time (docs/kubernetes.md, "Sandboxes").

**A call.** An exec through the API server (not pod network traffic: the deny-all policy does not
block it) runs the launcher's bootstrap, which reads the same launcher the local placement runs
(`dagster_rl.sandbox.launcher`) with the same limits; the launcher frames the program's output,
stops it at its output and wall limits, and, when it ends, kills every process of the sandbox's
user but the pod's init and empties /tmp, /dev/shm and /dev/mqueue. The driver holds the call to
`wall_s + exec_grace_s` and to the output limit itself, and then runs the cleanup alone.

**What is guaranteed about processes.** When `run` returns, no process of the sandbox's user is
alive in the pod except its init (PID 1, which the kernel's kill(-1) never reaches and which no
process of that user may ptrace): the launcher SIGKILLs the others and checks /proc until they
are gone, or the driver runs the same cleanup; a call whose cleanup cannot confirm it (a process
stuck in the kernel, the pod unreachable) raises `SandboxUnavailable` and its pod is deleted. Not
guaranteed: what lives on without a process (SysV shared memory and semaphores, which die with the
pod), and, with a shared kernel and the same uid on a node, the per-user process count
(RLIMIT_NPROC) is shared with other pods of that uid: use a runtime class with its own kernel
(gVisor, Kata) or `host_users: false`.

**Whose fault.** A pod that is not running within `startup_timeout_s`, an API or exec error before
the launcher started (retried `max_retries` times), or a stream that breaks during a call (the
pod is deleted: its state is unknown) is `SandboxUnavailable`. What the program did is the call's
outcome, the same as on a laptop.

**Leftovers.** Pods carry `app.kubernetes.io/component: sandbox` and the owner's id as labels, and,
when the driver runs in a pod, an owner reference to it (the garbage collector deletes them with
it); `activeDeadlineSeconds` ends any pod past `active_deadline_s`. The driver (the process that
made the placement) deletes, when it first connects, the sandbox pods that have ended and those
whose owner pod or process is gone; its pool keeper deletes, while it runs, the pods taken by trial
processes of this host that are gone.
"""

import hashlib
import logging
import os
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from dagster_rl.sandbox.calls import Call, Program, SandboxUnavailable
from dagster_rl.sandbox.launcher import CLEANUP, boot_input, framed_run, framed_write
from dagster_rl.sandbox.limits import SandboxLimits
from dagster_rl.sandbox.outcomes import call_record, check_file_name
from dagster_rl.sandbox.placement import Sandboxes, Workspace
from dagster_rl.sandbox.pod_api import (
    current_namespace,
    default_clients,
    delete_all,
    exec_failure,
    find_owner,
    not_found,
    owner_process,
    remove_leftovers,
)
from dagster_rl.sandbox.pod_exec import Exchange, ExecStream, WebSocketExec, command, exchange
from dagster_rl.sandbox.pod_manifest import CONTAINER, Owner, PodSandboxSettings, quantity
from dagster_rl.sandbox.pod_pool import PodMaker, PoolKeeper
from dagster_rl.sandbox.slots import Slot

log = logging.getLogger(__name__)
Clients = Callable[[], tuple[Any, Any]]  # () -> (CoreV1Api for REST, CoreV1Api for execs), picklable
PROBE = "import sys\nprint(6 * 7)\nprint(sys.version)"


class PodSandboxes:
    """Sandboxes in pods of the sandbox tier. At most `max_concurrency` episodes hold a pod at once,
    across the processes of this machine (`open` waits up to `slot_timeout_s` for one to close),
    and `pool_size` more wait warm. `max_retries`: attempts again what failed before anything ran
    (a pod that would not start, an exec the API refused). `clients`: a picklable function that
    returns (a CoreV1Api for REST calls, one on an ApiClient of its own for execs); default:
    in-cluster, else the kubeconfig. `owner`: who the pods belong to (default: the driver's pod,
    else the process that made this placement). `limits`: checked against the pods now (a
    `ValueError` naming what to change). `close()` deletes the warm pods (also done at exit)."""

    name = "k8s"

    def __init__(
        self,
        settings: PodSandboxSettings,
        max_concurrency: int = 8,
        max_retries: int = 2,
        *,
        clients: Clients | None = None,
        owner: Owner | None = None,
        limits: SandboxLimits | None = None,
    ):
        if max_concurrency < 1 or max_retries < 0:
            raise ValueError("max_concurrency is at least 1 and max_retries at least 0")
        if limits is not None:
            settings.check_limits(limits)
        self.settings, self.max_concurrency, self.max_retries = settings, max_concurrency, max_retries
        self._clients, self._owner = clients or default_clients, owner
        self._creator = owner_process()  # the process whose pool this is
        self._identity = ""
        self._checked = False
        self._here()

    # ---- per process --------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        keep = ("settings", "max_concurrency", "max_retries", "_clients", "_owner", "_creator", "_identity", "_checked")
        return {k: self.__dict__[k] for k in keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._here()

    def _here(self) -> None:
        """This process's own state: its clients, the pods it made, its lock (none of a parent's)."""
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._api: Any = None
        self._exec_api: Any = None
        self._namespace = ""
        self._maker: PodMaker | None = None
        self._pools: list[PoolKeeper] = []  # the pool's keeper, when this process keeps it
        self._made: set[str] = set()  # pods this process made or took and has not deleted

    @property
    def creator(self) -> bool:
        """Whether this is the process that made the placement: it alone keeps the pool full."""
        return owner_process() == self._creator

    # ---- the placement ------------------------------------------------------------------------
    def check(self) -> None:
        """A pod made, a program run in it (the pool starts then); `SandboxUnavailable` naming what
        to fix otherwise."""
        if self._checked:
            self.start_pool()
            return
        if not self.settings.image:
            raise SandboxUnavailable("the k8s sandbox placement needs an image with a python3: set the sandbox tier's image")
        cores = quantity(self.settings.cpu_limit, "cores") if self.settings.cpu_limit else 1.0
        limits = SandboxLimits(cpu_s=2, wall_s=max(20.0, 4 / cores), memory_mb=min(256, self.settings.memory_for_programs_mib()))
        self.start_pool()
        with self.open("check") as ws:
            call = ws.run(Program(python=PROBE), limits)
        lines = call.stdout.splitlines()
        if call.outcome != "exit" or lines[:1] != ["42"] or len(lines) != 2:
            raise SandboxUnavailable(f"a sandbox pod was made but a program printing 42 gave {call!r}")
        self._identity = f"python {lines[1]} in {self.settings.image}"
        self._checked = True

    def identity(self) -> str:
        """The interpreter's version in the sandbox image, and the image (asked of a pod, once)."""
        if not self._identity:
            self.check()
        return self._identity

    def open(self, label: str) -> "PodWorkspace":
        """This episode's pod: a warm one of the pool, or a new one (`SandboxUnavailable` when none
        runs within `startup_timeout_s`, or no slot frees within `slot_timeout_s`)."""
        maker = self._connect()
        slot = Slot(
            Path(tempfile.gettempdir()) / "dagster_rl_sandbox_pods" / self._slots_key(maker),
            self.max_concurrency,
            self.settings.slot_timeout_s,
            f"all {self.max_concurrency} sandbox pods stayed in use for {self.settings.slot_timeout_s:g} s",
        ).acquire()
        try:
            name = maker.claim()
            if name is not None:
                self._remember(name)
            else:
                name = self._start_retrying(maker)
        except BaseException:
            slot.release()
            raise
        for pool in self._pools:
            pool.wake()
        log.debug("sandbox pod %s for episode %s", name, label)
        return PodWorkspace(self, name, label, slot)

    def start_pool(self) -> None:
        """Start keeping `pool_size` warm pods (in the process that made the placement only)."""
        maker = self._connect()
        with self._lock:
            if not self._pools and self.creator and self.settings.pool_size > 0:
                self._pools.append(PoolKeeper(maker, self.settings.pool_size))

    def close(self) -> None:
        """Stop the pool and delete its warm pods (the workspaces still open delete theirs when they close)."""
        with self._lock:
            pools, self._pools[:] = list(self._pools), []
        for pool in pools:
            pool.stop()
            pool.remove_warm()

    def __enter__(self) -> "PodSandboxes":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def remove_leftovers(self) -> list[str]:
        """Delete the sandbox pods of this namespace that no live driver owns (`pod_api.remove_leftovers`)."""
        self._connect()
        return remove_leftovers(self._api, self._namespace, keep=set(self._made))

    # ---- the cluster ----------------------------------------------------------------------------
    def _connect(self) -> PodMaker:
        if os.getpid() != self._pid:  # a fork's copy: nothing of the parent's process is this one's
            self._here()
        with self._lock:
            if self._maker is not None:
                return self._maker
            self._api, self._exec_api = self._clients()
            self._namespace = self.settings.namespace or current_namespace()
            if self._owner is None:
                self._owner = find_owner(self._api, self._namespace, self._creator)
            self._maker = maker = PodMaker(self._api, self.settings, self._namespace, self._owner)
            weakref.finalize(self, _at_exit, self._api, self._namespace, self._made, self._pid, self._pools)
        if self.creator:
            self.remove_leftovers()  # once per driver: the pods of drivers that are gone
        return maker

    def _slots_key(self, maker: PodMaker) -> str:
        return hashlib.sha256(f"{maker.namespace}/{maker.owner.id}".encode()).hexdigest()[:16]

    def _start_retrying(self, maker: PodMaker) -> str:
        deadline = time.monotonic() + self.settings.startup_timeout_s
        errors: list[str] = []
        for attempt in range(self.max_retries + 1):
            name = ""
            try:
                name = maker.start("taken")
                self._remember(name)
                maker.wait_running(name, deadline)
                return name
            except SandboxUnavailable as e:
                if name:
                    self._delete(name)
                errors.append(str(e))
                if time.monotonic() >= deadline or "did not start within" in str(e):
                    break
                time.sleep(min(0.5 * 2**attempt, 5.0))
        raise SandboxUnavailable(f"no sandbox pod could be started ({len(errors)} attempt(s)): {errors[-1]}")

    def _remember(self, name: str) -> None:
        with self._lock:
            self._made.add(name)

    def _delete(self, name: str) -> None:
        with self._lock:
            self._made.discard(name)
        assert self._maker is not None
        self._maker.delete(name)

    def open_exec(self, pod: str) -> ExecStream:
        """An exec of the launcher's bootstrap into `pod` (what another transport would replace)."""
        return WebSocketExec(self._exec_api, self._namespace, pod, CONTAINER, command(self.settings.python))


def _at_exit(api: Any, namespace: str, made: set[str], pid: int, pools: list[PoolKeeper]) -> None:
    """When the placement goes (or the process that connected exits): its own pods, and the pool's
    warm pods if it kept the pool."""
    delete_all(api, namespace, made, pid)
    if os.getpid() == pid:
        for pool in list(pools):
            pool.stop()
            pool.remove_warm()


class PodWorkspace:
    """One episode's pod: its /work, its calls, one at a time; deleted at `close`."""

    def __init__(self, sandboxes: PodSandboxes, pod: str, label: str, slot: Slot):
        self.sandboxes, self.pod, self.label, self._slot = sandboxes, pod, label, slot
        self.calls = 0
        self.lost = ""  # why this workspace's pod can no longer be used
        self._lock = threading.Lock()  # one call (or write) at a time
        self._closing = threading.Lock()
        self._closed = False

    def __enter__(self) -> "PodWorkspace":
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Delete the pod now, a call still running in it included (that call then raises
        `SandboxUnavailable`), and free its slot."""
        with self._closing:
            if self._closed:
                return
            self._closed = True
        self.sandboxes._delete(self.pod)
        self._slot.release()

    def write(self, name: str, data: bytes, mode: int = 0o644) -> None:
        """A file in the pod's /work (`name`: plain names only, never `..`); an `OSError` when the pod
        refuses it (its folder full, say), `SandboxUnavailable` when the pod cannot be reached."""
        check_file_name(name)
        s = self.sandboxes.settings
        with self._lock:
            done = self._attempts(
                f"write {name}",
                lambda: boot_input(framed_write(name, len(data), mode), data),
                64,
                lambda: time.monotonic() + s.exec_grace_s + len(data) / (1 << 20),
            )
        if done.broken or (done.ending is None and done.status is None):
            self._lose(f"writing {name} broke off: {done.what()}")
        if (done.ending or {}).get("written") != len(data):
            raise OSError(f"cannot write {name} in sandbox pod {self.pod}: {done.what()}")

    def run(self, program: Program, limits: SandboxLimits) -> Call:
        """Run `program` to its end in this episode's pod, within `limits`."""
        s = self.sandboxes.settings
        s.check_limits(limits)
        argv = [s.python, "-c", program.python] if program.python is not None else list(program.argv)
        started = time.monotonic()
        with self._lock:
            done = self._attempts(
                "run a program",
                lambda: boot_input(framed_run(argv, limits, len(program.stdin)), program.stdin),
                limits.output_bytes,
                lambda: time.monotonic() + limits.wall_s + s.exec_grace_s,
            )
            seconds = time.monotonic() - started
            ending = next((x for x in done.report if "exit" in x or "signal" in x), None)
            stopped = done.stopped
            if done.broken or (ending is None and done.status is None and stopped is None):
                self._cleanup()
                self._lose(f"the exec of a program broke off: {done.what()}")
            if stopped is not None:
                self._cleanup()  # the driver stopped it: the launcher did not get to
            elif ending is None:
                stopped = "killed"  # the launcher itself was killed (the program can: same user)
                self._cleanup()
            elif ending.get("left", 0) != 0:
                self._lose(f"{ending['left']} process(es) of a call were still alive 2 s after SIGKILL")
            self.calls += 1
        folder_bytes = (ending or {}).get("folder_bytes", 0)
        return call_record(
            done.out, done.err, done.report, stopped or (ending or {}).get("stopped"), limits, seconds, lambda: folder_bytes
        )

    def _attempts(self, what: str, stdin, output_bytes: int, deadline) -> Exchange:
        """One exchange, tried again while it failed before the launcher started."""
        if self._closed or self.lost:
            raise SandboxUnavailable(f"sandbox pod {self.pod} is {'closed' if self._closed else 'lost'}: {self.lost}")
        errors: list[str] = []
        for attempt in range(self.sandboxes.max_retries + 1):
            try:
                done = exchange(lambda: self.sandboxes.open_exec(self.pod), stdin(), output_bytes, deadline())
            except Exception as e:  # the exec could not be opened: nothing ran
                if not_found(e):
                    self._lose(f"it is gone ({exec_failure(e)})")
                errors.append(exec_failure(e))
            else:
                if done.started:
                    return done
                errors.append(done.what())
            time.sleep(min(0.2 * 2**attempt, 2.0))
        self._lose(f"could not {what} after {len(errors)} attempt(s): {errors[-1][:2000]}")
        raise AssertionError("unreachable")

    def _cleanup(self) -> None:
        """The launcher's cleanup, alone: every process of the sandbox's user but the init gone."""
        grace = self.sandboxes.settings.exec_grace_s
        try:
            done = exchange(lambda: self.sandboxes.open_exec(self.pod), boot_input(CLEANUP), 64, time.monotonic() + grace)
        except Exception as e:
            self._lose(f"the cleanup after a call could not run: {type(e).__name__}: {e}")
        if (done.ending or {}).get("left") != 0:
            stuck = (done.ending or {}).get("stuck", [])
            self._lose(f"the cleanup after a call did not confirm that its processes are gone ({stuck}): {done.what()}")

    def _lose(self, why: str) -> None:
        """This pod can no longer be trusted: delete it, and fail this call and every later one."""
        self.lost = why
        self.sandboxes._delete(self.pod)
        raise SandboxUnavailable(f"sandbox pod {self.pod} (episode {self.label}): {why}")


if TYPE_CHECKING:  # mypy checks that this placement is one (`dagster_rl.sandbox.placement`)
    _placement: type[Sandboxes] = PodSandboxes
    _workspace: type[Workspace] = PodWorkspace
