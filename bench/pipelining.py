"""Sequential vs pipelined GRPO steps through the Dagster driver, trainer on `torchrun`.

Both modes run the `tiny_grpo` experiment in-process through the driver, cold caches, with the
trainer launched through Dagster Pipes as `torchrun --nproc-per-node 1` (its start-up is part of
every step) and one torch thread for generation (driver process) and one for training (worker).
`max_policy_lag: 0` generates step k+1 after step k trains; `1` generates it while step k trains.
Target: pipelined <= 0.75 x sequential when generation and training take similar time; the table
prints both phases so you can see how balanced they are at the chosen size.

    .venv/bin/python bench/pipelining.py [--steps 4] [--prompts 8] [--samples 32] [--new-tokens 8]
"""

import argparse
import statistics
import sys
import os
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# runs on an ephemeral instance: the code location's DAGSTER_HOME check needs a folder, any will do
os.environ.setdefault("DAGSTER_HOME", tempfile.mkdtemp(prefix="dagster-rl-bench-home-"))

from dagster import DagsterInstance  # noqa: E402

from assets.definitions import build_definitions  # noqa: E402
from dagster_rl.experiment import step_key  # noqa: E402
from dagster_rl.experiment_files import parse_experiment  # noqa: E402
from resources import ArtifactStoreResource  # noqa: E402
from tests.conftest import shipped_settings  # noqa: E402


def run(lag: int, args: argparse.Namespace, root: Path) -> dict[str, float]:
    settings = shipped_settings(
        "tiny_grpo",
        name=f"lag{lag}",
        max_policy_lag=lag,
        prompts_per_step=args.prompts,
        n_samples=args.samples,
        min_trials_per_step=1,
        sampling={"max_new_tokens": args.new_tokens},
        trainer={"backend": "torchrun", "nproc_per_node": 1, "threads_per_process": 1},
        generation_threads=1,
        warmup=None,  # steps only: the warm-up is not what this measures
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
    return {
        "wall": wall,
        "per_step": wall / args.steps,
        "generate_s": statistics.median(m["generate_s"].value for m in md),
        "train_s": statistics.median(m["train_s"].value for m in md),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=8)
    args = parser.parse_args()
    rows = {}
    for lag in (0, 1):
        with tempfile.TemporaryDirectory() as d:
            rows[lag] = run(lag, args, Path(d))
    print(f"tiny_grpo, {args.steps} steps, {args.prompts}x{args.samples} rollouts of {args.new_tokens} tokens, torchrun trainer")
    print(f"{'mode':<22}{'wall s':>9}{'s/step':>9}{'generate s':>12}{'train s':>10}")
    for lag, name in ((0, "sequential (lag 0)"), (1, "pipelined (lag 1)")):
        r = rows[lag]
        print(f"{name:<22}{r['wall']:>9.2f}{r['per_step']:>9.2f}{r['generate_s']:>12.2f}{r['train_s']:>10.2f}")
    print(f"pipelined / sequential: {rows[1]['wall'] / rows[0]['wall']:.2f} (target <= 0.75)")
    print("generate s: generation + judging of a step; train s: the torchrun launch + update (median over steps)")


if __name__ == "__main__":
    main()
