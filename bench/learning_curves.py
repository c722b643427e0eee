"""Held-out greedy accuracy over GRPO steps of the shipped language-model experiments, through the driver.

Runs each experiment's `<exp>_train` job (its warm-up `<exp>/sft` first, then every step) on an
ephemeral instance with a fresh artifact store, and prints the base's, the warm-up's and the steps'
held-out accuracy, the mean reward and the wall time. The curves of docs/language-models.md come from this.

    .venv/bin/python bench/learning_curves.py [--experiments tiny_grpo tiny_gsm8k] [--every 5]
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# runs on an ephemeral instance: the code location's DAGSTER_HOME check needs a folder, any will do
os.environ.setdefault("DAGSTER_HOME", tempfile.mkdtemp(prefix="dagster-rl-bench-home-"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from dagster import AssetKey, DagsterInstance  # noqa: E402

from assets.definitions import build_definitions  # noqa: E402
from dagster_rl.experiment import step_key  # noqa: E402
from dagster_rl.experiment_files import load_experiments  # noqa: E402
from resources import ArtifactStoreResource  # noqa: E402

EXPERIMENTS = Path(__file__).resolve().parent.parent / "experiments"


def metadata(instance: DagsterInstance, name: str, asset: str) -> dict:
    records = instance.fetch_materializations(AssetKey([name, asset]), limit=10_000, ascending=True).records
    return {r.asset_materialization.partition: {k: v.value for k, v in r.asset_materialization.metadata.items()} for r in records}


def curve(name: str, root: Path) -> tuple[dict, dict, dict, float]:
    experiments = load_experiments(EXPERIMENTS)
    exp = experiments[name]
    defs = build_definitions({name: exp}, {"artifact_store": ArtifactStoreResource(url=f"file://{root}/artifacts")})
    tags = {"dagster/asset_partition_range_start": step_key(0), "dagster/asset_partition_range_end": step_key(exp.n_steps - 1)}
    with DagsterInstance.ephemeral() as instance:
        t0 = time.perf_counter()
        quiet = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}  # the table, not the run's event log
        assert defs.resolve_job_def(f"{name}_train").execute_in_process(instance=instance, tags=tags, run_config=quiet).success
        wall = time.perf_counter() - t0
        return metadata(instance, name, "sft")[None], metadata(instance, name, "evaluation"), metadata(instance, name, "weights"), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experiments", nargs="+", default=["tiny_grpo", "tiny_gsm8k"])
    parser.add_argument("--every", type=int, default=5, help="print every this many steps (and the last)")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    for name in args.experiments:
        with tempfile.TemporaryDirectory(prefix=f"curve-{name}-") as tmp:
            sft, evaluation, weights, wall = curve(name, Path(tmp))
        steps = sorted(evaluation)
        shown = [s for i, s in enumerate(steps) if i % args.every == 0 or s == steps[-1]]
        print(f"\n{name}: {len(steps)} steps in {wall:.0f} s (warm-up {sft['warmup_s']:.0f} s); load average now {os.getloadavg()[0]:.2f}")
        print(f"{'':24} {'base':>6} {'warm-up':>8} " + " ".join(f"{s:>6}" for s in shown))
        print(f"{'held-out accuracy':24} {sft['base_accuracy']:6.2f} {sft['accuracy']:8.2f} " + " ".join(f"{evaluation[s]['accuracy']:6.2f}" for s in shown))
        print(f"{'mean reward':24} {'':6} {'':8} " + " ".join(f"{weights[s]['mean_reward']:6.3f}" for s in shown))
        print(f"{'sampled accuracy':24} {'':6} {'':8} " + " ".join(f"{weights[s]['success_rate']:6.2f}" for s in shown))
        best = max(evaluation[s]["accuracy"] for s in steps)
        print(f"rise over the warm-up: last {evaluation[steps[-1]]['accuracy'] - sft['accuracy']:+.2f}, best {best - sft['accuracy']:+.2f}")


if __name__ == "__main__":
    main()
