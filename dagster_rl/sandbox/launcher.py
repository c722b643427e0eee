"""The launcher: the first process inside a sandbox, in either placement. It sets the program's
rlimits, starts it, waits for it, and reports how it ended on a file descriptor of its own.

It is plain standard-library Python, run by the sandbox's interpreter as `python3 -I -S -c SOURCE
CONFIG` (the source travels as an argument: no file of the project is visible in a sandbox), where
CONFIG is JSON: the program's arguments, its limits, and the descriptor to report on. Its report is
JSON lines: `{"started": true}` first (the sandbox was made), then, when the program has ended,
one of

    {"exit": 0, "cpu_s": 0.02}      the program exited (its status)
    {"signal": 24, "cpu_s": 5.01}   a signal ended it (24: SIGXCPU, its CPU seconds ran out)
    {"exec_error": "..."}           the program could not be started (no such command, say),
                                    followed by {"exit": 127, ...}

The limits are set in the program's process, after the fork and before `exec`: the launcher itself
stays outside them, so it can report a program that used them up. What the launcher cannot report,
because it is killed too, the host side knows instead (the wall-clock backstop, the output limit).
"""

from pathlib import Path

from dagster_rl.sandbox.limits import SandboxLimits

MIB = 1 << 20


def rlimits(limits: SandboxLimits) -> dict[str, list[int]]:
    """The rlimits of a program (name in `resource` -> [soft, hard]). CPU: SIGXCPU at the limit, and
    SIGKILL a second later for a program that catches it. No core files."""
    cpu = max(1, round(limits.cpu_s))
    return {
        "RLIMIT_CPU": [cpu, cpu + 1],
        "RLIMIT_AS": [limits.memory_mb * MIB] * 2,
        "RLIMIT_NPROC": [limits.processes] * 2,
        "RLIMIT_NOFILE": [limits.open_files] * 2,
        "RLIMIT_FSIZE": [limits.file_size_mb * MIB] * 2,
        "RLIMIT_CORE": [0, 0],
    }


SOURCE = (Path(__file__).with_name("launcher_main.py")).read_text()
