"""An inference server this process starts and stops: `vllm serve ...` where a machine has vLLM and
a GPU (or `dagster-rl serve ...`): start it, wait until its /health answers, stop it at the end."""

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from dagster_rl.errors import DagsterRLError
from dagster_rl.vllm_client import VLLMClient


class ServerStartError(DagsterRLError):
    """The inference server did not come up."""


class ManagedServer:
    def __init__(self, command: list[str], client: VLLMClient, startup_timeout_s: float = 600.0, log_dir: str | None = None):
        if not command:
            raise ValueError("a managed server needs a command, e.g. ['vllm', 'serve', '<model>', '--enable-lora', '--port', '8000']")
        self.command, self.client, self.startup_timeout_s = list(command), client, startup_timeout_s
        self.log_path = Path(tempfile.mkstemp(prefix="rollout-server-", suffix=".log", dir=log_dir)[1])
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ManagedServer":
        if self.client.healthy():
            raise ServerStartError(
                f"something already answers at {self.client.root}/health: stop it, or unset the rollout environment's "
                "server_command to use it as it is"
            )
        env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}  # vLLM's switch for /v1/load_lora_adapter
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(f"{' '.join(self.command)} exited {self.proc.returncode} before it was healthy:\n{self.log_tail()}")
            if self.client.healthy():
                return self
            time.sleep(0.5)
        self.stop()
        raise ServerStartError(f"{' '.join(self.command)} was not healthy at {self.client.root}/health within {self.startup_timeout_s} s:\n{self.log_tail()}")

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
