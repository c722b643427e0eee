"""Whether this CPU computes bfloat16 natively: checked when a bfloat16 policy loads on the CPU.

x86 CPUs compute bfloat16 matrix products natively with AVX512-BF16 (`avx512_bf16`, e.g. AMD Zen 4,
Intel Cooper Lake and later) or AMX (`amx_bf16`, Intel Sapphire Rapids and later). Without either,
torch emulates bfloat16 in float32 arithmetic (slower than float32 itself), and vLLM's CPU build
stops with an illegal instruction (SIGILL) in its bfloat16 kernels. So a bfloat16 policy on such a
CPU is refused when it loads, with what to do, rather than run slowly or die later.

The CPU's features are what torch detects (`torch.cpu.get_capabilities()`, cpuinfo: the hardware,
whatever `ATEN_CPU_CAPABILITY` selects for torch's kernels; checked with torch 2.13). Other
architectures (ARM), and a torch without that function, are not checked.
"""

import platform
from functools import lru_cache

from dagster_rl.base.errors import DagsterRLError

BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU features torch detects (e.g. `avx2`, `avx512_f`, `avx512_bf16`); empty where it cannot say."""
    import torch

    capabilities = getattr(torch.cpu, "get_capabilities", None)
    if capabilities is None:
        return frozenset()
    return frozenset(name for name, value in capabilities().items() if value is True)


def check_bf16_cpu(what: str) -> None:
    """Refuse bfloat16 on an x86 CPU without native bfloat16 (`what`: who asked, for the message)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return
    flags = cpu_flags()
    if not flags or any(f in flags for f in BF16_FLAGS):
        return
    has = ", ".join(f for f in ("avx512_f", "avx2") if f in flags) or "neither avx2 nor avx512_f"
    raise DagsterRLError(
        f"{what} is bfloat16, and this CPU has no native bfloat16 ({' or '.join(BF16_FLAGS)}; it has {has}): torch would "
        "emulate it, slower than float32, and vLLM's CPU build would stop with an illegal instruction (SIGILL). "
        "Set policy.dtype: float32, or run where the CPU (or a GPU) has bfloat16."
    )
