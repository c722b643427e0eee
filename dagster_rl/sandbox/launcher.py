"""The launcher: the first process inside a sandbox, in either placement. It sets the program's
rlimits, starts it, waits for it, and reports how it ended.

It is plain standard-library Python (`launcher_main.py`), run by the sandbox's interpreter as
`python3 -I -S -c SOURCE CONFIG` (no file of the project is visible in a sandbox), where CONFIG is
JSON: the program's arguments, its environment and its limits. Its report is JSON lines:
`{"started": true}` first (the sandbox was made), then, when the program has ended, one of

    {"exit": 0, "cpu_s": 0.02}      the program exited (its status)
    {"signal": 24, "cpu_s": 5.01}   a signal ended it (24: SIGXCPU, its CPU seconds ran out)
    {"exec_error": "..."}           the program could not be started (no such command, say),
                                    followed by {"exit": 127, ...}

The limits are set in the program's process, after the fork and before `exec`: the launcher itself
stays outside them, so it can report a program that used them up.

Two ways to run, one per placement:

- bubblewrap (`report_fd`): the program inherits the launcher's stdin, stdout and stderr; the report
  goes to a descriptor of its own. What the launcher cannot report, because it is killed too, the
  host side knows instead (the wall-clock backstop, the output limit); the sandbox's PID namespace
  ends every process of the call.
- a pod (`framed`), reached through Kubernetes' exec API, which carries stdin, stdout and stderr and
  puts the command's arguments in a URL: the command is a short bootstrap (`BOOT`) that reads
  SOURCE and CONFIG from stdin (`boot_input`), then runs the same source with CONFIG as its
  argument. The program's stdin follows on the same stream; its stdout and stderr are pipes the
  launcher forwards as frames (`o`, `e`), the report as frames of its own (`r`); the launcher
  stops the program at its output limit and its wall-clock limit, and, when it ends, kills every
  other process of the sandbox's user (there is no PID namespace per call in a pod) and empties
  the pod's temporary folders. The ending line then also says `left` (processes that survived 2 s
  of SIGKILL: 0 unless one is stuck in the kernel), `folder_bytes`, `oom_kill` (the container's
  OOM kills during the call) and `stopped` (a limit the launcher enforced). The same source also
  writes a workspace's files (`mode: write`) and runs the cleanup alone (`mode: cleanup`).
"""

import json
from pathlib import Path
from typing import Any

from dagster_rl.sandbox.limits import SandboxLimits
from dagster_rl.sandbox.outcomes import ENV, WORK

MIB = 1 << 20
POD_PROCESSES = 2  # the pod's init and the launcher count against the user's process limit in a pod


def rlimits(limits: SandboxLimits, extra_processes: int = 0) -> dict[str, list[int]]:
    """The rlimits of a program (name in `resource` -> [soft, hard]). CPU: SIGXCPU at the limit, and
    SIGKILL a second later for a program that catches it. No core files."""
    cpu = max(1, round(limits.cpu_s))
    return {
        "RLIMIT_CPU": [cpu, cpu + 1],
        "RLIMIT_AS": [limits.memory_mb * MIB] * 2,
        "RLIMIT_NPROC": [limits.processes + extra_processes] * 2,
        "RLIMIT_NOFILE": [limits.open_files] * 2,
        "RLIMIT_FSIZE": [limits.file_size_mb * MIB] * 2,
        "RLIMIT_CORE": [0, 0],
    }


SOURCE = (Path(__file__).with_name("launcher_main.py")).read_text()

# Reads `boot_input` from stdin: two 10-digit lengths, the launcher's source, its config; then runs it.
BOOT = (
    "import os,sys\n"
    "def r(n):\n"
    " b=bytearray()\n"
    " while len(b)<n:\n"
    "  c=os.read(0,n-len(b))\n"
    "  if not c:raise SystemExit('dagster-rl launcher: stdin ended early')\n"
    "  b+=c\n"
    " return bytes(b)\n"
    "h=r(20)\n"
    "s=r(int(h[:10]))\n"
    "sys.argv=['-c',r(int(h[10:])).decode()]\n"
    "exec(compile(s,'<dagster-rl launcher>','exec'),{'__name__':'__main__'})\n"
)


def boot_input(config: dict[str, Any], then: bytes = b"") -> bytes:
    """What the bootstrap reads on stdin: the launcher's source and `config`, then `then` (the
    program's stdin, or a file's bytes)."""
    source, text = SOURCE.encode(), json.dumps(config).encode()
    return b"%010d%010d" % (len(source), len(text)) + source + text + then


def framed_run(argv: list[str], limits: SandboxLimits, stdin_bytes: int) -> dict[str, Any]:
    """The config of one program run in a pod."""
    return {
        "mode": "run",
        "framed": True,
        "argv": argv,
        "env": ENV,
        "rlimits": rlimits(limits, extra_processes=POD_PROCESSES),
        "stdin_bytes": stdin_bytes,
        "output_bytes": limits.output_bytes,
        "wall_s": limits.wall_s,
        "folder": WORK,
    }


def framed_write(name: str, size: int, mode: int) -> dict[str, Any]:
    """The config of a file written into a pod's workspace (`name` checked by the caller)."""
    return {"mode": "write", "path": f"{WORK}/{name}", "size": size, "file_mode": mode}


CLEANUP = {"mode": "cleanup"}
