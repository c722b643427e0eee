"""Dagster driver vs a plain Python loop over the same library, 8 demo steps, cold caches.

Prints wall time of the whole range (Dagster: run start, resource init, materializations included)
and the time spent inside the steps, with the ratios Dagster / plain. Target: Dagster / plain <= 1.10.

    .venv/bin/python bench/driver_overhead.py [--repeats 3] [--steps 8]
"""

import argparse
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
from dagster_rl.core.experiment_files import load_experiments
from dagster_rl.core.task import Backends
from dagster_rl.judges.rubric_judge import RubricJudge
from dagster_rl.store.artifact_store import ArtifactStore
from dagster_rl.tasks.secret_search.backends import SandboxRollouts, TabularTrainer
from dagster_rl.tasks.secret_search.judge import score
from dagster_rl.tasks.secret_search.loop import initial_weights, run_step
from resources import ArtifactStoreResource, RolloutEnvironment

EXPERIMENTS = Path(__file__).resolve().parent.parent / "experiments"


def plain(steps: int, root: Path) -> tuple[float, float]:
    exp = load_experiments(EXPERIMENTS)["demo"]
    store = ArtifactStore(f"file://{root}/artifacts")
    backends = Backends(SandboxRollouts(root / "sandboxes"), RubricJudge(score), TabularTrainer())
    t0 = time.perf_counter()
    weights, inside = initial_weights(exp, store), 0.0
    for step in range(steps):
        result, weights = run_step(exp, step, weights, store, backends)
        inside += result.timings["step_s"]
    return time.perf_counter() - t0, inside


def dagster(steps: int, root: Path) -> tuple[float, float]:
    exp = load_experiments(EXPERIMENTS)
    resources = {
        "artifact_store": ArtifactStoreResource(url=f"file://{root}/artifacts"),
        "rollout": RolloutEnvironment(sandbox_root=str(root / "sandboxes")),
    }
    job = build_definitions(exp, resources).resolve_job_def("demo_train")
    with DagsterInstance.ephemeral() as instance:
        tags = {"dagster/asset_partition_range_start": "0000", "dagster/asset_partition_range_end": step_key(steps - 1)}
        t0 = time.perf_counter()
        quiet = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}  # the table, not the run's event log
        result = job.execute_in_process(instance=instance, tags=tags, run_config=quiet)
        wall = time.perf_counter() - t0
        assert result.success
        inside = sum(
            e.materialization.metadata["step_s"].value
            for e in result.get_asset_materialization_events()
            if e.asset_key.path[-1] == "weights"
        )
    return wall, inside


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    rows = {"plain": [], "dagster": []}
    for _ in range(args.repeats):
        for name, fn in (("plain", plain), ("dagster", dagster)):
            with tempfile.TemporaryDirectory() as d:
                rows[name].append(fn(args.steps, Path(d)))
    med = {k: (statistics.median(w for w, _ in v), statistics.median(i for _, i in v)) for k, v in rows.items()}
    print(f"demo, {args.steps} steps, cold cache, median of {args.repeats}")
    print(f"{'loop':<10}{'wall s':>10}{'in steps s':>12}{'per step s':>12}")
    for name, (wall, inside) in med.items():
        print(f"{name:<10}{wall:>10.3f}{inside:>12.3f}{wall / args.steps:>12.3f}")
    wall_ratio = med["dagster"][0] / med["plain"][0]
    step_ratio = med["dagster"][1] / med["plain"][1]
    print(f"ratio dagster/plain: wall {wall_ratio:.2f}, inside steps {step_ratio:.2f} (target <= 1.10)")
    print(f"dagster fixed cost (wall - steps): {med['dagster'][0] - med['dagster'][1]:.3f} s per run")


if __name__ == "__main__":
    main()
