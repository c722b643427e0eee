"""What a sandbox call costs on each path this machine can run, against a bare `python3 -c` in a
subprocess: the local placement (bubblewrap), and the Kubernetes placement's exec path against the
FAKE cluster (tests/fake_pods.py: the real websocket client, a websocket server, nsenter into a pod's
namespaces, the same launcher in its pod mode). And what a fake pod takes to start: namespaces only.

What it cannot measure is a real cluster's: the API server and kubelet in the exec's path (add their
round trips), and a real pod's start (scheduling, the sandbox of its runtime class, the image),
which Kubernetes' SLO puts at up to 5 s at the 99th percentile for a pod whose image is on the node
(kubernetes/community, sig-scalability/slos/pod_startup_latency.md). Needs root (the fake kubelet).

    .venv/bin/python bench/sandbox_pods.py [--repeats 20]
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dagster_rl.sandbox.bubblewrap import BubblewrapSandboxes
from dagster_rl.sandbox.calls import Program
from dagster_rl.sandbox.limits import SandboxLimits
from dagster_rl.sandbox.pod_manifest import PodSandboxSettings
from dagster_rl.sandbox.pods import PodSandboxes
from tests.fake_kubernetes import FakeKubernetes

PROGRAM = "print(6 * 7)"


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def row(name: str, seconds: list[float]) -> None:
    ms = sorted(s * 1000 for s in seconds)
    print(f"{name:<44} median {statistics.median(ms):7.1f} ms   p90 {ms[int(0.9 * (len(ms) - 1))]:7.1f} ms   n={len(ms)}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/sandbox_pods.py: the fake kubelet needs root")
    limits = SandboxLimits()
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    row(
        "bare python3 -c (subprocess)",
        timed(lambda: subprocess.run(["/usr/bin/python3", "-c", PROGRAM], check=True, capture_output=True), args.repeats),
    )
    root = Path(tempfile.mkdtemp(prefix="sandboxes-"))
    root.chmod(0o711)
    local = BubblewrapSandboxes(root)
    with local.open("bench") as ws:
        row("bubblewrap: one call", timed(lambda: ws.run(Program(python=PROGRAM), limits), args.repeats))
    fake = FakeKubernetes()
    try:
        settings = PodSandboxSettings(namespace="bench", image="python", pool_size=0, poll_interval_s=0.01)
        pods = PodSandboxes(settings, max_concurrency=2, api=fake.core, exec_api=fake.exec_api())
        row("fake pod: start (namespaces only) + delete", timed(lambda: pods.open("bench").close(), max(3, args.repeats // 4)))
        with pods.open("bench") as ws:
            row("fake pod: one call (websocket exec)", timed(lambda: ws.run(Program(python=PROGRAM), limits), args.repeats))
            row("fake pod: a 1 MiB file written", timed(lambda: ws.write("blob", b"x" * (1 << 20)), max(3, args.repeats // 4)))
        pods.close()
    finally:
        fake.close()


if __name__ == "__main__":
    main()
