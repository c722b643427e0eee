"""`dagster-rl`: what the Dagster CLI does not say directly, read from the Dagster instance, and the
subcommands tasks add (`dagster-rl serve`: a model over vLLM's OpenAI-compatible API)."""

import argparse
import json
import os
import sys
from pathlib import Path

from dagster import AssetKey, AssetRecordsFilter, DagsterInstance

from assets.definitions import DEFAULT_EXPERIMENTS
from dagster_rl.experiment import Experiment, step_key
from dagster_rl.experiment_files import load_experiments
from dagster_rl.lineage import trace
from dagster_rl.store import ArtifactStore
from dagster_rl.task import BUILTIN_TASKS, task_of

COLUMNS = ("step", "state", "cache", "trials", "mean_reward", "success", "mean_turns", "weights_v", "attempt")


def step_rows(instance: DagsterInstance, exp: Experiment) -> list[dict[str, str]]:
    key = AssetKey([exp.name, "weights"])
    rows = []
    for step in exp.step_keys:
        records = instance.fetch_materializations(AssetRecordsFilter(asset_key=key, asset_partitions=[step]), limit=1).records
        if not records:
            rows.append({"step": step, "state": "-"})
            continue
        md = {k: v.value for k, v in records[0].asset_materialization.metadata.items()}
        rows.append(
            {
                "step": step,
                "state": "materialized",
                "cache": str(md.get("cache", "")),
                "trials": f"{md.get('n_trials')}/{md.get('n_trials_planned')}",
                "mean_reward": f"{md.get('mean_reward', float('nan')):.3f}",
                "success": f"{md.get('success_rate', float('nan')):.2f}",
                "mean_turns": f"{md['mean_turns']:.2f}" if "mean_turns" in md else "",
                "weights_v": str(md.get("weights_version", "")),
                "attempt": str(md.get("attempt", "")),
            }
        )
    return rows


def format_table(rows: list[dict[str, str]]) -> str:
    widths = {c: max(len(c), *(len(r.get(c, "")) for r in rows)) for c in COLUMNS}
    lines = ["  ".join(c.ljust(widths[c]) for c in COLUMNS)]
    lines += ["  ".join(r.get(c, "").ljust(widths[c]) for c in COLUMNS).rstrip() for r in rows]
    return "\n".join(lines)


def _experiment(name: str) -> Experiment:
    experiments = load_experiments(Path(os.environ.get("DAGSTER_RL_EXPERIMENTS", DEFAULT_EXPERIMENTS)))
    if name not in experiments:
        sys.exit(f"dagster-rl: no experiment named {name!r}; known: {', '.join(sorted(experiments))}")
    return experiments[name]


def cmd_status(args: argparse.Namespace) -> None:
    exp = _experiment(args.experiment)
    with DagsterInstance.get() as instance:
        rows = step_rows(instance, exp)
    if not args.all:
        last = max((i for i, r in enumerate(rows) if r["state"] != "-"), default=-1)
        rows = rows[: max(last + 2, 1)]
    print(f"experiment {exp.name}: {sum(r['state'] != '-' for r in rows)} of {exp.n_steps} steps materialized")
    print(format_table(rows))


def cmd_lineage(args: argparse.Namespace) -> None:
    exp = _experiment(args.experiment)
    step = step_key(int(args.step))
    with DagsterInstance.get() as instance:
        records = instance.fetch_materializations(
            AssetRecordsFilter(asset_key=AssetKey([exp.name, "weights"]), asset_partitions=[step]), limit=1
        ).records
    if not records:
        sys.exit(f"dagster-rl: {exp.name}/weights has no materialization for step {step}; run it first")
    md = records[0].asset_materialization.metadata
    uri, key = str(md["artifact_uri"].value), str(md["artifact_key"].value)
    store = ArtifactStore(uri[: -len(f"/weights/{key}")])
    chain = trace(store, key)
    if args.json:
        print(json.dumps([dict(s.model_dump(), seeds_hash=s.seeds_hash) for s in chain], indent=2))
        return
    print(f"lineage of {exp.name}/weights {step} (artifacts in {store.url}, experiment seed {exp.seed})")
    for s in chain:
        b = s.behavior_policy
        print(f"step {step_key(s.step)}  weights v{s.weights_version} {s.weights_hash[:16]} (key {s.weights_key[:16]})")
        print(f"  <- rewards  {s.rewards_hash[:16]}  rubric {s.rubric.get('name')} {_rubric_weights(s.rubric)}")
        print(f"  <- rollouts {s.rollouts_hash[:16]}  {s.n_trajectories} trajectories, {len(s.skipped)} skipped, "
              f"seeds {s.seeds_hash[:16]} ({_seed_span(s.seeds)})")
        print(f"  <- behavior policy: weights {b['partition']} v{b['version']} {str(b['content_hash'])[:16]}")


def _rubric_weights(rubric: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in rubric.items() if k != "name")


def _seed_span(seeds: dict[str, int]) -> str:
    ids = sorted(seeds)
    return f"{ids[0]}={seeds[ids[0]]} .. {ids[-1]}={seeds[ids[-1]]}" if ids else "none"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="dagster-rl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    status = sub.add_parser("status", help="table of an experiment's steps, read from $DAGSTER_HOME")
    status.add_argument("experiment")
    status.add_argument("--all", action="store_true", help="list every step, not just up to the first missing one")
    status.set_defaults(fn=cmd_status)
    lineage = sub.add_parser("lineage", help="trace a step's weights back to step 0 through every behavior policy")
    lineage.add_argument("experiment")
    lineage.add_argument("step", help="step number, e.g. 7 or 0007")
    lineage.add_argument("--json", action="store_true", help="everything, every trial seed included, as JSON")
    lineage.set_defaults(fn=cmd_lineage)
    for kind in BUILTIN_TASKS:  # the tasks' own subcommands (the language models' `serve`)
        for name, command in task_of(kind).commands.items():
            cmd = sub.add_parser(name, help=command.help)
            command.add_arguments(cmd)
            cmd.set_defaults(fn=command.run)
    args = parser.parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    main()
