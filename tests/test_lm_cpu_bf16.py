"""bfloat16 on a CPU without native bfloat16 is refused when the policy loads, saying what to do."""

from pathlib import Path

import pytest
import torch

from dagster_rl.base.errors import DagsterRLError
from dagster_rl.tasks.lm.model import cpu_bf16
from dagster_rl.tasks.lm.model.policy import load_policy
from dagster_rl.tasks.lm.settings import PolicySettings


@pytest.fixture
def cpu(monkeypatch):
    def with_flags(*flags: str) -> None:
        monkeypatch.setattr(cpu_bf16.platform, "machine", lambda: "x86_64")
        monkeypatch.setattr(cpu_bf16, "cpu_flags", lambda: frozenset(flags))

    return with_flags


def test_bfloat16_on_a_cpu_without_it_is_refused_at_load(cpu, tiny_dir):
    cpu("sse4_2", "avx2", "fma")
    with pytest.raises(
        DagsterRLError,
        match=r"policy.dtype is bfloat16, and this CPU has no native bfloat16 \(avx512_bf16 or amx_bf16; it has avx2\).*SIGILL.*float32",
    ):
        load_policy(PolicySettings(base_model=str(tiny_dir), dtype="bfloat16"), device=torch.device("cpu"))
    load_policy(PolicySettings(base_model=str(tiny_dir), dtype="float32"), device=torch.device("cpu"))  # float32 runs anywhere


@pytest.mark.parametrize("flag", ["avx512_bf16", "amx_bf16"])
def test_bfloat16_loads_where_the_cpu_has_it(cpu, tiny_dir, flag):
    cpu("avx2", "avx512_f", flag)
    policy = load_policy(PolicySettings(base_model=str(tiny_dir), dtype="bfloat16"), device=torch.device("cpu"))
    assert next(policy.model.get_base_model().parameters()).dtype == torch.bfloat16


def test_the_features_torch_detects_are_the_kernels_flags_here():
    """torch's detection answers what /proc/cpuinfo's flags say, on this machine (Linux, x86)."""
    try:
        line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        pytest.skip("no x86 flags in /proc/cpuinfo here")
    kernel = set(line.split(":", 1)[1].split())
    torch_says = cpu_bf16.cpu_flags()
    for kernel_name, torch_name in [
        ("avx512_bf16", "avx512_bf16"),
        ("amx_bf16", "amx_bf16"),
        ("avx512f", "avx512_f"),
        ("avx2", "avx2"),
    ]:
        assert (kernel_name in kernel) == (torch_name in torch_says), kernel_name
