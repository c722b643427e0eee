"""Worker processes that call code we do not control (a user's reward function, a verifier library)
with a deadline per call: a call that runs past it has its worker killed and replaced.

Why processes, and why not `signal.alarm`: the judge calls from threads, and a signal's handler
runs on the main thread only (math-verify's timeouts fail there, math-verify #50); a hung C call
or a `while True:` holds its thread for good, and a thread cannot be killed. A process can: each
call is handed to an idle worker of the pool, and the caller waits for its answer until the
deadline; past it, the worker's process group is killed (SIGKILL: whatever it started dies with
it) and the next call starts a fresh one. Waiting for a free worker, and a worker's start (the
interpreter, the callables' imports), count against no call's deadline: they have their own.

A pool serves a fixed list of callables (`Callee`: `file.py:name` in a folder, or
`package.module:name`, as `dagster_rl.base.plugins` resolves them). Each worker imports them all
when it starts and checks that a file's bytes are the ones the caller hashed into its keys
(`source_sha256`): a file edited since is refused, never run under the old key. Arguments and
results travel as JSON (a result's numbers from numpy or torch are converted; NaN and infinities
survive, for the caller to refuse). A worker's stdout and stdin are not the protocol's: what user
code prints goes to stderr.

A worker dies with its parent (it watches the parent's pid) and exits after `idle_timeout_s`
without a call; the pool starts another when one is next needed.

    python -m dagster_rl.runtime.function_workers     the worker (started by `FunctionWorkers`)
"""

import atexit
import json
import math
import numbers
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SOURCE_ROOT = Path(__file__).resolve().parents[2]  # the folder holding `dagster_rl`
IDLE_EXIT = 75  # a worker's exit status when it left idle (the call it may have missed was never run)
HEADER = struct.Struct(">I")
MAX_MESSAGE = 64 << 20  # a call's arguments or result: text, ids and numbers, never near this


class FunctionFailed(RuntimeError):
    """A call that returned no value. `how`: `raised` (the callable raised; `detail` is its error and
    where), `timeout` (past its deadline: its worker was killed), `died` (its worker exited
    mid-call), `load` (a worker could not import the callables, or a file's bytes changed)."""

    def __init__(self, how: str, detail: str):
        self.how, self.detail = how, detail
        super().__init__(detail)


@dataclass(frozen=True)
class Callee:
    reference: str  # `file.py:name` (a file in `folder`) or `package.module:name`
    folder: str | None = None  # the experiments folder a file reference is in
    source_sha256: str | None = None  # the bytes the caller keyed on; the worker refuses other bytes


# ---- the caller's side -----------------------------------------------------------------------------


class _Worker:
    def __init__(self, callees: Sequence[Callee], startup_timeout_s: float, idle_timeout_s: float):
        env = dict(os.environ)
        # the worker imports this package from where the caller does, and the caller's modules (a
        # `package.module:name` reference) from the caller's path
        path = [str(SOURCE_ROOT), *(p for p in sys.path if p and Path(p).is_dir())]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(path))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dagster_rl.runtime.function_workers"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,  # its own process group: a kill reaches whatever the callable started
        )
        self._buffer = b""
        hello = {
            "callees": [c.__dict__ for c in callees],
            "parent": os.getpid(),
            "idle_timeout_s": idle_timeout_s,
        }
        try:
            reply = self.exchange(hello, startup_timeout_s)
        except EOFError:
            status = self.exit_status()
            self.kill()
            raise FunctionFailed("load", f"a worker process {status} as it started (its stderr is the driver's)") from None
        if reply is None:
            self.kill()
            raise FunctionFailed("load", f"a worker process did not start within {startup_timeout_s:g} s")
        if "error" in reply:
            self.kill()
            raise FunctionFailed("load", reply["error"])

    def exchange(self, message: dict, timeout_s: float) -> dict | None:
        """Send `message`, then its answer; None when none came within `timeout_s`. Raises EOFError
        when the worker closed its end (it exited)."""
        data = json.dumps(message, allow_nan=True).encode()
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(HEADER.pack(len(data)) + data)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise EOFError from None
        return self._read(time.monotonic() + timeout_s)

    def _read(self, deadline: float) -> dict | None:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while True:
            if len(self._buffer) >= HEADER.size:
                (n,) = HEADER.unpack(self._buffer[: HEADER.size])
                if len(self._buffer) >= HEADER.size + n:
                    body, self._buffer = self._buffer[HEADER.size : HEADER.size + n], self._buffer[HEADER.size + n :]
                    return json.loads(body)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            if not _readable(fd, remaining):
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise EOFError
            self._buffer += chunk

    def exit_status(self) -> str:
        try:
            code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            return "closed its pipe and did not exit"
        if code < 0:
            return f"was killed by signal {signal.Signals(-code).name}"
        return f"exited with status {code}"

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass


class FunctionWorkers:
    """Up to `size` worker processes calling `callees`, started when a call needs one."""

    def __init__(self, callees: Sequence[Callee], size: int = 2, startup_timeout_s: float = 120.0, idle_timeout_s: float = 300.0):
        self.callees = tuple(callees)
        self.size, self.startup_timeout_s, self.idle_timeout_s = size, startup_timeout_s, idle_timeout_s
        self._idle: list[_Worker] = []
        self._running = 0  # workers started and not killed: idle, or serving a call
        self._cond = threading.Condition()
        self._closed = False
        self.started = 0  # workers started so far (tests read it)

    def call(self, index: int, kwargs: dict[str, Any], timeout_s: float) -> Any:
        """`callees[index](**kwargs)` in a worker, its JSON result; `FunctionFailed` when it raised,
        ran past `timeout_s` (its worker is killed), or its worker died."""
        for _ in range(3):  # a worker that left idle just as the call came: another one takes it
            worker = self._take()
            try:
                reply = worker.exchange({"call": index, "kwargs": kwargs}, timeout_s)
            except EOFError:
                status = worker.exit_status()
                worker.kill()
                self._gone()
                if worker.proc.returncode == IDLE_EXIT:
                    continue
                raise FunctionFailed("died", f"its worker process {status} during the call") from None
            if reply is None:
                worker.kill()
                self._gone()
                raise FunctionFailed("timeout", f"did not return within {timeout_s:g} s")
            self._give_back(worker)
            if "error" in reply:
                raise FunctionFailed("raised", reply["error"])
            return reply["ok"]
        raise FunctionFailed("died", "three worker processes in a row exited before they took the call")

    def _take(self) -> _Worker:
        with self._cond:
            while True:
                if self._closed:
                    raise FunctionFailed("died", "the worker pool is closed")
                while self._idle:
                    worker = self._idle.pop()
                    if worker.proc.poll() is None:
                        return worker
                    worker.kill()  # it left idle: not counted any more
                    self._running -= 1
                if self._running < self.size:
                    self._running += 1
                    break
                self._cond.wait()
        try:
            worker = _Worker(self.callees, self.startup_timeout_s, self.idle_timeout_s)
        except BaseException:
            self._gone()
            raise
        self.started += 1
        return worker

    def _give_back(self, worker: _Worker) -> None:
        with self._cond:
            if self._closed:
                worker.kill()
                self._running -= 1
            else:
                self._idle.append(worker)
            self._cond.notify()

    def _gone(self) -> None:
        with self._cond:
            self._running -= 1
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._running -= len(idle)
            self._cond.notify_all()
        for worker in idle:
            worker.kill()


_POOLS: dict[tuple, FunctionWorkers] = {}
_POOLS_LOCK = threading.Lock()


def workers_for(callees: Sequence[Callee], size: int | None = None) -> FunctionWorkers:
    """The process's pool for these callees (one per distinct list: a file's new bytes get a new one),
    made on first use, closed when the process exits."""
    key = tuple(callees)
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None:
            pool = _POOLS[key] = FunctionWorkers(key, size=size or max(1, min(4, os.cpu_count() or 1)))
        return pool


@atexit.register
def _close_all() -> None:
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for pool in pools:
        pool.close()


# ---- the worker's side ------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """A result's value as JSON can hold it: numpy and torch numbers and arrays as Python's."""
    if isinstance(value, numbers.Real):
        return float(value)
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"a {type(value).__name__} is not JSON: return numbers, None, text, lists or dicts")


def _where(error: BaseException) -> str:
    """The innermost frame of a traceback: `my_rewards.py, line 7, in length_penalty` (a comprehension's
    frame named by the function it is in)."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return ""
    f, name = frames[-1], frames[-1].name
    for outer in reversed(frames[:-1]):
        if not name.startswith("<") or outer.filename != f.filename:
            break
        name = outer.name
    return f" ({Path(f.filename).name}, line {f.lineno}, in {name})"


def _load(callees: list[dict]) -> list[Any]:
    import hashlib

    from dagster_rl.base.plugins import load_callable, source_of

    def digest(reference: str, folder: Path | None) -> str:
        return hashlib.sha256(source_of(reference, folder)).hexdigest()

    loaded = []
    for c in callees:
        folder = Path(c["folder"]) if c["folder"] else None
        expected = c["source_sha256"]
        if expected is not None and digest(c["reference"], folder) != expected:
            raise RuntimeError(f"{c['reference']}: the file changed since this step computed its keys; run the step again")
        fn = load_callable(c["reference"], folder)
        if expected is not None and digest(c["reference"], folder) != expected:
            raise RuntimeError(f"{c['reference']}: the file changed while it was imported; run the step again")
        loaded.append(fn)
    return loaded


def _watch_parent(parent: int) -> None:
    while True:
        if os.getppid() != parent:
            os._exit(1)
        time.sleep(1.0)


def main() -> None:
    # the protocol's own file descriptors; what user code prints goes to stderr, and it reads nothing
    proto_in, proto_out = os.dup(0), os.dup(1)
    os.dup2(2, 1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    reader = os.fdopen(proto_in, "rb", buffering=0)
    writer = os.fdopen(proto_out, "wb", buffering=0)

    def receive(timeout: float | None) -> dict | None:
        if timeout is not None and not _readable(proto_in, timeout):
            return None
        header = _read_exactly(reader, HEADER.size)
        (n,) = HEADER.unpack(header)
        if n > MAX_MESSAGE:
            raise SystemExit(2)
        return json.loads(_read_exactly(reader, n))

    def send(message: dict) -> None:
        try:
            data = json.dumps(message, allow_nan=True, default=_plain).encode()
        except (TypeError, ValueError) as e:
            data = json.dumps({"error": f"its result cannot be returned: {e}"}).encode()
        writer.write(HEADER.pack(len(data)) + data)

    hello = receive(None)
    assert hello is not None
    threading.Thread(target=_watch_parent, args=(hello["parent"],), daemon=True).start()
    try:
        functions = _load(hello["callees"])
    except BaseException as e:
        send({"error": f"{type(e).__name__}: {e}"})
        return
    send({"ok": True})
    while True:
        message = receive(hello["idle_timeout_s"])
        if message is None:
            sys.exit(IDLE_EXIT)
        try:
            result = functions[message["call"]](**message["kwargs"])
        except Exception as e:
            send({"error": f"{type(e).__name__}: {e}{_where(e)}"})
            continue
        send({"ok": result})


def _readable(fd: int, timeout_s: float) -> bool:
    """Whether `fd` has data (or its end closed) within `timeout_s`: poll(2), which, unlike select(2),
    takes a descriptor above 1023 (a driver process holds many)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(max(0, math.ceil(timeout_s * 1000))))


def _read_exactly(stream, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = stream.read(n - len(data))
        if not chunk:
            raise SystemExit(0)  # the caller closed its end
        data += chunk
    return data


if __name__ == "__main__":
    main()
