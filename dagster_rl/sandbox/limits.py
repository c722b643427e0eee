"""What one program in a sandbox may use: CPU seconds, memory, processes, open files, file size,
output, wall time, and the bytes its episode's folder may hold.

CPU time is the limit the policy controls (an endless loop always ends at it, whatever else the
machine runs); the wall-clock limit is a backstop for a program that sleeps or blocks. Every
number is bounded: past the bound it is a typo, not a setting.
"""

from pydantic import Field

from dagster_rl.base.strict import Strict

MAX_CPU_S = 3600.0
MAX_MEMORY_MB = 1 << 20  # 1 TiB of address space
MAX_PROCESSES = 4096
MAX_OPEN_FILES = 65_536
MAX_FILE_MB = 1 << 16
MAX_OUTPUT_BYTES = 1 << 24


class SandboxLimits(Strict):
    """Limits of one program run in a sandbox (a tool call). Each is enforced by the placement: on
    this machine by bubblewrap and rlimits, in a pod by the pod's limits and the same rlimits."""

    cpu_s: float = Field(5.0, gt=0.0, le=MAX_CPU_S, description="CPU seconds of the program and its children (the timeout)")
    wall_s: float = Field(20.0, gt=0.0, le=MAX_CPU_S * 4, description="wall-clock backstop for a program that sleeps or blocks")
    memory_mb: int = Field(512, ge=16, le=MAX_MEMORY_MB, description="address space of each process, in MiB")
    processes: int = Field(32, ge=1, le=MAX_PROCESSES, description="processes and threads running at once")
    open_files: int = Field(64, ge=8, le=MAX_OPEN_FILES, description="open file descriptors of each process")
    file_size_mb: int = Field(16, ge=1, le=MAX_FILE_MB, description="the largest file a process may write, in MiB")
    folder_mb: int = Field(
        64,
        ge=1,
        le=MAX_FILE_MB,
        description="what the episode's folder may hold after a call, in MiB; over it, the call ends as disk_limit",
    )
    output_bytes: int = Field(
        4096,
        ge=64,
        le=MAX_OUTPUT_BYTES,
        description="bytes kept of stdout, and of stderr; past it the program is stopped (output_limit)",
    )
