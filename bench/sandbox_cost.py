"""What the sandbox costs: one program call in bubblewrap against a bare `python -c` in a subprocess,
and calls per second one at a time and several at once, on this machine.

Each row runs the same program (`print(737 * 361)`) `--calls` times and reports the median and p90 wall
time of one call and the calls per second. The rows:

- bare subprocess: `python3 -I -S -c ...`, the floor any out-of-process tool call pays
  (`-I -S`: no site packages, as the sandbox's launcher starts);
- bare subprocess, with site: `python3 -c ...`, what a plain `subprocess.run` pays;
- sandbox: one call of `BubblewrapWorkspace.run` (bubblewrap's namespaces and mounts, the launcher's
  rlimits, the program, the output read back and the folder checked), in one episode's workspace;
- sandbox, a workspace per call: the same, with the episode's folder made and removed around it;
- sandbox, N at once: `--threads` threads calling at once (calls per second is the machine's).

    .venv/bin/python bench/sandbox_cost.py                # 200 calls a row
    .venv/bin/python bench/sandbox_cost.py --calls 50 --threads 4
"""

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from dagster_rl.sandbox.bubblewrap import BubblewrapSandboxes
from dagster_rl.sandbox.calls import Program
from dagster_rl.sandbox.limits import SandboxLimits

SOURCE = "print(737 * 361)"


def timed(call, n: int, threads: int = 1) -> tuple[list[float], float]:
    """Each call's seconds, and the wall seconds of all of them."""

    def one(_: int) -> float:
        t0 = time.perf_counter()
        call()
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        each = list(pool.map(one, range(n)))
    return each, time.perf_counter() - t0


def row(name: str, each: list[float], wall: float) -> str:
    q = statistics.quantiles(each, n=10)
    return f"| {name} | {1000 * statistics.median(each):.1f} | {1000 * q[-1]:.1f} | {len(each) / wall:.1f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--python", default="/usr/bin/python3")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="sandbox-bench-"))
    root.chmod(0o711)
    sandboxes = BubblewrapSandboxes(root, python=args.python, max_concurrency=args.threads)
    sandboxes.check()
    limits = SandboxLimits()
    bare = [args.python, "-I", "-S", "-c", SOURCE]
    rows = []
    each, wall = timed(lambda: subprocess.run(bare, capture_output=True, check=True), args.calls)
    rows.append(row("bare subprocess (`python3 -I -S -c`)", each, wall))
    base = statistics.median(each)
    each, wall = timed(lambda: subprocess.run([args.python, "-c", SOURCE], capture_output=True, check=True), args.calls)
    rows.append(row("bare subprocess, with site (`python3 -c`)", each, wall))
    with sandboxes.open("bench") as ws:
        each, wall = timed(lambda: ws.run(Program(python=SOURCE), limits), args.calls)
        assert ws.run(Program(python=SOURCE), limits).stdout == f"{737 * 361}\n"
    rows.append(row("sandbox, one episode's workspace", each, wall))
    sandboxed = statistics.median(each)

    def fresh() -> None:
        with sandboxes.open("bench") as ws:
            ws.run(Program(python=SOURCE), limits)

    each, wall = timed(fresh, args.calls)
    rows.append(row("sandbox, a workspace per call", each, wall))
    each, wall = timed(fresh, args.calls, args.threads)
    rows.append(row(f"sandbox, {args.threads} at once", each, wall))
    print(
        f"\n{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; "
        f"{args.python} {platform.python_version() if args.python == sys.executable else ''}; {args.calls} calls a row\n"
    )
    print("| call | median ms | p90 ms | calls/s |")
    print("| --- | --- | --- | --- |")
    print("\n".join(rows))
    print(f"\nthe sandbox costs {1000 * (sandboxed - base):.1f} ms more than a bare `python3 -I -S -c` ({sandboxed / base:.1f}x)")


if __name__ == "__main__":
    main()
