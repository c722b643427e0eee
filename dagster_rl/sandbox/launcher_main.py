"""The launcher's own source, run inside a sandbox (see `dagster_rl.sandbox.launcher`): standard library only.

Never imported by the project; `launcher.SOURCE` holds this file's text, which the sandbox's
interpreter runs as `python3 -I -S -c SOURCE CONFIG`.
"""

import json
import os
import resource
import select
import signal
import sys
import time

FRAME_HEAD = 5  # a frame: one byte of kind (o, e, r), four of length (big-endian), then the bytes
CHUNK = 65536


def main() -> None:
    config = json.loads(sys.argv[1])
    mode = config.get("mode", "run")
    if mode == "run" and not config.get("framed"):
        run_reporting_on_fd(config)
        return
    _nondumpable()
    send(b"r", {"started": True})
    if mode == "run":
        run_framed(config)
    elif mode == "write":
        send(b"r", write_file(config))
    elif mode == "cleanup":
        left = cleanup()
        send(b"r", {"left": left, "stuck": _describe(_processes(os.getuid()), os.getpid()) if left > 0 else []})


def run_reporting_on_fd(config: dict) -> None:
    """bubblewrap: the program inherits stdin, stdout and stderr; the report goes to `report_fd`."""
    report = config["report_fd"]
    os.set_inheritable(report, False)
    os.write(report, b'{"started": true}\n')
    pid = os.fork()
    if pid == 0:
        try:
            _limit(config)
            os.execvpe(config["argv"][0], config["argv"], config["env"])
        except BaseException as e:  # whatever stops the exec is reported
            os.write(report, json.dumps({"exec_error": f"{type(e).__name__}: {e}"}).encode() + b"\n")
        os._exit(127)
    os.close(0)  # the program reads stdin; the launcher never does
    _, status, usage = os.wait4(pid, 0)
    os.write(report, json.dumps(_ending(status, usage)).encode() + b"\n")


def run_framed(config: dict) -> None:
    """A pod (reached through the exec API, which carries only stdin, stdout and stderr): the
    program's stdin is the `stdin_bytes` that follow on this stdin; its stdout and stderr are pipes
    forwarded as frames; the report is frames of its own. The launcher itself stops the program at
    its output limit and its wall-clock limit, and when it ends kills every other process of this
    user (`cleanup`): the program runs in a session of its own, but a pod has no PID namespace per
    call, so its daemons are found by their user, not by their session."""
    stdin = _stdin_of(config.get("stdin_bytes", 0))
    oom_before = _oom_kills()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    rep_r, rep_w = os.pipe()  # closed by a successful exec (close-on-exec); carries why an exec failed
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            os.dup2(stdin, 0)
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            _oom_first()
            _limit(config)
            os.execvpe(config["argv"][0], config["argv"], config["env"])
        except BaseException as e:
            os.write(rep_w, json.dumps({"exec_error": f"{type(e).__name__}: {e}"}).encode())
        os._exit(127)
    for fd in (stdin, out_w, err_w, rep_w):
        os.close(fd)
    started = time.monotonic()
    counts = {out_r: 0, err_r: 0}
    kinds = {out_r: b"o", err_r: b"e"}
    stopped, result = None, None
    poller = select.poll()
    for fd in (out_r, err_r, rep_r):
        poller.register(fd, select.POLLIN)
    exec_error = b""
    while result is None:
        left = started + config["wall_s"] - time.monotonic()
        if left <= 0:
            stopped = "timeout"
            break
        for fd, _ in poller.poll(min(left, 0.02) * 1000):
            chunk = os.read(fd, CHUNK)
            if not chunk:
                poller.unregister(fd)
            elif fd == rep_r:
                exec_error += chunk
            else:
                send(kinds[fd], chunk)
                counts[fd] += len(chunk)
                if counts[fd] > config["output_bytes"]:
                    stopped = "output_limit"
        if stopped is not None:
            break
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            result = (status, usage)
    if result is None:  # stopped: the program's session first, then everyone
        _kill_group(pid)
        _, status, usage = os.wait4(pid, 0)
        result = (status, usage)
    left_behind = cleanup()
    for fd in (out_r, err_r, rep_r):  # what is left in the pipes; a writer left behind cannot hold this
        os.set_blocking(fd, False)
        while True:
            try:
                chunk = os.read(fd, CHUNK)
            except BlockingIOError:
                break
            if not chunk:
                break
            if fd == rep_r:
                exec_error += chunk
            elif counts[fd] <= config["output_bytes"]:
                send(kinds[fd], chunk)
                counts[fd] += len(chunk)
        os.close(fd)
    if exec_error:
        try:
            send(b"r", json.loads(exec_error[:CHUNK].decode(errors="replace")))
        except ValueError:
            send(b"r", {"exec_error": exec_error[:2000].decode(errors="replace")})
    ending = _ending(*result)
    oom_after = _oom_kills()
    if oom_before is not None and oom_after is not None:
        ending["oom_kill"] = oom_after - oom_before
    ending.update(left=left_behind, folder_bytes=_folder_bytes(config.get("folder", "/work")))
    if stopped is not None:
        ending["stopped"] = stopped
    send(b"r", ending)


def cleanup() -> int:
    """Kill every process of this user but this one and PID 1 (the pod's init), wait until they are
    gone (reaped: the init reaps the orphans), and empty the pod's shared temporary folders.
    Returns how many processes were still there after 2 s (0: all gone; -1: refused, as root)."""
    me, uid = os.getpid(), os.getuid()
    if uid == 0:  # a pod's sandbox is never root; kill(-1) as root would reach far beyond it
        return -1
    deadline = time.monotonic() + 2.0
    while True:
        try:
            os.kill(-1, signal.SIGKILL)  # every process this user may signal, except this one and PID 1
        except OSError:
            pass
        left = [p for p in _processes(uid) if p != me]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    for folder in ("/tmp", "/dev/shm", "/dev/mqueue"):
        _empty(folder)
    return len(left)


def write_file(config: dict) -> dict:
    """Put `size` bytes of stdin at `path` (parents made; the file itself never followed if a link)."""
    data = _read_exactly(0, config["size"])
    path = config["path"]
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, config["file_mode"])
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fchmod(fd, config["file_mode"])
    finally:
        os.close(fd)
    return {"written": len(data)}


def send(kind: bytes, data) -> None:
    payload = data if isinstance(data, bytes) else json.dumps(data).encode()
    view = memoryview(kind + len(payload).to_bytes(4, "big") + payload)
    while view:
        view = view[os.write(1, view) :]


def _limit(config: dict) -> None:
    for name, (soft, hard) in config["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (soft, hard))


def _ending(status: int, usage) -> dict:
    cpu_s = round(usage.ru_utime + usage.ru_stime, 3)
    if os.WIFSIGNALED(status):
        return {"signal": os.WTERMSIG(status), "cpu_s": cpu_s}
    return {"exit": os.WEXITSTATUS(status), "cpu_s": cpu_s}


def _read_exactly(fd: int, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = os.read(fd, min(n - len(data), 1 << 20))
        if not chunk:
            raise SystemExit(f"dagster-rl launcher: stdin ended after {len(data)} of {n} bytes")
        data += chunk
    return bytes(data)


def _stdin_of(n: int) -> int:
    """A descriptor the program reads its stdin from: the next `n` bytes of this stdin, then EOF."""
    if n == 0:
        return os.open(os.devnull, os.O_RDONLY)
    data = _read_exactly(0, n)
    fd = os.memfd_create("stdin", 0) if hasattr(os, "memfd_create") else None
    if fd is None:
        r, w = os.pipe()  # an interpreter without memfd: stdin beyond a pipe's buffer would block here
        os.write(w, data)
        os.close(w)
        return r
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _nondumpable() -> None:
    """No process of this user may ptrace this one or read its memory (prctl PR_SET_DUMPABLE 0)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
    except Exception:
        pass


def _oom_first() -> None:
    """When the pod runs out of memory, the kernel kills the program first, not the launcher or init."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass


def _oom_kills():  # -> int | None (no annotation: any python3 runs this file)
    """How many times the OOM killer acted in this container's cgroup (v2, else v1), or None."""
    for path in ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control"):
        try:
            with open(path) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return None


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


def _processes(uid: int) -> list:
    """The processes of `uid` in this PID namespace, PID 1 aside: zombies too (until the pod's init
    reaps them they count against the user's process limit)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or name == "1":
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
            with open(f"/proc/{name}/status") as f:
                real_uid = next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
        except (OSError, StopIteration, IndexError, ValueError):
            continue
        if real_uid == uid and state != "X":
            found.append(int(name))
    return found


def _describe(pids: list, me: int) -> list:
    """`pid state name` of each process (this one aside), at most 10: what a cleanup left."""
    out = []
    for pid in [p for p in pids if p != me][:10]:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            out.append(f"{pid} {stat.rpartition(')')[2].split()[0]} {stat[stat.index('(') + 1 : stat.rindex(')')]}")
        except (OSError, ValueError):
            pass
    return out


def _empty(folder: str) -> None:
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        _remove(os.path.join(folder, name))


def _remove(path: str) -> None:
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            os.chmod(path, 0o700)
            for name in os.listdir(path):
                _remove(os.path.join(path, name))
            os.rmdir(path)
        else:
            os.unlink(path)
    except OSError:
        pass


def _folder_bytes(folder: str) -> int:
    total = 0
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in filenames + dirnames:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return total


if __name__ == "__main__":
    main()
