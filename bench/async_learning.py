"""Learning at `max_policy_lag` 0, 1, 2, 4 (and with the off-policy corrections), side by side:
held-out greedy accuracy of a shipped experiment through the driver, several seeds each.

Each (setting, seed) is one run of the experiment's `<exp>_train` job over its steps on an ephemeral
instance with a fresh store, in a process of its own, one at a time (`bench/learning_curves.py`'s
worker: torch's native kernels). A setting is a name and the overrides it merges into the shipped
experiment file (one level deep, as `--set` does there). Prints each run as it ends, then a table:
per setting, the mean held-out accuracy over the last `--last` steps of each seed, their mean, and
the difference from the first setting (lag 0), beside what the corrections did (the mean share of
tokens clipped, and truncated or masked).

    .venv/bin/python bench/async_learning.py --experiment tiny_grpo --seeds 0 1 2
    .venv/bin/python bench/async_learning.py --experiment smollm2_arithmetic --seeds 0 --last 3 \\
        --setting lag4_tis '{"max_policy_lag": 4, "grpo": {"mismatch": {"level": "token", "action": "truncate", "cap": 2.0}}}'
    .venv/bin/python bench/async_learning.py --from-json runs.jsonl   # the table of stored runs
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DAGSTER_HOME", tempfile.mkdtemp(prefix="dagster-rl-bench-home-"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

LAGS = {f"lag{k}": {"max_policy_lag": k} for k in (0, 1, 2, 4)}
METRICS = ("clip_frac", "mismatch_capped_frac", "decoupled_masked_frac", "ratio_max_dev", "logp_max_dev", "kl")


def run_one(experiment: str, seed: int, overrides: dict, steps: int | None) -> dict:
    """One run through the driver in this process: each step's held-out accuracy and update metrics."""
    from bench.learning_curves import settings, train_through_driver

    raw = settings(experiment, seed, overrides)
    if steps is not None:
        raw["n_steps"] = steps
    wall, found = train_through_driver(raw, ("evaluation", "weights"))
    evaluation, weights = found["evaluation"], found["weights"]
    order = sorted(evaluation)
    first = evaluation[order[0]]
    return {
        "experiment": experiment,
        "seed": seed,
        "wall_s": wall,
        "start": first.get("start_accuracy"),
        "base": first.get("base_accuracy"),
        "accuracy": [evaluation[s]["accuracy"] for s in order],
        "mean_reward": [weights[s]["mean_reward"] for s in order],
        **{m: [weights[s].get(m) for s in order] for m in METRICS},
    }


def table(runs: list[dict], last: int) -> None:
    settings = list(dict.fromkeys(r["setting"] for r in runs))
    experiment = runs[0]["experiment"]
    n = len(runs[0]["accuracy"])
    print(
        f"\n{experiment}: held-out greedy accuracy, mean of steps {n - last}..{n - 1} per seed "
        f"(start: {runs[0]['start']}, base: {runs[0]['base']})"
    )
    print("| setting | seeds | end accuracy per seed | mean | vs the first | clipped | capped / masked | wall s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    base = None
    for name in settings:
        mine = sorted((r for r in runs if r["setting"] == name), key=lambda r: r["seed"])
        ends = [statistics.fmean(r["accuracy"][-last:]) for r in mine]
        mean = statistics.fmean(ends)
        base = mean if base is None else base

        def share(metric: str, mine: list[dict] = mine) -> str:
            values = [v for r in mine for v in r[metric] if v is not None]
            return f"{statistics.fmean(values):.3f}" if values else "-"

        capped = " / ".join(x for x in (share("mismatch_capped_frac"), share("decoupled_masked_frac")) if x != "-") or "-"
        print(
            f"| {name} | {', '.join(str(r['seed']) for r in mine)} | {', '.join(f'{e:.3f}' for e in ends)} | {mean:.3f} | "
            f"{mean - base:+.3f} | {share('clip_frac')} | {capped} | {statistics.fmean(r['wall_s'] for r in mine):.0f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experiment", default="tiny_grpo")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=None, help="this many steps instead of the experiment's n_steps")
    parser.add_argument("--last", type=int, default=5, help="the end point: the mean over this many last steps")
    parser.add_argument("--setting", nargs=2, action="append", default=[], metavar=("NAME", "JSON"), help="default: lag0-lag4")
    parser.add_argument("--json", type=Path, default=None, help="append every run to this JSON-lines file")
    parser.add_argument("--from-json", type=Path, default=None, help="print the table of the runs in this file")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # one run: its overrides, result on stdout
    args = parser.parse_args()
    if args.worker is not None:
        print(json.dumps(run_one(args.experiment, args.seeds[0], json.loads(args.worker), args.steps)))
        return
    if args.from_json is not None:
        stored = [json.loads(line) for line in args.from_json.read_text().splitlines() if line.strip()]
        for experiment in dict.fromkeys(r["experiment"] for r in stored):
            table([r for r in stored if r["experiment"] == experiment], args.last)
        return
    settings = {name: json.loads(text) for name, text in args.setting} or LAGS
    print(f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
    runs = []
    for seed in args.seeds:
        for name, overrides in settings.items():
            cmd = [
                sys.executable,
                __file__,
                "--experiment",
                args.experiment,
                "--seeds",
                str(seed),
                "--worker",
                json.dumps(overrides),
            ]
            cmd += ["--steps", str(args.steps)] if args.steps is not None else []
            t0 = time.monotonic()
            done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            if done.returncode != 0:
                sys.exit(f"{args.experiment} {name} seed {seed} failed:\n{done.stderr[-4000:]}")
            run = {**json.loads(done.stdout.strip().splitlines()[-1]), "setting": name, "overrides": overrides}
            run["load"] = os.getloadavg()[0]
            runs.append(run)
            if args.json is not None:
                with args.json.open("a") as f:
                    f.write(json.dumps(run) + "\n")
            tail = statistics.fmean(run["accuracy"][-args.last :])
            print(
                f"{name} seed {seed}: end accuracy {tail:.3f}, curve {' '.join(f'{a:.2f}' for a in run['accuracy'])} "
                f"({time.monotonic() - t0:.0f} s, load {run['load']:.1f})",
                flush=True,
            )
    table(runs, args.last)


if __name__ == "__main__":
    main()
