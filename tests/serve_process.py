"""`dagster-rl serve` as the tests run it: a subprocess on 127.0.0.1 and a free port."""

import json
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from dagster_rl.inference.http_json import EndpointError, JSONEndpoint
from dagster_rl.inference.vllm_client import VLLMClient
from tests import REPO
from tests.machine import free_port
from tests.servers import executable


def serve_command(port: int, model: str = "builtin:tiny-qwen2", adapter_roots: Sequence[str] = (), *extra: str) -> list[str]:
    """`dagster-rl serve` on 127.0.0.1:port; adapters from `adapter_roots` (a rollout environment that
    starts it adds the folders its backend loads from, through DAGSTER_RL_ADAPTER_ROOTS)."""
    roots = [a for r in adapter_roots for a in ("--adapter-root", str(r))]
    return [executable("dagster-rl"), "serve", "--model", model, "--host", "127.0.0.1", "--port", str(port), *roots, *extra]


class ServeProcess:
    """with ServeProcess(log_dir, adapter_roots=[...]) as server: server.base_url, server.client, server.log()"""

    def __init__(
        self, log_dir: Path, model: str = "builtin:tiny-qwen2", adapter_roots: Sequence[str] = (), extra: Sequence[str] = ()
    ):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.client = VLLMClient(self.base_url, timeout_s=30)
        self.log_path = log_dir / f"serve-{self.port}.log"
        self.command = serve_command(self.port, model, adapter_roots, *extra)
        self.proc: subprocess.Popen | None = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def __enter__(self) -> "ServeProcess":
        with self.log_path.open("wb") as out:
            self.proc = subprocess.Popen(
                self.command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy(), start_new_session=True
            )
        deadline = time.monotonic() + 120
        while not self.client.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"dagster-rl serve did not come up:\n{self.log()[-3000:]}")
            time.sleep(0.3)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(30)
        self.proc = None


def post(server: "ServeProcess", path: str, body, timeout_s: float = 600) -> tuple[int | None, object]:
    """POST `body` as JSON to the server's /v1`path`: (200, the reply's JSON or text), or (the status, its JSON error)."""
    with JSONEndpoint(server.base_url, timeout_s=timeout_s, who="test") as http:
        try:
            payload, raw = http.call_json("POST", path, body)
            return 200, payload if payload is not None else raw.decode()
        except EndpointError as e:
            return e.status, json.loads(e.body)
