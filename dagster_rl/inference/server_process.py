"""An inference server this process starts and stops (`python -m vllm.entrypoints.openai.api_server
...`, or `dagster-rl serve ...`): start it, wait until its /health answers and it generates a token,
stop it at the end.

Healthy is not enough: vLLM's CPU build answers /health for a model its attention kernels cannot
run (a head size other than 32, 64, 80, ...) and fails every generation with HTTP 500. So the
start ends with one greedy token of the base model, and a server that cannot make it is stopped and
reported with what it said.
"""

import os
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from dagster_rl.base.errors import DagsterRLError
from dagster_rl.inference.http_json import EndpointError
from dagster_rl.inference.vllm_client import ServerReplyError, ServerSampling, VLLMClient

# the folders `dagster-rl serve` may load adapters from, besides its --adapter-root flags (os.pathsep between
# them): a rollout environment that starts a server sets it to the folders its backend loads adapters from
ADAPTER_ROOTS_ENV = "DAGSTER_RL_ADAPTER_ROOTS"

# vLLM 0.32's CPU attention (CPUAttentionBackend.get_supported_head_sizes)
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def vllm_cpu_command(
    model: str,
    port: int,
    *,
    python: str = "python",
    host: str = "127.0.0.1",
    dtype: str = "float32",
    max_lora_rank: int = 8,
    max_loras: int = 4,
    generation_config: str | None = "vllm",
    served_model_name: str | None = None,
    threads: int | None = None,
    logprobs_mode: str = "processed_logprobs",
    max_model_len: int | None = None,
    kvcache_gib: int = 1,
    prefix_block: int = 32,
) -> list[str]:
    """vLLM's CPU build (`vllm-cpu`, whose `vllm` console script does not start) serving `model` for the
    `openai_server` backend: LoRA on (the environment sets VLLM_ALLOW_RUNTIME_LORA_UPDATING), the
    log-probs the trainer scores (`processed_logprobs`), and (`generation_config="vllm"`) no sampling
    defaults from the model folder. 1 GiB of KV cache and no thread pinning suit a laptop or a shared
    machine. `generation_config=None` keeps vLLM's default (the folder's): the tests do, to show the
    requests alone keep rollouts on-policy. `threads`: its torch threads (default: one per core).
    `max_model_len`: the longest prompt + completion it serves (default: the model's context; a
    real model's 8,192 tokens reserve KV cache for sequences no rollout reaches); `kvcache_gib`: its
    KV cache (VLLM_CPU_KVCACHE_SPACE). Chunked prefill is off: vLLM 0.32's CPU build dies
    (`RuntimeError: CPU Generator does not use offset`, the engine dead, every request HTTP 500) when
    it splits the prompt of a seeded request, which it does once the prompts in flight hold more
    than its 2,048 batched tokens (64 SmolLM2 rollouts of a step do). Prefix caching is on, named
    (vLLM 0.32 turns it on by default, a default that may move), with blocks of `prefix_block` tokens:
    vLLM reuses whole blocks only, and its CPU build's default block of 128 tokens is longer than a
    whole agent episode here, so an episode's next turn would compute its whole sequence again."""
    return [
        "env", f"VLLM_CPU_KVCACHE_SPACE={kvcache_gib}", "VLLM_CPU_OMP_THREADS_BIND=nobind", *([f"OMP_NUM_THREADS={threads}"] if threads else []),
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", host, "--port", str(port),
        f"--dtype={dtype}", "--enable-lora", f"--max-lora-rank={max_lora_rank}", f"--max-loras={max_loras}",
        f"--logprobs-mode={logprobs_mode}", "--no-enable-chunked-prefill", "--enable-prefix-caching", f"--block-size={prefix_block}",
        *([f"--generation-config={generation_config}"] if generation_config else []),
        *([f"--served-model-name={served_model_name}"] if served_model_name else []),
        *([f"--max-model-len={max_model_len}"] if max_model_len else []),
    ]  # fmt: skip


class ServerStartError(DagsterRLError):
    """The inference server did not come up."""


class ManagedServer:
    def __init__(
        self,
        command: list[str],
        client: VLLMClient,
        startup_timeout_s: float = 600.0,
        log_dir: str | None = None,
        env: dict[str, str] | None = None,
    ):
        if not command:
            raise ValueError(
                "a managed server needs a command, e.g. ['vllm', 'serve', '<model>', '--enable-lora', '--port', '8000']"
            )
        self.command, self.client, self.startup_timeout_s = list(command), client, startup_timeout_s
        self.log_path = Path(tempfile.mkstemp(prefix="rollout-server-", suffix=".log", dir=log_dir)[1])
        self.proc: subprocess.Popen | None = None
        self.env = dict(env or {})

    def start(self) -> "ManagedServer":
        if self.client.healthy():
            raise ServerStartError(
                f"something already answers at {self.client.root}/health: stop it, or unset the rollout environment's "
                "server_command to use it as it is"
            )
        env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", **self.env}  # vLLM's switch for /v1/load_lora_adapter
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(
                    f"{' '.join(self.command)} exited {self.proc.returncode} before it was healthy:\n{self.log_tail()}"
                )
            if self.client.healthy():
                self._first_token()
                return self
            time.sleep(0.5)
        self.stop()
        raise ServerStartError(
            f"{' '.join(self.command)} was not healthy at {self.client.root}/health within {self.startup_timeout_s} s:\n{self.log_tail()}"
        )

    def _first_token(self) -> None:
        """Generate one greedy token of the base model; stop the server and say why when it cannot."""
        try:
            base = next(c["id"] for c in self.client.models() if not c.get("parent"))
            self.client.complete(
                base, [0], ServerSampling(temperature=0.0, top_p=1.0, max_tokens=1, stop_token_ids=()), seed=0, vocab=None
            )
        except (EndpointError, ServerReplyError, StopIteration) as e:
            said = str(e) if not isinstance(e, StopIteration) else "no base model in /v1/models"
            if self.proc is not None:  # vLLM logs the engine's error as it dies: let it finish
                try:
                    self.proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    pass
            log = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
            # vLLM answers 500 "EngineCore encountered an issue" and logs the cause, e.g.
            # "RuntimeError: Unsupported CPU attention configuration: head_dim=16 isa=2 kv_cache_idx=0"
            causes = list(
                dict.fromkeys(
                    m.group(0).strip()
                    for m in re.finditer(r"(?<![`\w])\w+Error: [^\n`]*|Worker proc \S+ died unexpectedly[^\n]*", log)
                )
            )[:3]
            hint = ""
            if re.search(r"head_dim|head_size|head size", said + "\n".join(causes)):
                hint = (
                    f" vLLM's CPU attention runs head sizes {', '.join(map(str, VLLM_CPU_HEAD_SIZES))} only (the model's "
                    "hidden_size / num_attention_heads, or its head_dim): serve a model with one of them, or use a GPU."
                )
            elif any(
                "died unexpectedly" in c for c in causes
            ):  # measured: vllm-cpu 0.32, --dtype bfloat16, a VM's Xeon (avx512_bf16, amx_bf16)
                hint = (
                    " A vLLM worker process died as it generated: with vLLM's CPU build and --dtype bfloat16 that is a SIGILL "
                    "(exit code -4) on a CPU that cannot run its bf16 kernels; --dtype float32 runs."
                )
            self.stop()
            raise ServerStartError(
                f"the rollout server answered /health but could not generate a token of its base model: {said}.{hint}"
                + "".join(f"\nits log: {c}" for c in causes)
                + f"\ncommand: {' '.join(self.command)}\nlog ({self.log_path}), its end:\n{log[-4000:]}"
            ) from None

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def stop(self, grace_s: float = 30.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
