"""One exec into a sandbox pod: the pods/exec API of the Kubernetes API server (a websocket that
carries the command's stdin, stdout, stderr and, at the end, its status), the launcher's frames
read from its stdout, and the driver's own deadline over all of it.

The exec goes through the API server and the kubelet, not the pod's network: a deny-all
NetworkPolicy on the sandbox pods does not block it. The command is the launcher's bootstrap
(`dagster_rl.sandbox.launcher.BOOT`); what it runs comes on stdin.

`kubernetes.stream.stream` swaps its ApiClient's `request` method while it opens a websocket, so a
REST call made on the same client meanwhile would go to a websocket: execs use an ApiClient of
their own, and are opened one at a time (`_OPENING`); once open, each stream is its own socket.
"""

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from dagster_rl.sandbox.calls import CallOutcome
from dagster_rl.sandbox.launcher import BOOT
from dagster_rl.sandbox.outcomes import Bounded

FRAME_KINDS = (b"o", b"e", b"r")
MAX_FRAME = 1 << 20  # the launcher's frames are at most 64 KiB of output, or one report line
OVERRUN = 1 << 20  # past the output limit by this much, the launcher is not stopping the program: the driver does
SEND_CHUNK = 1 << 16
_OPENING = threading.Lock()


class ExecStream(Protocol):
    """An open exec: bytes to its stdin, chunks of its stdout and stderr, its status once it ended."""

    def send(self, data: bytes) -> None: ...

    def read(self, timeout_s: float) -> tuple[bytes, bytes] | None:
        """(stdout, stderr) received within `timeout_s` (maybe empty); None once the exec has ended
        and everything it sent was read."""

    def status(self) -> dict[str, Any] | None:
        """The exec's status (`{"status": "Success"}`, or a Failure with the exit code), once ended."""

    def close(self) -> None: ...


OpenExec = Callable[[str, list[str]], ExecStream]  # (pod name, command) -> an open exec


@contextmanager
def _handshake_errors() -> Iterator[None]:
    """A refused handshake as the client's ApiException ("Handshake status 403 Forbidden ..."): the
    kubernetes client (36.x) raises it, then fails decoding its empty body (an AttributeError)."""
    try:
        yield
    except AttributeError as e:
        refused = e.__context__
        if refused is not None and getattr(refused, "reason", None) is not None:
            raise refused from None
        raise


class ExecProtocolError(Exception):
    """The exec's stdout is not the launcher's frames."""


class WebSocketExec:
    """An exec through the Kubernetes API server (`kubernetes.stream`, binary frames)."""

    def __init__(self, api: Any, namespace: str, pod: str, container: str, command: list[str]):
        from kubernetes.stream import stream

        with _OPENING, _handshake_errors():
            self.ws = stream(
                api.connect_get_namespaced_pod_exec,
                pod,
                namespace,
                container=container,
                command=command,
                stdin=True,
                stdout=True,
                stderr=True,
                tty=False,
                binary=True,
                _preload_content=False,
            )
        self.dropped = False

    def send(self, data: bytes) -> None:
        for i in range(0, len(data), SEND_CHUNK):
            self.ws.write_stdin(data[i : i + SEND_CHUNK])

    def read(self, timeout_s: float) -> tuple[bytes, bytes] | None:
        from websocket import WebSocketException

        if self._open():
            try:
                self.ws.update(timeout=timeout_s)
                for _ in range(64):  # what else has arrived already
                    if not self._open():
                        break
                    self.ws.update(timeout=0)
            except (WebSocketException, OSError, ValueError):
                self.dropped = True  # what arrived before is still read below
        out, err = self._take(1), self._take(2)
        if not out and not err and not self._open():
            return None
        return out, err

    def _open(self) -> bool:
        return not self.dropped and self.ws.is_open()

    def _take(self, channel: int) -> bytes:
        data = self.ws.read_channel(channel, timeout=0) if self._open() else self.ws._channels.pop(channel, b"")
        return data if isinstance(data, bytes) else data.encode()

    def status(self) -> dict[str, Any] | None:
        raw = self._take(3)
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return {"status": "Unknown", "message": raw[:500].decode(errors="replace")}

    def close(self) -> None:
        try:
            self.ws.close(timeout=0)  # an exec left running is ended by the cleanup, not by waiting here
        except Exception:
            pass


@dataclass
class Exchange:
    """What one exec of the launcher returned."""

    out: Bounded
    err: Bounded
    report: list[dict[str, Any]] = field(default_factory=list)
    stopped: CallOutcome | None = None  # the driver stopped it (its deadline, or output past the launcher's stop)
    ended: bool = False  # the exec ended by itself (its stream closed)
    status: dict[str, Any] | None = None
    diagnostics: str = ""  # the exec's own stderr: the launcher's errors, the runtime's
    broken: str = ""  # why the stream broke, when it did

    @property
    def started(self) -> bool:
        return any(x.get("started") for x in self.report)

    @property
    def ending(self) -> dict[str, Any] | None:
        return next((x for x in self.report if "exit" in x or "signal" in x or "left" in x or "written" in x), None)

    def what(self) -> str:
        """The exec's status and stderr, for an error message."""
        said = self.diagnostics.strip()[-1500:]
        status = json.dumps(self.status)[:800] if self.status else "no status"
        broken = f"{self.broken}; " if self.broken else ""
        return f"{broken}{status}{'; stderr: ' + said if said else ''}"


def exchange(open_exec: Callable[[], ExecStream], stdin: bytes, output_bytes: int, deadline: float) -> Exchange:
    """Run the bootstrap once: send `stdin`, read the launcher's frames until the exec ends, the
    driver's `deadline` (time.monotonic) passes, or the stream breaks (`broken`). Errors opening the
    exec propagate: nothing ran."""
    done = Exchange(Bounded(output_bytes), Bounded(output_bytes))
    stream = open_exec()
    diagnostics = Bounded(8192)
    try:
        stream.send(stdin)
        frames = _Frames()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                done.stopped = "timeout"
                break
            got = stream.read(min(left, 0.5))
            if got is None:
                done.ended = True
                break
            out, err = got
            diagnostics.add(err)
            for kind, payload in frames.feed(out):
                if kind == b"r":
                    done.report.append(_report_line(payload))
                elif (done.out if kind == b"o" else done.err).add(payload) and max(done.out.cut, done.err.cut) > OVERRUN:
                    done.stopped = "output_limit"
            if done.stopped is not None:
                break
        done.status = stream.status() if done.ended else None
    except Exception as e:  # the stream broke, or carried something that is not the launcher's
        done.broken = f"{type(e).__name__}: {e}"
    finally:
        done.diagnostics = diagnostics.text()
        stream.close()
    return done


def command(python: str) -> list[str]:
    """The exec's command: the bootstrap, which reads the launcher and its config on stdin."""
    return [python, "-I", "-S", "-c", BOOT]


class _Frames:
    """The launcher's frames (kind, 4-byte length, bytes) out of a stream of chunks."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[bytes, bytes]]:
        self.buffer += data
        frames = []
        while len(self.buffer) >= 5:
            kind, size = bytes(self.buffer[:1]), int.from_bytes(self.buffer[1:5], "big")
            if kind not in FRAME_KINDS or size > MAX_FRAME:
                raise ExecProtocolError(f"not a launcher frame: {bytes(self.buffer[:40])!r}")
            if len(self.buffer) < 5 + size:
                break
            frames.append((kind, bytes(self.buffer[5 : 5 + size])))
            del self.buffer[: 5 + size]
        return frames


def _report_line(payload: bytes) -> dict[str, Any]:
    try:
        line = json.loads(payload)
    except ValueError:
        raise ExecProtocolError(f"not a report line: {payload[:200]!r}") from None
    if not isinstance(line, dict):
        raise ExecProtocolError(f"not a report line: {payload[:200]!r}")
    return line
