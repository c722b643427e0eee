"""The local placement (the embedded default): each call in a new bubblewrap sandbox.

What a program sees and may do:

- its own namespaces: no network (a connect to the host's 127.0.0.1 is refused), its own PIDs
  (it sees none of the host's processes), IPC, UTS and cgroup namespaces, and a user namespace in
  which it cannot make another;
- the interpreter's files read-only (`/usr`, and the interpreter's prefix when it lies elsewhere),
  a fresh `/proc` and `/dev`, a private `/tmp` of `TMP_MB` in memory, and its episode's folder,
  writable, at `/work` (its working directory and `$HOME`); nothing else: not `$HOME`,
  `DAGSTER_HOME`, the artifact store, the experiments folder or the repository;
- an unprivileged user: when this process is root, bubblewrap runs as `uid` (65534, `nobody`, by
  default), so the process limit holds (the kernel exempts root from it); otherwise as this user;
- the limits of `SandboxLimits`, set by the launcher (`dagster_rl.sandbox.launcher`) in the
  program's process: CPU seconds, address space, processes (counted in its own user namespace),
  open files, file size; the wall-clock backstop and the output limit enforced from here.

Every process a call started is gone when it returns: the sandbox's PID namespace ends with its
first process (bubblewrap's), which the kernel then empties, daemons and double forks included;
bubblewrap dies with this process (`--die-with-parent`). The episode's folder lies under this
process's owner folder (`dagster_rl.sandbox.folders`) and is removed when the workspace closes, or
by the next process to open the root if this one was killed.

At most `max_concurrency` sandboxes run at once per root, across processes: each call holds one
of that many slot files (`flock`) while it runs.
"""

import errno
import json
import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from dagster_rl.sandbox.calls import Call, CallOutcome, Program, SandboxUnavailable
from dagster_rl.sandbox.folders import remove_tree, trial_folder
from dagster_rl.sandbox.launcher import SOURCE, rlimits
from dagster_rl.sandbox.limits import SandboxLimits
from dagster_rl.sandbox.outcomes import ENV, WORK, Bounded, call_record, check_file_name
from dagster_rl.sandbox.slots import Slot

INSTALL = "install bubblewrap (Debian and Ubuntu: `apt-get install bubblewrap`; Fedora: `dnf install bubblewrap`)"
TMP_MB = 16  # the private /tmp, in memory


@dataclass
class BubblewrapSandboxes:
    """Sandboxes on this machine: a folder per episode under `root`, a bubblewrap sandbox per call.

    `python`: the interpreter a Python program runs on (its files are bound read-only; the
    standard library is what a program can import). `uid`: the user sandboxes run as when this
    process is root. `max_concurrency`: sandboxes running at once under `root`, across processes.
    `max_retries`: attempts again a call whose sandbox could not be made (never one that ran).
    `slot_timeout_s`: how long a call waits for a free slot before it fails as infrastructure."""

    root: Path
    python: str = "/usr/bin/python3"
    bwrap: str = "bwrap"
    uid: int = 65534
    max_concurrency: int = 8
    max_retries: int = 2
    slot_timeout_s: float = 600.0
    name: str = "bubblewrap"
    _checked: bool = field(default=False, repr=False)
    _identity: str = field(default="", repr=False)

    def check(self) -> None:
        """A `SandboxUnavailable` naming what to install or allow when no sandbox can be made here.
        It makes one (a program that prints) and checks what came back."""
        if self._checked:
            return
        if shutil.which(self.bwrap) is None:
            raise SandboxUnavailable(f"the sandbox needs bubblewrap (`{self.bwrap}`), which is not installed: {INSTALL}")
        if not Path(self.python).is_file():
            raise SandboxUnavailable(
                f"the sandbox's interpreter {self.python} does not exist: install it, or set the sandbox's python"
            )
        with self.open("check") as ws:
            call = ws.run(Program(python="print(6 * 7)"), SandboxLimits())
        if (call.outcome, call.stdout) != ("exit", "42\n"):
            raise SandboxUnavailable(f"a sandbox was made but a program printing 42 gave {call!r}")
        self._checked = True

    def identity(self) -> str:
        if not self._identity:
            try:
                version = subprocess.run(
                    [self.python, "-I", "-S", "-c", "import sys; print(sys.version)"], capture_output=True, text=True, timeout=60
                ).stdout.strip()
            except OSError as e:
                raise SandboxUnavailable(f"the sandbox's interpreter {self.python} could not be run: {e}") from None
            self._identity = f"python {version}"
        return self._identity

    def open(self, label: str) -> "BubblewrapWorkspace":
        folder = trial_folder(self.root, label)  # the folders of processes killed before they removed theirs go first
        if os.geteuid() == 0:
            _let_enter(self.root)
            os.chown(folder, self.uid, self.uid)
        return BubblewrapWorkspace(self, folder)


def default_sandboxes() -> BubblewrapSandboxes:
    """The embedded default: bubblewrap on this machine, under `default_root()`."""
    return BubblewrapSandboxes(default_root())


def default_root() -> Path:
    """Where episode folders lie unless the sandbox environment names another root."""
    return Path(tempfile.gettempdir()) / "dagster_rl_sandboxes"


@dataclass
class BubblewrapWorkspace:
    sandboxes: BubblewrapSandboxes
    folder: Path
    calls: int = 0

    def __enter__(self) -> "BubblewrapWorkspace":
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        remove_tree(self.folder)

    def write(self, name: str, data: bytes, mode: int = 0o644) -> None:
        """A file where the programs see it (`name`: plain names only, never `..`)."""
        path = self.folder / check_file_name(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(path, mode)
        if os.geteuid() == 0:
            for part in [*reversed(path.relative_to(self.folder).parents), path.relative_to(self.folder)]:
                os.chown(self.folder / part, self.sandboxes.uid, self.sandboxes.uid, follow_symlinks=False)

    def run(self, program: Program, limits: SandboxLimits) -> Call:
        """Run `program` to its end in a new sandbox over this workspace's folder."""
        errors: list[str] = []
        for _ in range(self.sandboxes.max_retries + 1):
            with _slot(self.sandboxes):
                try:
                    return self._run(program, limits)
                except SandboxUnavailable as e:
                    errors.append(str(e))
            time.sleep(0.1)
        raise SandboxUnavailable(f"no sandbox could be made after {len(errors)} attempt(s): {errors[-1]}")

    def _run(self, program: Program, limits: SandboxLimits) -> Call:
        s = self.sandboxes
        argv = [s.python, "-c", program.python] if program.python is not None else list(program.argv)
        report_r, report_w = os.pipe()
        config = {"argv": argv, "env": ENV, "rlimits": rlimits(limits), "report_fd": report_w}
        command = [*self._bwrap(), s.python, "-I", "-S", "-c", SOURCE, json.dumps(config)]
        root = os.geteuid() == 0
        started = time.monotonic()
        try:
            proc = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(report_w,),
                start_new_session=True,
                user=s.uid if root else None,
                group=s.uid if root else None,
                extra_groups=[] if root else None,
                cwd="/",
            )
        except OSError as e:
            os.close(report_r)
            raise SandboxUnavailable(f"bubblewrap could not be started ({s.bwrap}): {e}; {INSTALL}") from None
        finally:
            os.close(report_w)
        try:
            out, err, report, stopped = _communicate(proc, report_r, program.stdin, limits)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            os.close(report_r)
        seconds = time.monotonic() - started
        lines = [json.loads(line) for line in report.splitlines() if line.strip()]
        if not lines:  # the launcher never ran: bubblewrap could not make the sandbox
            said = err.data.decode(errors="replace").strip()[-2000:]
            if "source path" in said and "Permission denied" in said and root:
                said += (
                    f" (sandboxes run as uid {s.uid}, which must be able to enter every folder above {self.folder}: "
                    "choose a sandbox root under /tmp, or `chmod o+x` the folders above it)"
                )
            raise SandboxUnavailable(f"bubblewrap could not make a sandbox (exit status {proc.returncode}): {said}")
        call = call_record(out, err, lines, stopped, limits, seconds, lambda: _folder_bytes(self.folder))
        self.calls += 1
        return call

    def _bwrap(self) -> list[str]:
        s = self.sandboxes
        return [
            s.bwrap,
            "--unshare-all",
            "--unshare-user",
            "--disable-userns",
            "--die-with-parent",
            "--new-session",
            *_system_binds(s.python),
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--size",
            str(TMP_MB << 20),
            "--tmpfs",
            "/tmp",
            "--bind",
            str(self.folder),
            WORK,
            "--remount-ro",  # the sandbox's own root (a tmpfs bubblewrap made): nothing can be written there
            "/",
            "--chdir",
            WORK,
            "--clearenv",
            "--hostname",
            "sandbox",
        ]


def _let_enter(folder: Path) -> None:
    """Let other users enter (not list) a folder this process owns: the sandbox's user must pass through it."""
    mode = folder.stat().st_mode
    if mode & 0o011 != 0o011 and folder.stat().st_uid == os.geteuid():
        folder.chmod((mode | 0o011) & 0o7777)


def _system_binds(python: str) -> list[str]:
    """What the interpreter needs, read-only: /usr, the merged-/usr links (or the folders where
    they are folders), and the interpreter's own prefix when it lies outside /usr."""
    binds = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        path = Path(top)
        if path.is_symlink():
            binds += ["--symlink", os.readlink(path), top]
        elif path.is_dir():
            binds += ["--ro-bind", top, top]
    prefix = Path(python).resolve().parent.parent
    if not prefix.is_relative_to("/usr"):
        binds += ["--ro-bind", str(prefix), str(prefix)]
    return binds


def _communicate(
    proc: subprocess.Popen, report_fd: int, stdin: bytes, limits: SandboxLimits
) -> tuple[Bounded, Bounded, str, CallOutcome | None]:
    """Feed stdin, read stdout, stderr and the launcher's report until all close, or until a limit
    stops the sandbox: (stdout, stderr, report, the outcome of a stop, or None)."""
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    out, err, report = Bounded(limits.output_bytes), Bounded(limits.output_bytes), bytearray()
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, out)
    sel.register(proc.stderr, selectors.EVENT_READ, err)
    sel.register(report_fd, selectors.EVENT_READ, report)
    pending = memoryview(stdin)
    if pending:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin, selectors.EVENT_WRITE, None)
    else:
        proc.stdin.close()
    deadline = time.monotonic() + limits.wall_s
    stopped: CallOutcome | None = None
    open_reads = 3
    while open_reads and stopped is None:
        left = deadline - time.monotonic()
        if left <= 0:
            stopped = "timeout"
            break
        for key, _ in sel.select(timeout=min(left, 1.0)):
            if key.data is None:  # stdin
                try:
                    pending = pending[os.write(proc.stdin.fileno(), pending[:65536]) :]
                except (BrokenPipeError, OSError):
                    pending = memoryview(b"")
                if not pending:
                    sel.unregister(proc.stdin)
                    proc.stdin.close()
                continue
            fd = key.fd
            try:
                chunk = os.read(fd, 65536)
            except OSError as e:
                if e.errno == errno.EAGAIN:
                    continue
                chunk = b""
            if not chunk:
                sel.unregister(key.fileobj)
                open_reads -= 1
            elif key.data is report:
                report += chunk
            elif key.data.add(chunk):
                stopped = "output_limit"
    sel.close()
    if stopped is not None:
        _stop(proc)
    if not proc.stdin.closed:
        proc.stdin.close()
    return out, err, report.decode(errors="replace"), stopped


def _stop(proc: subprocess.Popen) -> None:
    """Kill the sandbox: bubblewrap, whose death ends its PID namespace and every process in it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _folder_bytes(folder: Path) -> int:
    """Bytes the folder's files take on disk (links not followed)."""
    total = 0
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in filenames + dirnames:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return total


def _slot(s: BubblewrapSandboxes) -> Slot:
    """One of `max_concurrency` slot files under the root, locked while a sandbox runs."""
    busy = f"every one of the {s.max_concurrency} sandbox slots under {s.root} stayed busy for {s.slot_timeout_s} s"
    return Slot(s.root / ".slots", s.max_concurrency, s.slot_timeout_s, busy)
