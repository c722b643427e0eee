"""How long `dagster-rl` takes to answer, as a person at a terminal runs it: a fresh process each time.

Prints, per command, the median wall time and the median CPU time (user + system, of the process and
its children) over the repeats, and whether the command imported torch. `import dagster` and
opening the instance are measured alone too: the floor of any command that reads the instance.
Target: `--help` and `status` under 2 s. On a shared machine wall time grows with the load (the
load average is printed); CPU time much less.

    .venv/bin/python bench/cli_startup.py [--repeats 5]
"""

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TORCH = "import sys, atexit; atexit.register(lambda: sys.stderr.write(f'\\ntorch imported: {\"torch\" in sys.modules}\\n'))"


def measure(argv: list[str], env: dict[str, str], repeats: int) -> tuple[float, float, bool]:
    walls, cpus, torch = [], [], False
    for _ in range(repeats):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        done = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
        walls.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        torch = "torch imported: True" in done.stderr
    return statistics.median(walls), statistics.median(cpus), torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="dagster-rl-bench-cli-"))
    (home / "dagster.yaml").write_text((REPO / "deploy" / "dagster.local.yaml").read_text())
    env = {**os.environ, "DAGSTER_HOME": str(home), "PYTHONWARNINGS": "ignore"}
    env.pop("DAGSTER_RL_EXPERIMENTS", None)
    python = [str(BIN / "python"), "-c"]
    cli = f"{TORCH}; from assets.cli import main; main(sys.argv[1:])"
    subprocess.run(
        [*python, "from dagster import DagsterInstance; DagsterInstance.get().dispose()"], env=env, check=True
    )  # the schema
    commands = {
        "python -c pass": [*python, "pass"],
        "import dagster": [*python, "import dagster"],
        "import dagster; DagsterInstance.get()": [
            *python,
            "from dagster import DagsterInstance; DagsterInstance.get().dispose()",
        ],
        "dagster-rl --help": [*python, cli, "--help"],
        "dagster-rl status demo": [*python, cli, "status", "demo"],
        "dagster-rl runs demo": [*python, cli, "runs", "demo"],
        "dagster-rl serve --help": [*python, cli, "serve", "--help"],
    }
    print(
        f"{'command':40s} {'wall s':>7s} {'cpu s':>7s}  torch   (median of {args.repeats}; load average {os.getloadavg()[0]:.1f})"
    )
    for name, argv in commands.items():
        wall, cpu, torch = measure(argv, env, args.repeats)
        print(f"{name:40s} {wall:7.2f} {cpu:7.2f}  {'yes' if torch else 'no'}")


if __name__ == "__main__":
    main()
