"""Sequential vs pipelined GRPO steps through the Dagster driver, trainer on `torchrun`, with a
launch per step and with a trainer session for the range.

Every mode runs the `tiny_grpo` experiment (no warm-up) in-process through the driver, cold caches,
with the trainer launched through Dagster Pipes as `torchrun --nproc-per-node 1` and one torch
thread for generation (driver process) and one for training (worker). `trainer.session: step`
starts torchrun and loads the model for every step; `range` starts them once for the run's range
and keeps the model in memory (the start is then paid by the first step). `max_policy_lag: 0`
generates step k+1 after step k trains; `1` generates it while step k trains.
Target: pipelined <= 0.75 x sequential with the session, at these defaults: 96 new tokens make
generation and the update take about the same time on the 2-core CPU (measured about 2 s each; at
8 tokens, the earlier default, generation took 0.25 s against 1 s of update and there was little to
overlap). The session's start is in both walls.

    .venv/bin/python bench/pipelining.py [--steps 8] [--prompts 8] [--samples 32] [--new-tokens 96]
"""

import argparse
import ast
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# runs on an ephemeral instance: the code location's DAGSTER_HOME check needs a folder, any will do
os.environ.setdefault("DAGSTER_HOME", tempfile.mkdtemp(prefix="dagster-rl-bench-home-"))

from dagster import DagsterInstance

from assets.definitions import build_definitions
from dagster_rl.core.experiment import step_key
from dagster_rl.core.experiment_files import parse_experiment
from resources import ArtifactStoreResource
from tests.settings import shipped_settings

REPORTED = "trainer rank 0 reported: "
SESSIONS = ("step", "range")


def run(lag: int, args: argparse.Namespace, root: Path, session: str = "range", **overrides) -> dict:
    """One driver run of `args.steps` steps; its wall time, per-step medians, and per-step rows
    (the driver's train_s beside the worker's own timings, as rank 0 reported them through Pipes)."""
    settings = shipped_settings(
        "tiny_grpo",
        name=f"lag{lag}_{session}",
        max_policy_lag=lag,
        trainer={"backend": "torchrun", "nproc_per_node": 1, "threads_per_process": 1, "session": session},
        generation_threads=1,
        warmup=None,  # steps only: the warm-up is not what this measures
        **overrides,
    )
    exp = parse_experiment(settings)
    defs = build_definitions({exp.name: exp}, {"artifact_store": ArtifactStoreResource(url=f"file://{root}/artifacts")})
    tags = {"dagster/asset_partition_range_start": "0000", "dagster/asset_partition_range_end": step_key(args.steps - 1)}
    with DagsterInstance.ephemeral() as instance:
        t0 = time.perf_counter()
        quiet = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}  # the table, not the run's event log
        result = defs.resolve_job_def(f"{exp.name}_train").execute_in_process(instance=instance, tags=tags, run_config=quiet)
        wall = time.perf_counter() - t0
        assert result.success
        md = [e.materialization.metadata for e in result.get_asset_materialization_events() if e.asset_key.path[-1] == "weights"]
        logs = instance.all_logs(result.run_id)
        said = [ast.literal_eval(e.message[len(REPORTED) :]) for e in logs if e.message.startswith(REPORTED)]
        stored = [
            e.timestamp
            for e in logs
            if e.dagster_event and e.dagster_event.is_step_materialization and e.dagster_event.asset_key.path[-1] == "weights"
        ]
    timings = {m["step"]: m["timings"] for m in said}
    steps = [
        {"train_s": m["train_s"].value, "generate_s": m["generate_s"].value, **timings.get(step, {})} for step, m in enumerate(md)
    ]
    return {
        "wall": wall,
        "after_first": stored[-1] - stored[0],  # from step 0's weights to the last step's: the steady state
        "per_step": wall / args.steps,
        "generate_s": statistics.median(s["generate_s"] for s in steps),
        "train_s": statistics.median(s["train_s"] for s in steps),
        "steps": steps,
    }


def pipelining_table(args: argparse.Namespace, sessions=SESSIONS) -> dict:
    rows = {}
    for session in sessions:
        for lag in (0, 1):
            with tempfile.TemporaryDirectory() as d:
                rows[session, lag] = run(lag, args, Path(d), session, prompts_per_step=args.prompts, n_samples=args.samples,
                                         min_trials_per_step=1, sampling={"max_new_tokens": args.new_tokens})  # fmt: skip
    print(
        f"tiny_grpo, {args.steps} steps, {args.prompts}x{args.samples} rollouts of {args.new_tokens} tokens, torchrun trainer (1 process)"
    )
    print(f"{'trainer':<18}{'mode':<20}{'wall s':>9}{'after step 0 s':>16}{'generate s':>12}{'train s':>10}")
    for session in sessions:
        for lag, name in ((0, "sequential (lag 0)"), (1, "pipelined (lag 1)")):
            r = rows[session, lag]
            label = "session (range)" if session == "range" else "launch per step"
            print(f"{label:<18}{name:<20}{r['wall']:>9.2f}{r['after_first']:>16.2f}{r['generate_s']:>12.2f}{r['train_s']:>10.2f}")
    for session in sessions:
        whole = rows[session, 1]["wall"] / rows[session, 0]["wall"]
        steady = rows[session, 1]["after_first"] / rows[session, 0]["after_first"]
        label = "session" if session == "range" else "launch per step"
        print(
            f"pipelined / sequential, {label}: {whole:.2f} whole run, {steady:.2f} after step 0"
            + (" (target <= 0.75)" if session == "range" else "")
        )
    print(
        "generate s: generation + judging of a step; train s: the update as the driver waits for it, launch included (median over steps);"
    )
    print(
        f"after step 0 s: from step 0's weights to step {args.steps - 1:04d}'s (the session's start and the first generation left out)"
    )
    return rows


def arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=96)
    return parser.parse_args(argv)


if __name__ == "__main__":
    pipelining_table(arguments())
