"""Held-out greedy accuracy over GRPO steps of the shipped language-model experiments, through the
driver, on every CPU kernel setting and several seeds.

Runs each experiment's `<exp>_train` job (its warm-up `<exp>/sft` first, then every step) on an
ephemeral instance with a fresh artifact store, one run per (kernel setting, seed), each in its own
process (`ATEN_CPU_CAPABILITY` is read when torch loads), one at a time. Prints each run's curve
(the base's, the warm-up's and the steps' held-out accuracy, the mean reward, the wall time), then
a table of every run: the warm-up's accuracy, the mean over the last `--last` steps, and the rise
between them, with their ranges. The curves of docs/language-models.md come from this.

    .venv/bin/python bench/learning_curves.py                                   # the 9-run table of both experiments
    .venv/bin/python bench/learning_curves.py --experiments tiny_grpo --kernels native --seeds 0
    .venv/bin/python bench/learning_curves.py --set tiny_grpo '{"grpo": {"learning_rate": 0.002}}'   # try a change

Kernel settings: `native` (torch's choice for this CPU), `avx2`, `default` (no vector kernels): the
values of `ATEN_CPU_CAPABILITY`. Different kernels round the last bits differently and training
amplifies that, so a claim about learning holds only if it holds on all of them.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# runs on an ephemeral instance: the code location's DAGSTER_HOME check needs a folder, any will do
os.environ.setdefault("DAGSTER_HOME", tempfile.mkdtemp(prefix="dagster-rl-bench-home-"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
EXPERIMENTS = ROOT / "experiments"
KERNELS = ("native", "avx2", "default")


def kernel_env(kernel: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    return env if kernel == "native" else {**env, "ATEN_CPU_CAPABILITY": kernel}


def settings(name: str, seed: int, overrides: dict) -> dict:
    """experiments/<name>.yaml with the seed and the overrides merged one level deep."""
    import yaml

    raw = yaml.safe_load((EXPERIMENTS / f"{name}.yaml").read_text())
    for key, value in {**overrides, "seed": seed}.items():
        raw[key] = {**raw[key], **value} if isinstance(value, dict) and isinstance(raw.get(key), dict) else value
    return raw


def train_through_driver(raw: dict, assets: tuple[str, ...]) -> tuple[float, dict[str, dict]]:
    """Experiment `raw` (an experiment file's settings) trained through the driver: its `<exp>_train` job over
    all its steps on an ephemeral instance with a fresh artifact store, in this process. Its wall seconds, and
    each of `assets`' materializations' metadata by partition (None: an unpartitioned asset's, `sft`)."""
    import yaml
    from dagster import AssetKey, DagsterInstance

    from assets.definitions import build_definitions
    from dagster_rl.core.experiment import step_key
    from dagster_rl.core.experiment_files import load_experiments
    from resources import ArtifactStoreResource

    name = raw["name"]

    def metadata(instance: DagsterInstance, asset: str) -> dict:
        records = instance.fetch_materializations(AssetKey([name, asset]), limit=10_000, ascending=True).records
        return {
            r.asset_materialization.partition: {k: v.value for k, v in r.asset_materialization.metadata.items()} for r in records
        }

    with tempfile.TemporaryDirectory(prefix=f"curve-{name}-") as tmp:
        (Path(tmp) / "experiments").mkdir()
        (Path(tmp) / "experiments" / f"{name}.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
        exp = load_experiments(Path(tmp) / "experiments")[name]
        defs = build_definitions({name: exp}, {"artifact_store": ArtifactStoreResource(url=f"file://{tmp}/artifacts")})
        tags = {
            "dagster/asset_partition_range_start": step_key(0),
            "dagster/asset_partition_range_end": step_key(exp.n_steps - 1),
        }
        quiet = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}  # the table, not the run's event log
        with DagsterInstance.ephemeral() as instance:
            t0 = time.perf_counter()
            done = defs.resolve_job_def(f"{name}_train").execute_in_process(instance=instance, tags=tags, run_config=quiet)
            if not done.success:
                raise SystemExit(f"the {name}_train run failed; its events are above")
            return time.perf_counter() - t0, {asset: metadata(instance, asset) for asset in assets}


def run_one(name: str, seed: int, overrides: dict, n_steps: int | None) -> dict:
    """One run through the driver in this process: the warm-up's and every step's metadata."""
    import torch

    raw = settings(name, seed, overrides)
    if n_steps is not None:
        raw["n_steps"] = n_steps
    wall, found = train_through_driver(raw, ("sft", "evaluation", "weights"))
    sft, evaluation, weights = found["sft"][None], found["evaluation"], found["weights"]
    steps = sorted(evaluation)
    return {
        "experiment": name,
        "seed": seed,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "wall_s": wall,
        "base": sft["base_accuracy"],
        "warmup": sft["accuracy"],
        "warmup_s": sft["warmup_s"],
        "sft_steps": sft["sft_steps"],
        "accuracy": [evaluation[s]["accuracy"] for s in steps],
        "mean_reward": [weights[s]["mean_reward"] for s in steps],
        "sampled_accuracy": [weights[s]["success_rate"] for s in steps],
    }


def print_curve(run: dict, kernel: str, every: int) -> None:
    steps = range(len(run["accuracy"]))
    shown = [s for s in steps if s % every == 0 or s == steps[-1]]
    print(
        f"\n{run['experiment']} seed {run['seed']}, kernels {kernel} ({run['capability']}): {len(steps)} steps in {run['wall_s']:.0f} s "
        f"(warm-up {run['sft_steps']} steps, {run['warmup_s']:.0f} s); load average {os.getloadavg()[0]:.2f}"
    )
    print(f"{'':24} {'base':>6} {'warm-up':>8} " + " ".join(f"{s:>6}" for s in shown))
    print(
        f"{'held-out accuracy':24} {run['base']:6.2f} {run['warmup']:8.2f} "
        + " ".join(f"{run['accuracy'][s]:6.2f}" for s in shown)
    )
    print(f"{'mean reward':24} {'':6} {'':8} " + " ".join(f"{run['mean_reward'][s]:6.3f}" for s in shown))
    print(f"{'sampled accuracy':24} {'':6} {'':8} " + " ".join(f"{run['sampled_accuracy'][s]:6.2f}" for s in shown), flush=True)


def last_mean(run: dict, last: int) -> float:
    tail = run["accuracy"][-last:]
    return sum(tail) / len(tail)


def print_table(runs: list[tuple[str, dict]], last: int, every: int) -> None:
    """One line per run, then each column's range over the runs, then the curve's range step by step."""
    name = runs[0][1]["experiment"]
    n = len(runs[0][1]["accuracy"])
    print(f"\n{name}: held-out greedy accuracy, warm-up (start) vs the mean of steps {n - last}..{n - 1}")
    print(f"{'kernels':8} {'seed':>4} {'sft steps':>9} {'warm-up':>8} {'last ' + str(last):>8} {'rise':>6} {'best':>6}")
    rises, starts, ends = [], [], []
    for kernel, run in runs:
        end = last_mean(run, last)
        rises.append(end - run["warmup"])
        starts.append(run["warmup"])
        ends.append(end)
        print(
            f"{kernel:8} {run['seed']:4d} {run['sft_steps']:9d} {run['warmup']:8.2f} {end:8.3f} {end - run['warmup']:+6.3f} {max(run['accuracy']):6.2f}"
        )
    print(
        f"{'range':8} {'':4} {'':9} {min(starts):.2f}-{max(starts):.2f} {min(ends):.2f}-{max(ends):.2f} {min(rises):+.3f}..{max(rises):+.3f}"
    )
    shown = [s for s in range(n) if s % every == 0 or s == n - 1]
    curves = [run["accuracy"] for _, run in runs]
    print(f"\n{name}: held-out greedy accuracy, range over the {len(runs)} runs")
    print("| | warm-up | " + " | ".join(f"step {s}" if s == 0 else str(s) for s in shown) + " |")
    print("| --- " * (len(shown) + 2) + "|")
    print(
        f"| held-out greedy accuracy | {min(starts):.2f}-{max(starts):.2f} | "
        + " | ".join(f"{min(c[s] for c in curves):.2f}-{max(c[s] for c in curves):.2f}" for s in shown)
        + " |",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experiments", nargs="+", default=["tiny_grpo", "tiny_gsm8k"])
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=None, help="run this many steps instead of the experiment's n_steps")
    parser.add_argument("--last", type=int, default=5, help="the table's end point: the mean over this many last steps")
    parser.add_argument("--every", type=int, default=5, help="curves: print every this many steps (and the last)")
    parser.add_argument("--set", nargs=2, action="append", default=[], metavar=("EXPERIMENT", "JSON"), help="override settings")
    parser.add_argument("--json", type=Path, default=None, help="append every run's result to this JSON-lines file")
    parser.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="print the tables of the runs stored in this file (--json) instead of running",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one run, its result as JSON on stdout
    args = parser.parse_args()
    overrides = {name: {} for name in args.experiments}
    for name, text in args.set:
        overrides.setdefault(name, {}).update(json.loads(text))
    if args.worker:
        [name], [seed] = args.experiments, args.seeds
        print(json.dumps(run_one(name, seed, overrides[name], args.steps)))
        return
    if args.from_json is not None:
        stored = [json.loads(line) for line in args.from_json.read_text().splitlines() if line.strip()]
        for name in args.experiments:
            runs = [(r["kernels"], r) for r in stored if r["experiment"] == name]
            if runs:
                print_table(runs, args.last, args.every)
        return
    print(f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
    for name in args.experiments:
        runs = []
        for kernel in args.kernels:
            for seed in args.seeds:
                cmd = [sys.executable, __file__, "--worker", "--experiments", name, "--seeds", str(seed)]
                cmd += [a for n, text in args.set if n == name for a in ("--set", n, text)]
                cmd += ["--steps", str(args.steps)] if args.steps is not None else []
                done = subprocess.run(cmd, env=kernel_env(kernel), capture_output=True, text=True, cwd=ROOT)
                if done.returncode != 0:
                    sys.exit(f"{name} seed {seed} kernels {kernel} failed:\n{done.stderr[-4000:]}")
                run = json.loads(done.stdout.strip().splitlines()[-1])
                run["kernels"], run["overrides"] = kernel, overrides[name]
                if args.json is not None:
                    with args.json.open("a") as f:
                        f.write(json.dumps(run) + "\n")
                print_curve(run, kernel, args.every)
                runs.append((kernel, run))
        print_table(runs, args.last, args.every)


if __name__ == "__main__":
    main()
