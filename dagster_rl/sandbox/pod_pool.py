"""Sandbox pods as the cluster holds them: started (`PodMaker.start`), taken by one episode
(`PodMaker.claim`), and the pool of warm ones kept full by the driver (`PoolKeeper`).

The pool lives in the cluster, not in a process: a warm pod is a pod of the driver's (its owner
label) labeled `dagster-rl/sandbox-state: warm`. Any process that holds the placement (the driver,
or a trial's process that received it pickled) takes one by a conditional update: a patch to
`taken` that carries the pod's `resourceVersion`, which the API server refuses (409 Conflict) when
another process took it first. So two episodes never share a pod, whichever processes they run in,
and the driver alone refills the pool (`PoolKeeper`, a thread that lists its pods every
`interval_s`, tops the warm ones up to `pool_size`, deletes those too old to serve an episode, and
deletes the taken pods of processes of this host that are gone: a trial's process that was killed).
"""

import logging
import secrets
import threading
import time
from datetime import UTC, datetime
from typing import Any

from dagster_rl.sandbox.calls import SandboxUnavailable
from dagster_rl.sandbox.pod_api import (
    OWNER_PROCESS,
    ApiFailure,
    api_call,
    delete_pod,
    describe_waiting,
    http_status,
    is_running,
    owner_process,
    process_gone,
)
from dagster_rl.sandbox.pod_manifest import OWNER_LABEL, Owner, PodSandboxSettings, sandbox_pod

log = logging.getLogger(__name__)
STATE_LABEL = "dagster-rl/sandbox-state"  # warm: started for the pool, no episode's yet; taken: one episode's
BACKOFF_S = 30.0  # after a warm pod that cannot start, the pool waits this long before starting more


class PodMaker:
    """Starts, takes and deletes the sandbox pods of one owner in one namespace."""

    def __init__(self, api: Any, settings: PodSandboxSettings, namespace: str, owner: Owner):
        self.api, self.settings, self.namespace, self.owner = api, settings, namespace, owner

    def start(self, state: str) -> str:
        """Create a pod (labeled `state`, annotated with this process); its name."""
        name = f"drl-sandbox-{secrets.token_hex(6)}"
        body = sandbox_pod(self.settings, name, self.namespace, self.owner)
        body["metadata"]["labels"][STATE_LABEL] = state
        body["metadata"].setdefault("annotations", {})[OWNER_PROCESS] = owner_process()
        try:
            api_call(f"create sandbox pod {self.namespace}/{name}", lambda: self.api.create_namespaced_pod(self.namespace, body))
        except ApiFailure as e:
            raise SandboxUnavailable(str(e)) from None
        return name

    def wait_running(self, name: str, deadline: float) -> None:
        """Until the pod runs: `SandboxUnavailable` when it never will, or not by `deadline`."""
        while True:
            try:
                pod = api_call(f"read sandbox pod {name}", lambda: self.api.read_namespaced_pod(name, self.namespace))
            except ApiFailure as e:
                raise SandboxUnavailable(str(e)) from None
            if is_running(pod):
                return
            last, fatal = describe_waiting(pod)
            if fatal:
                raise SandboxUnavailable(f"sandbox pod {self.namespace}/{name} cannot start: {last}")
            if time.monotonic() > deadline:
                raise SandboxUnavailable(
                    f"sandbox pod {self.namespace}/{name} did not start within {self.settings.startup_timeout_s:g} s: {last}"
                )
            time.sleep(self.settings.poll_interval_s)

    def claim(self) -> str | None:
        """A warm pod of this owner that runs and is young enough for an episode, taken for this
        process; None when there is none (or none could be read)."""
        try:
            pods = self.api.list_namespaced_pod(self.namespace, label_selector=self._selector("warm")).items
        except Exception as e:
            log.warning("could not list the warm sandbox pods (this episode starts its own): %s", e)
            return None
        for pod in sorted(pods, key=lambda p: p.metadata.name):
            if not is_running(pod) or age_s(pod) > self.settings.active_deadline_s / 2:
                continue
            body = {
                "metadata": {
                    "resourceVersion": pod.metadata.resource_version,  # a precondition: 409 if taken meanwhile
                    "labels": {STATE_LABEL: "taken"},
                    "annotations": {OWNER_PROCESS: owner_process()},
                }
            }
            try:
                self.api.patch_namespaced_pod(pod.metadata.name, self.namespace, body)
            except Exception as e:
                if http_status(e) != 409:
                    log.warning("could not take warm sandbox pod %s: %s", pod.metadata.name, e)
                continue
            return pod.metadata.name
        return None

    def pods(self) -> list[Any]:
        return self.api.list_namespaced_pod(self.namespace, label_selector=f"{OWNER_LABEL}={self.owner.id}").items

    def delete(self, name: str) -> None:
        delete_pod(self.api, self.namespace, name)

    def _selector(self, state: str) -> str:
        return f"{OWNER_LABEL}={self.owner.id},{STATE_LABEL}={state}"


class PoolKeeper:
    """The driver's thread that keeps `pool_size` warm pods (see the module); `wake` after a take."""

    def __init__(self, maker: PodMaker, size: int, interval_s: float = 2.0):
        self.maker, self.size, self.interval_s = maker, size, interval_s
        self._stop, self._wake = threading.Event(), threading.Event()
        self._paused_until = 0.0
        self.thread = threading.Thread(target=self._run, name="sandbox-pool", daemon=True)
        self.thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self.thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception as e:  # the pool is an optimisation: episodes start their own pods meanwhile
                log.warning("the sandbox pool could not be refilled: %s", e)
            self._wake.wait(self.interval_s)
            self._wake.clear()

    def tick(self) -> None:
        warm = 0
        for pod in self.maker.pods():
            labels, notes = pod.metadata.labels or {}, pod.metadata.annotations or {}
            state, phase = labels.get(STATE_LABEL), pod.status.phase if pod.status else None
            if state == "taken":
                if process_gone(notes.get(OWNER_PROCESS, "")):  # a trial's process killed with its pod open
                    self.maker.delete(pod.metadata.name)
                continue
            why, fatal = describe_waiting(pod) if not is_running(pod) else ("", False)
            if fatal or phase in ("Succeeded", "Failed") or age_s(pod) > self.maker.settings.active_deadline_s / 2:
                self.maker.delete(pod.metadata.name)
                if fatal or phase == "Failed":
                    log.warning("a warm sandbox pod could not start (%s); the pool waits %g s", why, BACKOFF_S)
                    self._paused_until = time.monotonic() + BACKOFF_S
                continue
            warm += 1
        if self._stop.is_set() or time.monotonic() < self._paused_until:
            return
        for _ in range(self.size - warm):
            self.maker.start("warm")

    def remove_warm(self) -> None:
        """Delete this owner's warm pods (the driver is done with the pool)."""
        for pod in self.maker.pods():
            if (pod.metadata.labels or {}).get(STATE_LABEL) == "warm":
                self.maker.delete(pod.metadata.name)


def age_s(pod: Any) -> float:
    """Seconds since the pod started (since it was created, before it starts)."""
    started = (pod.status.start_time if pod.status is not None else None) or pod.metadata.creation_timestamp
    if started is None:
        return 0.0
    if isinstance(started, str):
        started = datetime.fromisoformat(started.replace("Z", "+00:00"))
    return (datetime.now(UTC) - started).total_seconds()
