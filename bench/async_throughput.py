"""Throughput at `max_policy_lag` 0, 1, 2 and 4, generation and training in two processes on two cores,
with heavy-tailed completion lengths.

Generation: a rollout server (`dagster-rl serve`, through `bench/heavy_tail_serve.py`: each
completion ends at a seeded Pareto length, min 4 tokens, tail index 1.5: infinite variance, cut at max_new_tokens),
pinned to core 0 (`taskset`), one torch thread. Training: a torchrun trainer session (one process,
one thread), started by the driver, which this script pins to core 1 before it starts anything (the
driver's own threads, sending requests and judging, share that core). Every lag runs the same
experiment (a served `tiny_grpo` without warm-up on a larger tiny model, `--hidden`/`--layers`) from
a fresh store through the Dagster driver, rounds alternating the lags.

Reported per lag: steady steps per minute (from step 0's weights to the last step's: the session's
start and the first generation left out), the ratio to lag 0, and the medians of a step's generation
(`generate_s`, from its start to its last judgement) and update (`train_s`, as the driver waits for
it), with the realized completion lengths.

    PYTHONPATH=. .venv/bin/python bench/async_throughput.py [--steps 12] [--rounds 2] [--lags 0,1,2,4]
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DAGSTER_HOME", tempfile.mkdtemp(prefix="dagster-rl-bench-home-"))

from dagster import DagsterInstance

from assets.definitions import build_definitions
from bench.lm_common import save_model
from dagster_rl.core.experiment import step_key
from dagster_rl.core.experiment_files import parse_experiment
from dagster_rl.inference.vllm_client import VLLMClient
from resources import ArtifactStoreResource, RolloutEnvironment
from tests.machine import free_port
from tests.settings import served

HERE = Path(__file__).resolve().parent


def start_server(root: Path, model: Path, core: int, args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = ["taskset", "-c", str(core), sys.executable, str(HERE / "heavy_tail_serve.py"), "--model", str(model)]
    command += [
        "--port",
        str(port),
        "--adapter-root",
        str(root),
        "--alpha",
        str(args.alpha),
        "--min-tokens",
        str(args.min_tokens),
    ]
    log = (root / "serve.log").open("wb")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}/v1"
    client, deadline = VLLMClient(url, timeout_s=10), time.monotonic() + 180
    while not client.healthy():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not come up: {(root / 'serve.log').read_text()[-2000:]}")
        time.sleep(0.5)
    return proc, url


def run(lag: int, rnd: int, model: Path, url: str, root: Path, args: argparse.Namespace) -> dict:
    settings = served(
        name=f"lag{lag}_r{rnd}",
        warmup=None,
        n_steps=args.steps,
        max_policy_lag=lag,
        prompts_per_step=args.prompts,
        n_samples=args.samples,
        min_trials_per_step=1,
        policy={"base_model": str(model)},
        sampling={"temperature": 1.0, "top_p": 1.0, "max_new_tokens": args.max_new_tokens},
        trainer={"backend": "torchrun", "nproc_per_node": 1, "threads_per_process": 1, "session": "range"},
        generation_threads=1,
    )
    exp = parse_experiment(settings)
    store = root / f"lag{lag}-r{rnd}" / "artifacts"
    resources = {
        "artifact_store": ArtifactStoreResource(url=f"file://{store}"),
        "rollout": RolloutEnvironment(base_url=url, max_concurrency=args.prompts * args.samples, request_timeout_s=600),
    }
    defs = build_definitions({exp.name: exp}, resources)
    tags = {"dagster/asset_partition_range_start": "0000", "dagster/asset_partition_range_end": step_key(args.steps - 1)}
    quiet = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}
    with DagsterInstance.ephemeral() as instance:
        t0 = time.perf_counter()
        result = defs.resolve_job_def(f"{exp.name}_train").execute_in_process(instance=instance, tags=tags, run_config=quiet)
        wall = time.perf_counter() - t0
        assert result.success
        events = [e for e in result.get_asset_materialization_events() if e.asset_key.path[-1] == "weights"]
        md = [e.materialization.metadata for e in events]
        logs = instance.all_logs(result.run_id)
        stored = [
            e.timestamp
            for e in logs
            if e.dagster_event and e.dagster_event.is_step_materialization and e.dagster_event.asset_key.path[-1] == "weights"
        ]
    lengths, step_max = completion_lengths(store)
    steady = stored[-1] - stored[0]
    return {
        "lag": lag,
        "round": rnd,
        "wall_s": wall,
        "steady_s": steady,
        "steps_per_min": 60 * (args.steps - 1) / steady,
        "generate_s": statistics.median(m["generate_s"].value for m in md),
        "train_s": statistics.median(m["train_s"].value for m in md),
        "policy_lag": max(m["policy_lag"].value for m in md),
        "logp_max_dev": max(m["logp_max_dev"].value for m in md),
        "lengths": lengths,
        "step_max": step_max,
        "load": os.getloadavg()[0],
    }


def completion_lengths(store: Path) -> tuple[list[int], list[int]]:
    """Every completion's length, and each step's longest, from the stored rollouts."""
    lengths, step_max = [], []
    for art in sorted((store / "rollouts").iterdir()):
        data = art / "data.json"
        if (art / "manifest.json").is_file() and data.is_file():
            got = [len(t["completion_token_ids"]) for t in json.loads(data.read_text())["trajectories"]]
            lengths += got
            step_max.append(max(got))
    return lengths, step_max


def percentile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--lags", default="0,1,2,4")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=240)  # the tiny model's context is 256
    parser.add_argument("--alpha", type=float, default=1.5)
    parser.add_argument("--min-tokens", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--server-core", type=int, default=0)
    parser.add_argument("--trainer-core", type=int, default=1)
    parser.add_argument("--out", default="", help="write every run's row as JSON lines here")
    args = parser.parse_args()
    lags = [int(x) for x in args.lags.split(",")]
    root = Path(tempfile.mkdtemp(prefix="dagster-rl-async-"))
    model = save_model(root / "model", hidden=args.hidden, layers=args.layers)
    server, url = start_server(root, model, args.server_core, args)
    os.sched_setaffinity(0, {args.trainer_core})  # the driver, and the trainer session it starts
    rows = []
    try:
        for rnd in range(args.rounds):
            for lag in lags if rnd % 2 == 0 else list(reversed(lags)):
                row = run(lag, rnd, model, url, root, args)
                rows.append(row)
                short = {
                    k: round(v, 3) if isinstance(v, float) else v for k, v in row.items() if k not in ("lengths", "step_max")
                }
                print(json.dumps(short), file=sys.stderr, flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")
    finally:
        server.terminate()
        server.wait(30)
    table(rows, lags, args)


def table(rows: list[dict], lags: list[int], args: argparse.Namespace) -> None:
    lengths = [n for r in rows for n in r["lengths"]]
    step_max = [n for r in rows for n in r["step_max"]]
    print(
        f"{args.steps} steps of {args.prompts}x{args.samples} completions, max {args.max_new_tokens} tokens, model hidden "
        f"{args.hidden} x {args.layers} layers; server on core {args.server_core}, trainer session on core {args.trainer_core}; "
        f"{args.rounds} round(s), median over rounds"
    )
    print(
        f"completion tokens: median {percentile(lengths, 0.5)}, p90 {percentile(lengths, 0.9)}, p99 {percentile(lengths, 0.99)}, "
        f"max {max(lengths)}, mean {statistics.fmean(lengths):.1f}; a step's longest: median {percentile(step_max, 0.5)}, "
        f"min {min(step_max)}, max {max(step_max)}"
    )
    base = statistics.median(r["steps_per_min"] for r in rows if r["lag"] == lags[0])
    print(f"{'lag':>4}{'steps/min':>11}{'x lag 0':>9}{'generate s':>12}{'update s':>10}{'load':>7}")
    for lag in lags:
        mine = [r for r in rows if r["lag"] == lag]
        rate = statistics.median(r["steps_per_min"] for r in mine)
        gen = statistics.median(r["generate_s"] for r in mine)
        train = statistics.median(r["train_s"] for r in mine)
        load = statistics.median(r["load"] for r in mine)
        print(f"{lag:>4}{rate:>11.2f}{rate / base:>9.2f}{gen:>12.2f}{train:>10.2f}{load:>7.1f}")


if __name__ == "__main__":
    main()
