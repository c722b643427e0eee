"""A real vLLM server (the CPU build in .venv-vllm, `make vllm`) for the tests, on 127.0.0.1:

    def test_x(vllm): vllm.base_url, vllm.model, vllm.client, vllm.log()  # one server for the session

It is started and stopped the way a run does it: by a `RolloutEnvironment` with `server_command`
(the managed start waits for /health and a first token; the stop ends its process group), on a
model folder built in code (`builtin:tiny-qwen2-vllm`: head size 32, Qwen2.5-Instruct's sampling
defaults in its generation_config.json). The server keeps vLLM's default `--generation-config
auto`, so those defaults apply to every field a request leaves out: the requests alone must keep
rollouts on-policy. `--logprobs-mode processed_logprobs`, as deploy/k8s/vllm.yaml.

Without .venv-vllm the tests that use it skip, unless env CI is set: then they fail, so a CI that
lost vLLM cannot pass by skipping.
"""

import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests import REPO
from tests.machine import free_port, missing

if TYPE_CHECKING:  # imported where used: a plugin of every test session stays light to import
    from dagster_rl.inference.vllm_client import VLLMClient
    from resources import RolloutEnvironment

VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
STARTUP_TIMEOUT_S = 900.0  # ~1-2.5 min on 2 shared cores; more while tests load the machine
LOADED = re.compile(r"Loaded new LoRA adapter: name '([^']+)', path '([^']+)'")  # vLLM's log line, per adapter


def require_vllm() -> str:
    """.venv-vllm's python; skip the test when it is absent, fail instead under CI."""
    if not VLLM_PYTHON.exists():
        missing(f"vLLM's CPU build is not installed at {VLLM_PYTHON.parent.parent}: run `make vllm`")
    return str(VLLM_PYTHON)


def vllm_model(folder: Path) -> Path:
    from dagster_rl.tasks.lm.model.tiny import save_tiny_model

    return save_tiny_model(folder, builtin="tiny-qwen2-vllm")


@dataclass
class RealVLLM:
    environment: "RolloutEnvironment"  # the one that started it (and stops it at the end of the session)
    model: str  # the model folder: /v1/models names the base model by it
    started_in_s: float

    @property
    def base_url(self) -> str:
        return self.environment.base_url

    @property
    def client(self) -> "VLLMClient":
        from dagster_rl.inference.vllm_client import VLLMClient

        return VLLMClient(self.base_url, timeout_s=120)

    def log(self) -> str:
        server = self.environment._server
        return server.log_path.read_text(errors="replace") if server is not None else ""

    def shared(self, **limits) -> "RolloutEnvironment":
        """A rollout environment for a test's runs: this server as someone else's (no command: a run's end leaves it up)."""
        from resources import RolloutEnvironment

        return RolloutEnvironment(base_url=self.base_url, request_timeout_s=120, **{"max_concurrency": 8, **limits})


@contextmanager
def started_vllm(model: Path, max_lora_rank: int = 8) -> Iterator[RealVLLM]:
    """A real vLLM serving the model folder `model` (adapters up to `max_lora_rank`), started and
    stopped by a rollout environment."""
    from dagster_rl.inference.server_process import vllm_cpu_command
    from resources import RolloutEnvironment

    python = require_vllm()
    port = free_port()
    # generation_config None: vLLM's default, the folder's sampling defaults (the requests must override them)
    command = vllm_cpu_command(str(model), port, python=python, generation_config=None, max_lora_rank=max_lora_rank)
    env = RolloutEnvironment(
        base_url=f"http://127.0.0.1:{port}/v1", server_command=command, server_startup_timeout_s=STARTUP_TIMEOUT_S
    )
    t0 = time.monotonic()
    env.endpoint().start([])  # what a backend calls before its first request (vLLM ignores the adapter roots)
    server = RealVLLM(env, str(model), time.monotonic() - t0)
    print(f"\nvLLM ready in {server.started_in_s:.0f} s at {server.base_url}")
    try:
        yield server
    finally:
        proc = env._server.proc if env._server is not None else None
        env.teardown_after_execution(None)  # what the end of a run calls
    assert proc is not None and proc.poll() is not None and not server.client.healthy(), "the managed vLLM did not stop"


@pytest.fixture(scope="session")
def vllm(tmp_path_factory):
    require_vllm()
    with started_vllm(vllm_model(tmp_path_factory.mktemp("vllm-model") / "tiny-qwen2-vllm")) as server:
        yield server
