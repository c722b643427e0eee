"""The FAKE cluster's standalone pods (the sandbox tier's, created one by one, not by a Job) and its
pods/exec endpoint, for `tests.fake_kubernetes.FakeKubernetes`.

- a pod's container is a process tree in namespaces of its own, as a container runtime makes it:
  bubblewrap gives it its own PID namespace (its command is PID 1, `--as-pid-1`), mount, IPC, UTS
  and network namespaces (only a loopback: it stands for the pod's deny-all NetworkPolicy), the
  host's root read-only (`readOnlyRootFilesystem`, the host standing for the image), each emptyDir
  at its mount path (`medium: Memory`: a tmpfs of its sizeLimit; else a folder of this machine),
  the pod's uid and gid (`runAsUser`, `runAsGroup`) with no capabilities and no-new-privs, its
  `workingDir`, `PATH` and `HOSTNAME`. Needs root (what a node's runtime is).
- exec (into the container's namespaces, as the same user, waited for as a runtime's shim waits:
  `ENTER`) behind a real websocket, as
  the API server serves `pods/{name}/exec` (channel protocol v5, falling back to v4: stdin 0, stdout
  1, stderr 2, the status on 3, close 255). As on a real node, a client that disconnects does not
  stop the process it started.
- admission: the pod is validated (strict, 1.33); a `runtimeClassName` that names no RuntimeClass
  is refused as the RuntimeClass admission plugin refuses it (403).
- the kubelet's clock: `activeDeadlineSeconds` fails the pod (reason DeadlineExceeded).

Hooks: `unschedulable` (pods stay Pending, not scheduled: "Insufficient cpu"), `image_errors`
{image: waiting reason} (a container that never starts), `runtime_classes` (those that exist),
`execs` (every exec's command, in order).

Not played: cgroups (the pod's memory and CPU limits are not enforced here), a user namespace per
pod, a real network policy.
"""

import base64
import hashlib
import json
import os
import shutil
import signal
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from kubernetes.client import (
    ApiClient,
    ApiException,
    Configuration,
    CoreV1Api,
    V1Container,
    V1ContainerState,
    V1ContainerStateRunning,
    V1ContainerStateTerminated,
    V1ContainerStateWaiting,
    V1ContainerStatus,
    V1ObjectMeta,
    V1OwnerReference,
    V1Pod,
    V1PodCondition,
    V1PodSpec,
    V1PodStatus,
)

from dagster_rl.runtime.lifetime import alive, identity

PATH = "/usr/local/bin:/usr/bin:/bin"
# The runtime's side of an exec: join the container's namespaces (PID 1's, as this machine sees it),
# fork the command into them, and wait for it as a container runtime's shim does: reaping it, and
# never stopping itself when the command is stopped (as nsenter would, which holds its zombie).
ENTER = """import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
pid, workdir, command = sys.argv[1], sys.argv[2], sys.argv[4:]
for ns in ("ipc", "uts", "net", "pid", "mnt"):
    fd = os.open(f"/proc/{pid}/ns/{ns}", os.O_RDONLY)
    if libc.setns(fd, 0) != 0:
        raise SystemExit(f"setns {ns}: {os.strerror(ctypes.get_errno())}")
    os.close(fd)
os.chdir(workdir)
child = os.fork()
if child == 0:
    os.execvp(command[0], command)
while True:
    _, status = os.waitpid(child, 0)
    if os.WIFEXITED(status) or os.WIFSIGNALED(status):
        break
sys.exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
"""
GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


def quantity_bytes(text: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "k": 10**3, "M": 10**6, "G": 10**9}
    for suffix, scale in units.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * scale)
    return int(text)


@dataclass
class Container:
    name: str
    namespace: str
    manifest: dict[str, Any]
    uid: str
    folder: Path  # this pod's files on this machine (disk-backed emptyDirs)
    proc: subprocess.Popen | None = None
    pid: int | None = None  # PID 1 of the container, as this machine sees it
    init: str = ""  # its identity (pid and start time): a reused pid is not it
    phase: str = "Pending"
    reason: str = ""
    exit_code: int | None = None
    log: list[str] = field(default_factory=list)
    created: float = field(default_factory=time.monotonic)
    created_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    started_at: datetime | None = None
    version: int = 1  # metadata.resourceVersion
    execs: list[subprocess.Popen] = field(default_factory=list)

    def model(self, waiting: str, unschedulable: bool) -> V1Pod:
        spec = self.manifest["spec"]
        container = spec["containers"][0]
        if self.phase == "Running":
            state = V1ContainerState(running=V1ContainerStateRunning(started_at=datetime.now(UTC)))
        elif self.exit_code is not None:
            state = V1ContainerState(
                terminated=V1ContainerStateTerminated(exit_code=self.exit_code, reason=self.reason or "Error")
            )
        else:
            state = V1ContainerState(waiting=V1ContainerStateWaiting(reason=waiting or "ContainerCreating", message=None))
        conditions = None
        if unschedulable and self.phase == "Pending":
            message = "0/1 nodes are available: 1 Insufficient cpu. preemption: 0/1 nodes are available."
            conditions = [V1PodCondition(type="PodScheduled", status="False", reason="Unschedulable", message=message)]
        statuses = None if conditions else [
            V1ContainerStatus(name=container["name"], image=container["image"], image_id="fake", ready=self.phase == "Running",
                              restart_count=0, state=state)
        ]  # fmt: skip
        meta = self.manifest["metadata"]
        owners = [V1OwnerReference(**{_snake(k): v for k, v in o.items()}) for o in meta.get("ownerReferences", [])] or None
        return V1Pod(
            metadata=V1ObjectMeta(name=self.name, namespace=self.namespace, uid=self.uid, labels=dict(meta.get("labels", {})),
                                  annotations=dict(meta.get("annotations", {})) or None, owner_references=owners,
                                  resource_version=str(self.version), creation_timestamp=self.created_at),
            spec=V1PodSpec(containers=[V1Container(name=container["name"], image=container["image"])]),
            status=V1PodStatus(phase=self.phase, reason=self.reason or None, container_statuses=statuses, conditions=conditions,
                               start_time=self.started_at),
        )  # fmt: skip


def container_dir(pod: "Container") -> str:
    return pod.manifest["spec"]["containers"][0].get("workingDir", "/")


def _snake(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name)


class StandalonePods:
    """The kubelet and runtime of the fake's standalone pods (see the module)."""

    def __init__(self, validate, authorize):
        self.validate, self.authorize = validate, authorize
        self.api: Any = None  # the fake API server's CoreV1Api side (RBAC enforced): what REST calls over HTTP reach
        self.pods: dict[tuple[str, str], Container] = {}
        self.deleted: list[Container] = []
        self.runtime_classes = {"gvisor"}
        self.unschedulable = False
        self.image_errors: dict[str, str] = {}
        self.execs: list[list[str]] = []
        self._lock = threading.RLock()
        self._server: ExecServer | None = None
        self._closed = threading.Event()
        threading.Thread(target=self._clock, name="fake-kubelet", daemon=True).start()

    # ---- the API server's part ---------------------------------------------------------------
    def create(self, namespace: str, body: dict) -> V1Pod:
        self.validate(body)
        spec, name = body["spec"], body["metadata"]["name"]
        runtime = spec.get("runtimeClassName")
        if runtime and runtime not in self.runtime_classes:
            error = ApiException(status=403, reason="Forbidden")
            error.body = json.dumps({"kind": "Status", "status": "Failure", "reason": "Forbidden", "code": 403,
                                     "message": f'pods "{name}" is forbidden: pod rejected: RuntimeClass "{runtime}" not found'})  # fmt: skip
            raise error
        with self._lock:
            if (namespace, name) in self.pods:
                raise ApiException(status=409, reason="AlreadyExists")
            pod = Container(name, namespace, body, str(_uuid()), Path(tempfile.mkdtemp(prefix=f"fake-pod-{name}-")))
            self.pods[(namespace, name)] = pod
        image = spec["containers"][0]["image"]
        if not self.unschedulable and image not in self.image_errors:
            self._start(pod)
        return pod.model(self.image_errors.get(image, ""), self.unschedulable)

    def read(self, namespace: str, name: str) -> V1Pod:
        with self._lock:
            pod = self.pods.get((namespace, name))
        if pod is None:
            raise ApiException(status=404, reason="NotFound")
        return pod.model(self.image_errors.get(pod.manifest["spec"]["containers"][0]["image"], ""), self.unschedulable)

    def patch(self, namespace: str, name: str, body: dict) -> V1Pod:
        """A merge of labels and annotations; `metadata.resourceVersion`, when given, is a precondition
        (409 Conflict when the pod changed since), as the API server treats it."""
        meta = body.get("metadata", {})
        with self._lock:
            pod = self.pods.get((namespace, name))
            if pod is None:
                raise ApiException(status=404, reason="NotFound")
            if "resourceVersion" in meta and meta["resourceVersion"] != str(pod.version):
                error = ApiException(status=409, reason="Conflict")
                error.body = json.dumps({"kind": "Status", "status": "Failure", "reason": "Conflict", "code": 409,
                                         "message": f'Operation cannot be fulfilled on pods "{name}": the object has been modified'})  # fmt: skip
                raise error
            for key in ("labels", "annotations"):
                pod.manifest["metadata"].setdefault(key, {}).update(meta.get(key, {}))
            self.validate(pod.manifest)
            pod.version += 1
        return self.read(namespace, name)

    def in_namespace(self, namespace: str) -> list[Container]:
        with self._lock:
            return [p for (ns, _), p in self.pods.items() if ns == namespace]

    def delete(self, namespace: str, name: str) -> bool:
        with self._lock:
            pod = self.pods.pop((namespace, name), None)
        if pod is None:
            return False
        self._kill(pod)
        self.deleted.append(pod)
        return True

    def running(self) -> list[str]:
        """Pods whose container (or an exec into it) still has a process on this machine."""
        with self._lock:
            pods = list(self.pods.values()) + self.deleted
        return [p.name for p in pods if any(x.poll() is None for x in [*([p.proc] if p.proc else []), *p.execs])]

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            pods = list(self.pods.values())
            self.pods.clear()
        for pod in pods:
            self._kill(pod)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def exec_url(self) -> str:
        """Where the fake API server listens for pods over HTTP (REST and exec): a Configuration's `host`."""
        with self._lock:
            if self._server is None:
                self._server = ExecServer(("127.0.0.1", 0), _ExecHandler)
                self._server.pods = self
                threading.Thread(target=self._server.serve_forever, name="fake-exec-server", daemon=True).start()
            return f"http://127.0.0.1:{self._server.server_address[1]}"

    # ---- the node's part ---------------------------------------------------------------------
    def _start(self, pod: Container) -> None:
        spec = pod.manifest["spec"]
        container = spec["containers"][0]
        security = {**spec.get("securityContext", {}), **container.get("securityContext", {})}
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        info_r, info_w = os.pipe()
        args = ["bwrap", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-net", "--as-pid-1",
                "--ro-bind" if security.get("readOnlyRootFilesystem") else "--bind", "/", "/", "--proc", "/proc", "--dev", "/dev"]  # fmt: skip
        for mount in container.get("volumeMounts", []):
            empty = volumes[mount["name"]]["emptyDir"]
            if empty.get("medium") == "Memory":
                args += ["--perms", "0777", "--size", str(quantity_bytes(empty["sizeLimit"])), "--tmpfs", mount["mountPath"]]
            else:
                host = pod.folder / mount["name"]
                host.mkdir(mode=0o777)
                host.chmod(0o777)
                args += ["--bind", str(host), mount["mountPath"]]
        args += ["--chdir", container.get("workingDir", "/"), "--hostname", pod.name, "--clearenv", "--setenv", "PATH", PATH,
                 "--setenv", "HOSTNAME", pod.name, "--info-fd", str(info_w), "--", *self._user(security),
                 *container.get("command", []), *container.get("args", [])]  # fmt: skip
        pod.proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, pass_fds=(info_w,), start_new_session=True
        )
        os.close(info_w)
        with os.fdopen(info_r) as info:
            text = info.read(4096)
        try:
            pod.pid = json.loads(text[: text.index("}") + 1])["child-pid"]
            pod.init = identity(pod.pid)
            pod.phase, pod.started_at = "Running", datetime.now(UTC)
            pod.version += 1
        except ValueError:
            pod.phase, pod.reason = "Failed", "StartError"
        threading.Thread(target=self._collect, args=(pod,), daemon=True).start()

    @staticmethod
    def _user(security: dict) -> list[str]:
        uid, gid = security.get("runAsUser", 0), security.get("runAsGroup", 0)
        if security.get("runAsNonRoot") and uid == 0:
            raise ValueError("the fake runs no root container with runAsNonRoot")
        user = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]
        if "ALL" in security.get("capabilities", {}).get("drop", []):
            user += ["--inh-caps=-all", "--bounding-set=-all"]
        if security.get("allowPrivilegeEscalation") is False:
            user += ["--no-new-privs"]
        return user

    def exec(self, pod: Container, command: list[str]) -> subprocess.Popen:
        spec = pod.manifest["spec"]
        security = {**spec.get("securityContext", {}), **spec["containers"][0].get("securityContext", {})}
        self.execs.append(command)
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", ENTER, str(pod.pid), container_dir(pod), "--", *self._user(security), *command],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
            env={"PATH": PATH, "HOSTNAME": pod.name},
        )  # fmt: skip
        pod.execs.append(proc)
        return proc

    def _collect(self, pod: Container) -> None:
        assert pod.proc is not None and pod.proc.stdout is not None
        for raw in pod.proc.stdout:
            pod.log.append(raw.decode(errors="replace").rstrip())
        code = pod.proc.wait()
        with self._lock:
            if pod.phase == "Running":
                pod.exit_code = code if code >= 0 else 128 - code
                pod.phase = "Succeeded" if code == 0 else "Failed"

    def _clock(self) -> None:
        while not self._closed.wait(0.2):
            with self._lock:
                pods = list(self.pods.values())
            for pod in pods:
                deadline = pod.manifest["spec"].get("activeDeadlineSeconds")
                if deadline and pod.phase in ("Pending", "Running") and time.monotonic() - pod.created > deadline:
                    pod.phase, pod.reason = "Failed", "DeadlineExceeded"
                    self._kill(pod)

    def _kill(self, pod: Container) -> None:
        """SIGKILL the container's PID 1 (the kernel then kills every process of its PID namespace: the
        execs' too), then bubblewrap and the execs' runtime side. PID 1 must be killed itself: it changed
        its uid, which cleared any parent-death signal (and bubblewrap's `--die-with-parent` is not
        used: it follows the thread that started the pod, and a pool's threads end)."""
        if pod.pid is not None and alive(pod.init):
            try:
                os.kill(pod.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in [*pod.execs, *([pod.proc] if pod.proc else [])]:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        shutil.rmtree(pod.folder, ignore_errors=True)


def _uuid() -> str:
    import uuid

    return str(uuid.uuid4())


class ExecServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    pods: StandalonePods


class _ExecHandler(socketserver.StreamRequestHandler):
    """GET /api/v1/namespaces/<ns>/pods/<name>/exec?command=...: a websocket to the command."""

    def handle(self) -> None:
        request = self.rfile.readline().decode()
        if not request:
            return
        headers = {}
        while (line := self.rfile.readline().decode()) not in ("\r\n", "\n", ""):
            key, _, value = line.partition(":")
            headers[key.strip().lower()] = value.strip()
        method = request.split()[0]
        url = urlparse(request.split()[1])
        parts = url.path.strip("/").split("/")  # api v1 namespaces <ns> pods [<name> [exec]]
        if len(parts) < 5 or parts[:3] != ["api", "v1", "namespaces"] or parts[4] != "pods":
            return self._refuse(404, "NotFound", f"no route {url.path}")
        if len(parts) != 7 or parts[-1] != "exec":
            body = json.loads(self.rfile.read(int(headers.get("content-length", 0))) or b"null")
            return self._rest(method, parts[3], parts[5] if len(parts) > 5 else "", parse_qs(url.query), body)
        namespace, name, query = parts[3], parts[5], parse_qs(url.query)
        pods = self.server.pods  # type: ignore[attr-defined]
        denied = pods.authorize(namespace, "", "pods/exec", "create")
        if denied:
            return self._refuse(403, "Forbidden", denied)
        with pods._lock:
            pod = pods.pods.get((namespace, name))
        if pod is None or pod.phase != "Running":
            return self._refuse(
                404 if pod is None else 400, "NotFound" if pod is None else "BadRequest", f"pod {name} is not running"
            )
        offered = [p.strip() for p in headers.get("sec-websocket-protocol", "").split(",")]
        protocol = next(p for p in ("v5.channel.k8s.io", "v4.channel.k8s.io") if p in offered)
        accept = base64.b64encode(hashlib.sha1(headers["sec-websocket-key"].encode() + GUID).digest()).decode()
        self.wfile.write(
            (f"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
             f"Sec-WebSocket-Accept: {accept}\r\nSec-WebSocket-Protocol: {protocol}\r\n\r\n").encode()
        )  # fmt: skip
        self.wfile.flush()
        proc = pods.exec(pod, query.get("command", []))
        self._pump(proc)

    def _rest(self, method: str, namespace: str, name: str, query: dict, body: Any) -> None:
        """The pods' REST calls, through the fake's RBAC-enforcing CoreV1Api side."""
        api = self.server.pods.api  # type: ignore[attr-defined]
        try:
            if method == "POST" and not name:
                result: Any = api.create_namespaced_pod(namespace, body)
            elif method == "GET" and name:
                result = api.read_namespaced_pod(name, namespace)
            elif method == "GET":
                result = api.list_namespaced_pod(namespace, label_selector=query.get("labelSelector", [None])[0])
                result = {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": result.items}
            elif method == "DELETE" and name:
                api.delete_namespaced_pod(name, namespace)
                result = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"}
            elif method == "PATCH" and name:
                result = api.patch_namespaced_pod(name, namespace, body)
            else:
                return self._refuse(405, "MethodNotAllowed", f"{method} {namespace}/{name}")
        except ApiException as e:
            said = json.loads(e.body) if e.body else {"message": str(e.reason)}
            return self._refuse(e.status, str(e.reason), said.get("message", ""))
        data = json.dumps(ApiClient().sanitize_for_serialization(result)).encode()
        code = 201 if method == "POST" else 200
        self.wfile.write(
            f"HTTP/1.1 {code} OK\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
        )
        self.wfile.write(data)

    def _refuse(self, code: int, reason: str, message: str) -> None:
        body = json.dumps({"kind": "Status", "status": "Failure", "reason": reason, "code": code, "message": message}).encode()
        self.wfile.write(
            f"HTTP/1.1 {code} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        )
        self.wfile.write(body)

    def _pump(self, proc: subprocess.Popen) -> None:
        send_lock = threading.Lock()
        gone = threading.Event()

        def send(opcode: int, payload: bytes) -> None:
            n = len(payload)
            head = bytes([0x80 | opcode, n]) if n < 126 else (
                bytes([0x80 | opcode, 126]) + n.to_bytes(2, "big") if n < 65536 else bytes([0x80 | opcode, 127]) + n.to_bytes(8, "big")
            )  # fmt: skip
            with send_lock:
                if not gone.is_set():
                    try:
                        self.connection.sendall(head + payload)
                    except OSError:
                        gone.set()

        def forward(stream, channel: int) -> None:
            for chunk in iter(lambda: os.read(stream.fileno(), 65536), b""):
                send(0x2, bytes([channel]) + chunk)

        pumps = [threading.Thread(target=forward, args=(s, c), daemon=True) for s, c in ((proc.stdout, 1), (proc.stderr, 2))]
        for pump in pumps:
            pump.start()
        reader = threading.Thread(target=self._stdin, args=(proc, gone, send), daemon=True)
        reader.start()
        for pump in pumps:
            pump.join()
        code = proc.wait()
        code = code if code >= 0 else 128 - code
        status = {"metadata": {}, "status": "Success"} if code == 0 else {
            "metadata": {}, "status": "Failure", "reason": "NonZeroExitCode",
            "message": f"command terminated with non-zero exit code: exit code {code}",
            "details": {"causes": [{"reason": "ExitCode", "message": str(code)}]},
        }  # fmt: skip
        send(0x2, bytes([3]) + json.dumps(status).encode())
        send(0x8, b"\x03\xe8")
        gone.set()

    def _stdin(self, proc: subprocess.Popen, gone: threading.Event, send) -> None:
        """Client frames: stdin (channel 0) to the process; a close, or the client gone, ends it. The
        process itself goes on: a disconnected exec does not stop what it started, on a real node either."""
        assert proc.stdin is not None
        try:
            while not gone.is_set():
                opcode, payload = self._frame()
                if opcode == 0x8:
                    send(0x8, payload[:2])  # the closing handshake's answer
                    break
                if opcode is None:
                    break
                if opcode in (0x1, 0x2) and payload:
                    if payload[0] == 0:
                        proc.stdin.write(payload[1:])
                        proc.stdin.flush()
                    elif payload[0] == 255 and payload[1:2] == b"\x00":
                        proc.stdin.close()
        except (OSError, ValueError):
            pass
        finally:
            gone.set()
            try:
                proc.stdin.close()
            except OSError:
                pass

    def _frame(self) -> tuple[int | None, bytes]:
        head = self.rfile.read(2)
        if len(head) < 2:
            return None, b""
        opcode, n = head[0] & 0x0F, head[1] & 0x7F
        if n == 126:
            n = int.from_bytes(self.rfile.read(2), "big")
        elif n == 127:
            n = int.from_bytes(self.rfile.read(8), "big")
        mask = self.rfile.read(4) if head[1] & 0x80 else b"\0\0\0\0"
        data = self.rfile.read(n)
        key = (mask * (n // 4 + 1))[:n]
        return opcode, (int.from_bytes(data, "big") ^ int.from_bytes(key, "big")).to_bytes(n, "big")


def fake_clients(url: str) -> tuple[CoreV1Api, CoreV1Api]:
    """(REST, exec) CoreV1Apis of the fake API server at `url`, each on an ApiClient of its own: what
    `PodSandboxes(clients=functools.partial(fake_clients, url))` calls in every process that holds it."""
    return CoreV1Api(ApiClient(Configuration(host=url))), CoreV1Api(ApiClient(Configuration(host=url)))
