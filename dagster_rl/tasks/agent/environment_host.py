"""The host of environments' processes: a small process that forks one child per trial.

Forking the driver itself would copy a process that holds a model, threads and locks; starting a
fresh interpreter per trial costs a second of imports. The host is a clean interpreter, started
once per driver process (`Host.get()`), with this process's `sys.path`: it imports the
environments' modules when a trial first needs them (and keeps them), and forks each trial's
child from itself, single-threaded, in a few milliseconds.

    parent                         host                               child (one per trial)
    Host.fork(target, args) ──────> imports target's module, forks ──> target(conn, *args)
    <── the child's pid                                                 (its end of a socket pair)

The parent hands the host, with each request, one end of a new socket pair: the child talks over
it, and the parent keeps the other end. Requests and answers are pickles over a socket only these
two processes hold. The host exits when its control socket closes (the driver is gone, whatever
ended it); each child watches the driver by its identity and exits once it is gone
(`environment_process`).
"""

import importlib
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
from typing import Any

_LENGTH = struct.Struct("!I")


def _send(sock: socket.socket, value: Any, fds: list[int] | None = None) -> None:
    data = pickle.dumps(value)
    if fds:
        socket.send_fds(sock, [_LENGTH.pack(len(data)) + data], fds)
    else:
        sock.sendall(_LENGTH.pack(len(data)) + data)


def _receive(sock: socket.socket, max_fds: int = 0) -> tuple[Any, list[int]]:
    head, fds, _, _ = socket.recv_fds(sock, _LENGTH.size, max_fds) if max_fds else (sock.recv(_LENGTH.size), [], 0, None)
    if len(head) < _LENGTH.size:
        if not head:
            raise EOFError("the other side closed the socket")
        head += _exactly(sock, _LENGTH.size - len(head))
    return pickle.loads(_exactly(sock, _LENGTH.unpack(head)[0])), list(fds)


def _exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError("the other side closed the socket")
        data += chunk
    return bytes(data)


class Host:
    """The parent's side: the host process and its control socket (one per process, `get()`)."""

    _instance: "Host | None" = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        self.process = subprocess.Popen(
            [sys.executable, "-c", f"from {__name__} import serve; serve({theirs.fileno()})"],
            pass_fds=(theirs.fileno(),),
            env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
            start_new_session=True,  # a terminal's Ctrl-C reaches the driver, which stops the host
        )
        theirs.close()
        self.sock = ours
        self.requests = threading.Lock()

    @classmethod
    def get(cls) -> "Host":
        """This process's host, started on first use (again if it died)."""
        with cls._lock:
            if cls._instance is None or cls._instance.process.poll() is not None or cls._instance.pid_owner != os.getpid():
                cls._instance = cls()
                cls._instance.pid_owner = os.getpid()
            return cls._instance

    pid_owner = -1

    def fork(self, target: str, preload: list[tuple[str, str | None]], args: tuple) -> tuple[int, socket.socket]:
        """A child running `target` (`module:function`) with (its socket, *args), forked once the host
        has imported `preload` (modules, or plugin files with their folder: `dagster_rl.base.plugins`):
        (pid, the parent's socket)."""
        ours, theirs = socket.socketpair()
        try:
            with self.requests:
                _send(self.sock, (target, preload, args), [theirs.fileno()])
                (pid, error), _ = _receive(self.sock)
        finally:
            theirs.close()
        if error:
            ours.close()
            raise RuntimeError(error)
        return pid, ours


def serve(control_fd: int) -> None:
    """The host's loop: a child per request, until the control socket closes."""
    from pathlib import Path

    from dagster_rl.base.plugins import import_module

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    control = socket.socket(fileno=control_fd)
    while True:
        try:
            (target, preload, args), fds = _receive(control, max_fds=1)
        except (EOFError, OSError):
            os._exit(0)
        module, _, name = target.partition(":")
        try:
            for reference, folder in preload:
                import_module(reference, Path(folder) if folder else None)
            function = getattr(importlib.import_module(module), name)
        except BaseException as e:  # reported to the parent; the host goes on
            for fd in fds:
                os.close(fd)
            _send(control, (0, f"the environments' host could not import {target} and {preload}: {type(e).__name__}: {e}"))
            continue
        pid = os.fork()
        if pid == 0:
            control.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            conn = socket.socket(fileno=fds[0])
            try:
                function(conn, *args)
            finally:
                os._exit(0)
        for fd in fds:
            os.close(fd)
        _send(control, (pid, None))
