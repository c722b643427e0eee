"""A tier's concurrency limit across the processes of one machine: `count` slot files in a folder,
one held (an exclusive `flock`) by each sandbox in use. A process that dies frees its slots with
its descriptors, so a killed holder never keeps one."""

import fcntl
import os
import time
from pathlib import Path

from dagster_rl.sandbox.calls import SandboxUnavailable


class Slot:
    """One of `count` slots in `folder`, held from `acquire` to `release` (or as a context). Waits up
    to `timeout_s` for a free one; then `SandboxUnavailable(busy)`."""

    def __init__(self, folder: Path, count: int, timeout_s: float, busy: str):
        self.folder, self.count, self.timeout_s, self.busy = folder, count, timeout_s, busy
        self.fd = -1

    def acquire(self) -> "Slot":
        self.folder.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + self.timeout_s
        while True:
            for i in range(self.count):
                fd = os.open(self.folder / f"{i}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                self.fd = fd
                return self
            if time.monotonic() > deadline:
                raise SandboxUnavailable(self.busy)
            time.sleep(0.005)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the descriptor releases the lock
            self.fd = -1

    def __enter__(self) -> "Slot":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
