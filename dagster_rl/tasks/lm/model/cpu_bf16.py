"""Whether this CPU computes bfloat16 natively: checked when a bfloat16 policy loads on the CPU.

x86 CPUs compute bfloat16 matrix products natively with AVX512-BF16 (`avx512_bf16`, e.g. AMD Zen 4,
Intel Cooper Lake and later) or AMX (`amx_bf16`, Intel Sapphire Rapids and later). Without either,
torch emulates bfloat16 in float32 arithmetic (slower than float32 itself), and vLLM's CPU build
stops with an illegal instruction (SIGILL) in its bfloat16 kernels. So a bfloat16 policy on such a
CPU is refused when it loads, with what to do, rather than run slowly or die later. Other
architectures (ARM, or a system without /proc/cpuinfo) are not checked.
"""

import platform
from functools import lru_cache
from pathlib import Path

from dagster_rl.core.errors import DagsterRLError

BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (Linux, x86); empty where there are none to read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def check_bf16_cpu(what: str) -> None:
    """Refuse bfloat16 on an x86 CPU without native bfloat16 (`what`: who asked, for the message)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return
    flags = cpu_flags()
    if not flags or any(f in flags for f in BF16_FLAGS):
        return
    has = ", ".join(f for f in ("avx512f", "avx2") if f in flags) or "neither avx2 nor avx512f"
    raise DagsterRLError(
        f"{what} is bfloat16, and this CPU has no native bfloat16 ({' or '.join(BF16_FLAGS)}; it has {has}): torch would "
        "emulate it, slower than float32, and vLLM's CPU build would stop with an illegal instruction (SIGILL). "
        "Set policy.dtype: float32, or run where the CPU (or a GPU) has bfloat16."
    )
