"""How far a benchmark is from what this machine can do, measured in the same run.

`measure(threads)` times this machine's matrix multiply (square products of 256 to 1,024; float32, and
bfloat16 where the CPU computes it natively: `avx512_bf16` or AMX) and its memory read bandwidth (a matrix-vector product over
256 MiB: how decoding streams weights), at the thread count the benchmark's engines use, best of
several tries (a peak: what the machine gives when nothing else is in the way).

Then, for a causal LM's config (`Shape.of`):

- `train_flops`: the useful FLOPs of a LoRA update over sequences (forward 2N per token of the frozen
  body, backward 2N for the activations' gradients, no weight gradient of the frozen base, attention
  over the causal context, the head only on the positions that predict a completion token, the
  adapter's forward and both its gradients); padding counts for nothing. Divided by the update's
  seconds and the float32 peak: the fraction of the peak the step reaches;
- `decode_roofline`: the tokens/s a batch of `rows` sequences could decode at most: each step reads
  every weight once (the head included) and each row's KV cache, and computes 2N per row, so a step
  takes at least max(bytes / bandwidth, FLOPs / peak).

    from roofline import measure, Shape, train_flops, decode_roofline
"""

import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch


def cpu_name() -> str:
    """The CPU's model name and the flags that decide its kernels (AVX-512, bf16, AMX)."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), platform.processor())
    flags = set(next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []))
    shown = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    return f"{name} ({os.cpu_count()} cores; {' '.join(shown) or 'no AVX2'})"


def native_bf16() -> bool:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return any(f in text for f in (" avx512_bf16", " amx_bf16"))


def _best_seconds(fn, seconds: float) -> float:
    fn()  # warm-up
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_gflops(dtype: torch.dtype, n: int = 1024, seconds: float = 1.0) -> float:
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n**3 / _best_seconds(lambda: torch.mm(a, b), seconds) / 1e9


def matmul_peak(dtype: torch.dtype, seconds: float = 1.0) -> float:
    """The best of square products of 256, 512 and 1,024: measured here, the larger ones lose most to
    other work sharing the caches, the smaller ones to their overheads."""
    return max(matmul_gflops(dtype, n, seconds / 3) for n in (256, 512, 1024))


def read_bandwidth_gbs(mib: int = 256, seconds: float = 1.0) -> float:
    n = int((mib * 2**20 / 4) ** 0.5)
    w, x = torch.randn(n, n), torch.randn(n)
    return w.numel() * 4 / _best_seconds(lambda: torch.mv(w, x), seconds) / 1e9


@dataclass(frozen=True)
class Machine:
    cpu: str
    threads: int
    fp32_gflops: float
    bf16_gflops: float | None  # None: no native bfloat16 on this CPU
    bandwidth_gbs: float
    load: float  # load average when measured

    def line(self) -> str:
        bf16 = f"{self.bf16_gflops:.0f}" if self.bf16_gflops is not None else "not native"
        return (
            f"machine: {self.cpu}; at {self.threads} thread(s): matmul peak float32 {self.fp32_gflops:.0f} GFLOP/s, "
            f"bfloat16 {bf16}; read bandwidth {self.bandwidth_gbs:.1f} GB/s (load average {self.load:.1f})"
        )


def measure(threads: int, seconds: float = 1.0) -> Machine:
    """This machine's peaks at `threads` torch threads (the benchmark's own count is restored)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fp32 = matmul_peak(torch.float32, seconds=seconds)
        bf16 = matmul_peak(torch.bfloat16, seconds=seconds) if native_bf16() else None
        bandwidth = read_bandwidth_gbs(seconds=seconds)
    finally:
        torch.set_num_threads(before)
    return Machine(cpu_name(), threads, fp32, bf16, bandwidth, os.getloadavg()[0])


@dataclass(frozen=True)
class Shape:
    """What the FLOP and byte counts need of a Llama/Qwen2-like causal LM."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, config) -> "Shape":
        c = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = c.num_attention_heads
        return cls(
            c.hidden_size,
            c.num_hidden_layers,
            heads,
            getattr(c, "num_key_value_heads", None) or heads,
            getattr(c, "head_dim", None) or c.hidden_size // heads,
            c.intermediate_size,
            c.vocab_size,
        )

    def projections(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear layer of a decoder layer."""
        d, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
                "gate_proj": (d, i), "up_proj": (d, i), "down_proj": (i, d)}  # fmt: skip

    @property
    def body_params(self) -> int:
        """Weights of the decoder layers' linear maps: 2 FLOPs each per token."""
        return self.layers * sum(a * b for a, b in self.projections().values())

    @property
    def head_params(self) -> int:
        return self.hidden * self.vocab

    def kv_bytes_per_token(self, bytes_per_value: int = 4) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * bytes_per_value


def train_flops(shape: Shape, sequences: list[tuple[int, int]], lora_rank: int, targets: tuple[str, ...]) -> float:
    """Useful FLOPs of one LoRA update's forward and backward over `sequences`, each (tokens, predicted
    completion tokens): no reference forward, no padding."""
    lora = sum(lora_rank * (a + b) for name, (a, b) in shape.projections().items() if name in targets) * shape.layers
    attention = 2 * 2 * shape.layers * shape.heads * shape.head_dim  # QK^T and AV, per (query, key) pair
    total = 0.0
    for tokens, kept in sequences:
        pairs = tokens * (tokens + 1) / 2  # causal: a query attends to itself and what precedes it
        forward = 2 * shape.body_params * tokens + attention * pairs + 2 * shape.head_params * kept + 2 * lora * tokens
        backward = 2 * shape.body_params * tokens + 2 * attention * pairs + 2 * shape.head_params * kept + 4 * lora * tokens
        total += forward + backward
    return total


def decode_roofline(machine: Machine, shape: Shape, rows: int, context: float, bytes_per_value: int = 4) -> float:
    """Most tokens/s a batch of `rows` sequences of mean `context` tokens decodes, one token per row a step."""
    weights = (shape.body_params + shape.head_params) * bytes_per_value
    read = weights + rows * context * shape.kv_bytes_per_token(bytes_per_value)
    flops = rows * (2 * (shape.body_params + shape.head_params) + 4 * shape.layers * shape.heads * shape.head_dim * context)
    step_s = max(read / (machine.bandwidth_gbs * 1e9), flops / (machine.fp32_gflops * 1e9))
    return rows / step_s


def decode_seconds_bound(
    machine: Machine, shape: Shape, prompt: float, completions: list[int], bytes_per_value: int = 4
) -> float:
    """Least seconds any engine needs to decode `completions` (each row's tokens) one token per live row a
    step, rows of mean `prompt` tokens: a step reads every weight once and each live row's KV cache, and
    computes 2N per live row. A row that ended costs nothing (the bound of an engine that drops it)."""
    weights = (shape.body_params + shape.head_params) * bytes_per_value
    total = 0.0
    for t in range(max(completions, default=0)):
        live = sum(c > t for c in completions)
        read = weights + live * (prompt + t) * shape.kv_bytes_per_token(bytes_per_value)
        flops = live * (
            2 * (shape.body_params + shape.head_params) + 4 * shape.layers * shape.heads * shape.head_dim * (prompt + t)
        )
        total += max(read / (machine.bandwidth_gbs * 1e9), flops / (machine.fp32_gflops * 1e9))
    return total
