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
it); `activeDeadlineSeconds` ends any pod past `active_deadline_s`. The first `open` of each
process also deletes the sandbox pods that have ended, and those whose owner pod is gone.
"""

import logging
import secrets
import threading
import time
import weakref
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from dagster_rl.sandbox.calls import Call, Program, SandboxUnavailable
from dagster_rl.sandbox.launcher import CLEANUP, boot_input, framed_run, framed_write
from dagster_rl.sandbox.limits import SandboxLimits
from dagster_rl.sandbox.outcomes import call_record, check_file_name
from dagster_rl.sandbox.pod_api import (
    OWNER_PROCESS,
    ApiFailure,
    api_call,
    clients,
    current_namespace,
    delete_all,
    delete_pod,
    describe_waiting,
    exec_failure,
    find_owner,
    is_running,
    not_found,
    owner_process,
    remove_leftovers,
)
from dagster_rl.sandbox.pod_exec import Exchange, ExecStream, WebSocketExec, command, exchange
from dagster_rl.sandbox.pod_manifest import (
    CONTAINER,
    Owner,
    PodSandboxSettings,
    quantity,
    sandbox_pod,
)

log = logging.getLogger(__name__)


@dataclass
class _Pod:
    name: str
    started: float  # time.monotonic() when it was running


class PodSandboxes:
    """Sandboxes in pods of the sandbox tier. At most `max_concurrency` episodes hold a pod at once
    (`open` waits up to `slot_timeout_s` for one to close), and `pool_size` more wait warm.
    `max_retries`: attempts again what failed before anything ran (a pod that would not start, an
    exec the API refused). `api`: a CoreV1Api (default: in-cluster, else the kubeconfig);
    `open_exec`: how execs are opened (default: the API server's websocket); `owner`: who the pods
    belong to (default: this pod, else this process); `limits`: checked against the pods now."""

    name = "k8s"

    def __init__(
        self,
        settings: PodSandboxSettings,
        max_concurrency: int = 8,
        max_retries: int = 2,
        *,
        api: Any = None,
        exec_api: Any = None,
        owner: Owner | None = None,
        limits: SandboxLimits | None = None,
    ):
        if max_concurrency < 1 or max_retries < 0:
            raise ValueError("max_concurrency is at least 1 and max_retries at least 0")
        if limits is not None:
            settings.check_limits(limits)
        self.settings, self.max_concurrency, self.max_retries = settings, max_concurrency, max_retries
        self._api, self._exec_api, self._owner = api, exec_api, owner
        self._namespace = ""
        self._slots = threading.BoundedSemaphore(max_concurrency)
        self._lock = threading.Lock()
        self._warm: list[_Pod] = []
        self._starting = 0
        self._made: set[str] = set()  # pods this object made and has not deleted
        self._closed = False
        self._checked = False
        self._swept = False
        self._refill_after = 0.0
        self._finalizer: weakref.finalize | None = None

    # ---- the placement ----------------------------------------------------------------------
    def check(self) -> None:
        """A pod made, a program run in it; `SandboxUnavailable` naming what to fix otherwise."""
        if self._checked:
            return
        if not self.settings.image:
            raise SandboxUnavailable("the k8s sandbox placement needs an image with a python3: set the sandbox tier's image")
        cores = quantity(self.settings.cpu_limit, "cores") if self.settings.cpu_limit else 1.0
        limits = SandboxLimits(cpu_s=2, wall_s=max(20.0, 4 / cores), memory_mb=min(256, self.settings.memory_for_programs_mib()))
        with self.open("check") as ws:
            call = ws.run(Program(python="print(6 * 7)"), limits)
        if (call.outcome, call.stdout) != ("exit", "42\n"):
            raise SandboxUnavailable(f"a sandbox pod was made but a program printing 42 gave {call!r}")
        self._checked = True

    def open(self, label: str) -> "PodWorkspace":
        """This episode's pod: a warm one of the pool, or a new one (`SandboxUnavailable` when none
        runs within `startup_timeout_s`, or no slot frees within `slot_timeout_s`)."""
        self._connect()
        if not self._slots.acquire(timeout=self.settings.slot_timeout_s):
            raise SandboxUnavailable(
                f"all {self.max_concurrency} sandbox pods stayed in use for {self.settings.slot_timeout_s:g} s"
            )
        try:
            pod = self._take() or self._start_retrying()
        except BaseException:
            self._slots.release()
            raise
        self._refill()
        log.debug("sandbox pod %s for episode %s", pod.name, label)
        return PodWorkspace(self, pod, label)

    def close(self) -> None:
        """Delete the pool's pods (the workspaces still open delete theirs when they close)."""
        with self._lock:
            self._closed = True
            warm, self._warm = self._warm, []
        for pod in warm:
            self._delete(pod.name)

    def __enter__(self) -> "PodSandboxes":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the cluster ------------------------------------------------------------------------
    def _connect(self) -> None:
        if self._finalizer is not None:
            return
        with self._lock:
            if self._finalizer is not None:
                return
            if self._api is None or self._exec_api is None:
                self._api, self._exec_api = clients(self._api, self._exec_api)
            self._namespace = self.settings.namespace or current_namespace()
            if self._owner is None:
                self._owner = find_owner(self._api, self._namespace)
            # pods still made at exit (a run that never closed its tier) are deleted then
            self._finalizer = weakref.finalize(self, delete_all, self._api, self._namespace, self._made)
        if not self._swept:
            self._swept = True
            self.remove_leftovers()

    def _start_retrying(self) -> _Pod:
        deadline = time.monotonic() + self.settings.startup_timeout_s
        errors: list[str] = []
        for attempt in range(self.max_retries + 1):
            try:
                return self._start(deadline)
            except SandboxUnavailable as e:
                errors.append(str(e))
                if time.monotonic() >= deadline or "did not start within" in str(e):
                    break
                time.sleep(min(0.5 * 2**attempt, 5.0))
        raise SandboxUnavailable(f"no sandbox pod could be started ({len(errors)} attempt(s)): {errors[-1]}")

    def _start(self, deadline: float) -> _Pod:
        assert self._owner is not None
        name = f"drl-sandbox-{secrets.token_hex(6)}"
        body = sandbox_pod(self.settings, name, self._namespace, self._owner)
        body["metadata"].setdefault("annotations", {})[OWNER_PROCESS] = owner_process()
        with self._lock:
            self._made.add(name)
        try:
            api_call(
                f"create sandbox pod {self._namespace}/{name}", lambda: self._api.create_namespaced_pod(self._namespace, body)
            )
            self._wait_running(name, deadline)
        except BaseException as e:
            self._delete(name)
            if isinstance(e, ApiFailure):
                raise SandboxUnavailable(str(e)) from None
            raise
        return _Pod(name, time.monotonic())

    def _wait_running(self, name: str, deadline: float) -> None:
        last = "not read yet"
        while True:
            pod = api_call(f"read sandbox pod {name}", lambda: self._api.read_namespaced_pod(name, self._namespace))
            if is_running(pod):
                return
            last, fatal = describe_waiting(pod)
            if fatal:
                raise SandboxUnavailable(f"sandbox pod {self._namespace}/{name} cannot start: {last}")
            if time.monotonic() > deadline:
                raise SandboxUnavailable(
                    f"sandbox pod {self._namespace}/{name} did not start within {self.settings.startup_timeout_s:g} s: {last}"
                )
            time.sleep(self.settings.poll_interval_s)

    def _take(self) -> _Pod | None:
        """A warm pod, still running and young enough for an episode; None when there is none."""
        while True:
            with self._lock:
                if not self._warm:
                    return None
                pod = self._warm.pop(0)
            if time.monotonic() - pod.started < self.settings.active_deadline_s / 2:
                try:
                    if is_running(self._api.read_namespaced_pod(pod.name, self._namespace)):
                        return pod
                except Exception as e:  # gone, or unreadable: not this one
                    log.debug("warm sandbox pod %s unusable: %r", pod.name, e)
            self._delete(pod.name)

    def _refill(self) -> None:
        """Start pods in the background until `pool_size` wait warm (after a failure, not for 30 s)."""
        with self._lock:
            need = self.settings.pool_size - len(self._warm) - self._starting
            if self._closed or need <= 0 or time.monotonic() < self._refill_after:
                return
            self._starting += need
        for _ in range(need):
            threading.Thread(target=self._warm_one, name="sandbox-pool", daemon=True).start()

    def _warm_one(self) -> None:
        try:
            pod = self._start(time.monotonic() + self.settings.startup_timeout_s)
        except Exception as e:
            log.warning("the sandbox pool could not start a pod (episodes start theirs cold meanwhile): %s", e)
            with self._lock:
                self._starting -= 1
                self._refill_after = time.monotonic() + 30.0
            return
        with self._lock:
            self._starting -= 1
            closed = self._closed
            if not closed:
                self._warm.append(pod)
        if closed:
            self._delete(pod.name)

    def _delete(self, name: str) -> None:
        with self._lock:
            self._made.discard(name)
        delete_pod(self._api, self._namespace, name)

    def _release(self, pod: _Pod) -> None:
        self._delete(pod.name)
        self._slots.release()

    def open_exec(self, pod: str) -> ExecStream:
        """An exec of the launcher's bootstrap into `pod` (what tests and other transports replace)."""
        return WebSocketExec(self._exec_api, self._namespace, pod, CONTAINER, command(self.settings.python))

    # ---- leftovers ----------------------------------------------------------------------------
    def remove_leftovers(self) -> list[str]:
        """Delete the sandbox pods of this namespace that no live driver owns (`pod_api.remove_leftovers`)."""
        return remove_leftovers(self._api, self._namespace, keep=set(self._made))


class PodWorkspace:
    """One episode's pod: its /work, its calls, one at a time; deleted at `close`."""

    def __init__(self, sandboxes: PodSandboxes, pod: _Pod, label: str):
        self.sandboxes, self.pod, self.label = sandboxes, pod, label
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
        self.sandboxes._release(self.pod)

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
            raise OSError(f"cannot write {name} in sandbox pod {self.pod.name}: {done.what()}")

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
            raise SandboxUnavailable(f"sandbox pod {self.pod.name} is {'closed' if self._closed else 'lost'}: {self.lost}")
        errors: list[str] = []
        for attempt in range(self.sandboxes.max_retries + 1):
            try:
                done = exchange(lambda: self.sandboxes.open_exec(self.pod.name), stdin(), output_bytes, deadline())
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
            done = exchange(lambda: self.sandboxes.open_exec(self.pod.name), boot_input(CLEANUP), 64, time.monotonic() + grace)
        except Exception as e:
            self._lose(f"the cleanup after a call could not run: {type(e).__name__}: {e}")
        if (done.ending or {}).get("left") != 0:
            self._lose(f"the cleanup after a call did not confirm that its processes are gone: {done.what()}")

    def _lose(self, why: str) -> None:
        """This pod can no longer be trusted: delete it, and fail this call and every later one."""
        self.lost = why
        self.sandboxes._delete(self.pod.name)
        raise SandboxUnavailable(f"sandbox pod {self.pod.name} (episode {self.label}): {why}")
