"""Held-out greedy success and mean turns of the language-model agent (`tiny_agent`) over its GRPO
steps, through the driver, on every CPU kernel setting and several seeds.

Runs the experiment's `<exp>_train` job (its warm-up `<exp>/sft` first, then every step) on an
ephemeral instance with a fresh artifact store, one run per (kernel setting, seed), each in its own
process (`ATEN_CPU_CAPABILITY` is read when torch loads), `--parallel` at a time. Prints each run's
curve, then a table of every run: the warm-up's held-out success and mean turns, the mean over the
last `--last` steps, and the change between them, with their ranges.

    .venv/bin/python bench/agent_curves.py                                   # the 9-run table
    .venv/bin/python bench/agent_curves.py --kernels native --seeds 0
    .venv/bin/python bench/agent_curves.py --set tiny_agent '{"warmup": {"steps": 400}}'   # try a change

Kernel settings: `native`, `avx2`, `default` (the values of `ATEN_CPU_CAPABILITY`; see
bench/learning_curves.py): a claim about learning holds only if it holds on all of them.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DAGSTER_HOME", tempfile.mkdtemp(prefix="dagster-rl-bench-home-"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from bench.learning_curves import KERNELS, kernel_env, settings


def run_one(name: str, seed: int, overrides: dict) -> dict:
    """One run through the driver in this process: the warm-up's and every step's metadata."""
    import torch
    import yaml
    from dagster import AssetKey, DagsterInstance

    from assets.definitions import build_definitions
    from dagster_rl.core.experiment import step_key
    from dagster_rl.core.experiment_files import load_experiments
    from resources import ArtifactStoreResource

    def metadata(instance: DagsterInstance, asset: str) -> dict:
        records = instance.fetch_materializations(AssetKey([name, asset]), limit=10_000, ascending=True).records
        return {
            r.asset_materialization.partition: {k: v.value for k, v in r.asset_materialization.metadata.items()} for r in records
        }

    with tempfile.TemporaryDirectory(prefix=f"curve-{name}-") as tmp:
        raw = settings(name, seed, overrides)
        (Path(tmp) / "experiments").mkdir()
        (Path(tmp) / "experiments" / f"{name}.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
        exp = load_experiments(Path(tmp) / "experiments")[name]
        defs = build_definitions({name: exp}, {"artifact_store": ArtifactStoreResource(url=f"file://{tmp}/artifacts")})
        tags = {
            "dagster/asset_partition_range_start": step_key(0),
            "dagster/asset_partition_range_end": step_key(exp.n_steps - 1),
        }
        quiet = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}
        with DagsterInstance.ephemeral() as instance:
            t0 = time.perf_counter()
            assert (
                defs.resolve_job_def(f"{name}_train").execute_in_process(instance=instance, tags=tags, run_config=quiet).success
            )
            wall = time.perf_counter() - t0
            sft, evaluation, weights = (
                metadata(instance, "sft")[None],
                metadata(instance, "evaluation"),
                metadata(instance, "weights"),
            )
    steps = sorted(evaluation)
    return {
        "experiment": name, "seed": seed, "capability": torch.backends.cpu.get_cpu_capability(), "wall_s": wall,
        "warmup_s": sft["warmup_s"], "warmup_success": sft["success"], "warmup_turns": sft["mean_turns"],
        "success": [evaluation[s]["success"] for s in steps], "turns": [evaluation[s]["mean_turns"] for s in steps],
        "sampled_success": [weights[s]["success_rate"] for s in steps], "sampled_turns": [weights[s]["mean_turns"] for s in steps],
        "load": os.getloadavg()[0],
    }  # fmt: skip


def tail_mean(values: list[float], last: int) -> float:
    tail = values[-last:]
    return sum(tail) / len(tail)


def print_curve(run: dict, kernel: str) -> None:
    print(
        f"\n{run['experiment']} seed {run['seed']}, kernels {kernel} ({run['capability']}): {len(run['success'])} steps in "
        f"{run['wall_s']:.0f} s (warm-up {run['warmup_s']:.0f} s); load average {run['load']:.2f}"
    )
    print(f"{'':22} {'warm-up':>8} " + " ".join(f"{s:>5}" for s in range(len(run["success"]))))
    for label, start, key in (
        ("held-out success", "warmup_success", "success"),
        ("held-out mean turns", "warmup_turns", "turns"),
    ):
        print(f"{label:22} {run[start]:8.2f} " + " ".join(f"{v:5.2f}" for v in run[key]))
    print(f"{'sampled success':22} {'':8} " + " ".join(f"{v:5.2f}" for v in run["sampled_success"]))
    print(f"{'sampled mean turns':22} {'':8} " + " ".join(f"{v:5.2f}" for v in run["sampled_turns"]), flush=True)


def print_table(runs: list[tuple[str, dict]], last: int) -> None:
    n = len(runs[0][1]["success"])
    print(f"\nheld-out greedy success and mean turns: the warm-up's vs the mean of steps {n - last}..{n - 1}")
    print(
        f"| kernels | seed | warm-up success | last {last} success | rise | warm-up turns | last {last} turns | fall | wall s |"
    )
    print("| --- " * 9 + "|")
    rises, falls = [], []
    for kernel, run in runs:
        s, t = tail_mean(run["success"], last), tail_mean(run["turns"], last)
        rises.append(s - run["warmup_success"])
        falls.append(run["warmup_turns"] - t)
        print(
            f"| {kernel} | {run['seed']} | {run['warmup_success']:.3f} | {s:.3f} | {rises[-1]:+.3f} | {run['warmup_turns']:.3f} | "
            f"{t:.3f} | {falls[-1]:+.3f} | {run['wall_s']:.0f} |"
        )
    print(f"| range | | | | {min(rises):+.3f}..{max(rises):+.3f} | | | {min(falls):+.3f}..{max(falls):+.3f} | |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experiment", default="tiny_agent")
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--last", type=int, default=4, help="the table's end point: the mean over this many last steps")
    parser.add_argument("--parallel", type=int, default=1, help="runs at a time (each its own process, one torch thread)")
    parser.add_argument("--set", default="{}", metavar="JSON", help="override settings, merged one level deep")
    parser.add_argument("--json", type=Path, default=None, help="append every run's result to this JSON-lines file")
    parser.add_argument("--from-json", type=Path, default=None, help="print the table of the runs stored in this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    overrides = json.loads(args.set)
    if args.worker:
        print(json.dumps(run_one(args.experiment, args.seeds[0], overrides)))
        return
    if args.from_json is not None:
        stored = [json.loads(line) for line in args.from_json.read_text().splitlines() if line.strip()]
        print_table([(r["kernels"], r) for r in stored if r["experiment"] == args.experiment], args.last)
        return
    print(f"load average before: {os.getloadavg()[0]:.2f}", flush=True)

    def one(kernel: str, seed: int) -> tuple[str, dict]:
        cmd = [sys.executable, __file__, "--worker", "--experiment", args.experiment, "--seeds", str(seed), "--set", args.set]
        done = subprocess.run(cmd, env=kernel_env(kernel), capture_output=True, text=True, cwd=ROOT)
        if done.returncode != 0:
            sys.exit(f"{args.experiment} seed {seed} kernels {kernel} failed:\n{done.stderr[-4000:]}")
        run = json.loads(done.stdout.strip().splitlines()[-1])
        run["kernels"], run["overrides"] = kernel, overrides
        if args.json is not None:
            with args.json.open("a") as f:
                f.write(json.dumps(run) + "\n")
        print_curve(run, kernel)
        return kernel, run

    with ThreadPoolExecutor(args.parallel) as pool:
        runs = list(pool.map(lambda ks: one(*ks), [(k, s) for k in args.kernels for s in args.seeds]))
    print_table(runs, args.last)


if __name__ == "__main__":
    main()
