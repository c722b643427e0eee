"""`dagster-rl`: what the Dagster CLI does not say directly, read from the Dagster instance and the
artifact store ($DAGSTER_HOME/artifacts unless `--artifacts` names another fsspec URL), and the
subcommands tasks add (`dagster-rl serve`: a model over vLLM's OpenAI-compatible API).

Artifacts are found by the key a materialization records, checked to be a content key, under the
store given here: metadata never becomes a path, and a moved DAGSTER_HOME or store still works.
`status`, `lineage` and `verify` only read: a bad artifact is reported, never moved; `verify
--repair` moves the bad ones to the store's quarantine (as a run that reads them would).
"""

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from dagster import AssetKey, AssetRecordsFilter, DagsterInstance

from assets.driver import CHAIN, step_assets
from assets.experiments import experiments_dir, problems, read
from assets.predecessor import artifact_of
from dagster_rl.errors import CorruptArtifactError, DagsterRLError, StoreLinkError
from dagster_rl.experiment import Experiment, step_key
from dagster_rl.lineage import trace
from dagster_rl.store import ArtifactStore, check_key
from dagster_rl.task import BUILTIN_TASKS, task_of
from resources.artifact_store import DAGSTER_HOME_UNSET, default_artifact_url

COLUMNS = ("step", "state", "cache", "trials", "mean_reward", "success", "mean_turns", "weights_v", "attempt")


def latest(instance: DagsterInstance, exp: Experiment, asset: str, step: str) -> dict | None:
    """The metadata values of the latest materialization of `<exp>/<asset>` for `step`, and its run id."""
    records = instance.fetch_materializations(AssetRecordsFilter(asset_key=AssetKey([exp.name, asset]), asset_partitions=[step]), limit=1).records
    if not records:
        return None
    return {"run_id": records[0].run_id, **{k: v.value for k, v in records[0].asset_materialization.metadata.items()}}


def step_rows(instance: DagsterInstance, exp: Experiment, store: ArtifactStore | None = None) -> list[dict[str, str]]:
    """One row per step; with a store, a step whose artifacts are gone from it reads `missing`."""
    rows = []
    for step in exp.step_keys:
        md = latest(instance, exp, "weights", step)
        if md is None:
            rows.append({"step": step, "state": "-"})
            continue
        row = {
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
        notes = []
        if md.get("skipped_trials"):
            notes.append(f"{md['skipped_trials']} trials failed after their retries; a re-run of the step attempts them again")
        if md.get("supersedes"):
            notes.append(f"supersedes the materialization of {md['supersedes']}: {md.get('supersedes_reason', '')}")
        if store is not None:
            gone = [a for a in CHAIN if not _artifact_present(instance, exp, a, step, store)]
            if gone:
                row["state"] = "missing"
                notes.append(f"its {', '.join(gone)} artifact(s) are not in the store (moved aside or deleted): re-run from step {step}")
        row["notes"] = notes  # type: ignore[assignment]
        rows.append(row)
    return rows


def _artifact_present(instance: DagsterInstance, exp: Experiment, asset: str, step: str, store: ArtifactStore) -> bool:
    md = latest(instance, exp, asset, step)
    try:
        return md is not None and store.exists(*artifact_of(md, asset))
    except DagsterRLError:
        return False


def format_table(rows: list[dict[str, str]]) -> str:
    widths = {c: max(len(c), *(len(r.get(c, "")) for r in rows)) for c in COLUMNS}
    lines = ["  ".join(c.ljust(widths[c]) for c in COLUMNS)]
    lines += ["  ".join(r.get(c, "").ljust(widths[c]) for c in COLUMNS).rstrip() for r in rows]
    notes = [f"{r['step']}: {note}" for r in rows for note in r.get("notes", [])]
    return "\n".join(lines + notes)


def _experiment(name: str) -> Experiment:
    files = read()
    if name in files.experiments:
        if files.errors:
            print(f"dagster-rl: {problems(files)}", file=sys.stderr)
        return files.experiments[name]
    broken = [m for path, m in files.errors.items() if Path(path).stem == name]
    if broken:
        sys.exit("dagster-rl: " + "\n".join(broken))
    known = ", ".join(sorted(files.experiments)) or "none"
    more = f"\n{problems(files)}" if files.errors else ""
    sys.exit(f"dagster-rl: no experiment named {name!r} in {experiments_dir()}; known: {known}{more}")


def _store(args: argparse.Namespace, repair: bool = False) -> ArtifactStore:
    """The artifact store, read-only unless `repair` (verify --repair): nothing is moved aside."""
    return ArtifactStore(args.artifacts or default_artifact_url(), quarantine=repair)


def _instance() -> DagsterInstance:
    """The instance of $DAGSTER_HOME; exits saying what to set when it is unset (never a throwaway one)."""
    if not os.environ.get("DAGSTER_HOME", "").strip():
        sys.exit(f"dagster-rl: {DAGSTER_HOME_UNSET}")
    return DagsterInstance.get()


def cmd_status(args: argparse.Namespace) -> None:
    exp = _experiment(args.experiment)
    with _instance() as instance:
        rows = step_rows(instance, exp, _store(args))
    if not args.all:
        last = max((i for i, r in enumerate(rows) if r["state"] != "-"), default=-1)
        rows = rows[: max(last + 2, 1)]
    done = sum(r["state"] == "materialized" for r in rows)
    print(f"experiment {exp.name}: {done} of {exp.n_steps} steps materialized")
    print(format_table(rows))


def parse_step(exp: Experiment, text: str) -> str:
    """A step number (`7` or `0007`) of the experiment, as its partition key; exits with a message otherwise."""
    if not text.isdigit() or not 0 <= int(text) < exp.n_steps:
        sys.exit(f"dagster-rl: {text!r} is not a step of {exp.name}; give a number from 0 to {exp.n_steps - 1} (e.g. 7 or 0007)")
    return step_key(int(text))


def cmd_lineage(args: argparse.Namespace) -> None:
    exp = _experiment(args.experiment)
    step = parse_step(exp, args.step)
    with _instance() as instance:
        md = latest(instance, exp, "weights", step)
    if md is None:
        sys.exit(f"dagster-rl: {exp.name}/weights has no materialization for step {step}; run it first")
    store = _store(args)
    try:
        chain = trace(store, check_key(md.get("artifact_key"), f"artifact key of {exp.name}/weights {step}"))
    except DagsterRLError as e:
        sys.exit(f"dagster-rl: {e}")
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


def cmd_verify(args: argparse.Namespace) -> None:
    """Re-hash every artifact the experiment's latest materializations name and compare its content
    hash with the one the materialization recorded; report each bad one (`--repair`: move it aside)."""
    exp = _experiment(args.experiment)
    store = _store(args, repair=args.repair)
    checked, bad = 0, []  # bad: (step, what is wrong, what --repair did)
    with _instance() as instance:
        for step, asset, md in _materializations(instance, exp):
            checked += 1
            problem, fix = artifact_problem(store, md, asset)
            if problem is not None:
                repaired = fix() if args.repair and fix is not None else None
                bad.append((step, f"{asset} {step}".rstrip(), problem, repaired))
    print(f"verified {checked} artifacts of {exp.name} in {store.url}: {len(bad)} bad")
    for _, where, problem, repaired in bad:
        print(f"  BAD {where}: {problem}")
        if repaired:
            print(f"    repaired: {repaired}")
    if not bad:
        return
    first = min(step or "0000" for step, *_ in bad)  # the warm-up ('') comes before step 0000
    if args.repair:
        print(f"Re-run from step {first}: what was moved aside is computed again (the same bytes: everything is seeded).")
    else:
        print(
            f"`dagster-rl verify {exp.name} --repair` moves the bad artifacts aside (so does the next run that reads one, "
            f"and computes it again); then re-run from step {first}."
        )
    sys.exit(1)


def _materializations(instance: DagsterInstance, exp: Experiment):
    """(step, asset, metadata) of the latest materialization of every step asset of every step, and
    of the warm-up (`<exp>/sft`, step ''), when there is one."""
    spec = task_of(exp.kind).warmup_of(exp)
    if spec is not None:
        records = instance.fetch_materializations(AssetKey([exp.name, spec.name]), limit=1).records
        if records:
            md = {k: v.value for k, v in records[0].asset_materialization.metadata.items()}
            yield "", spec.name, {"artifact_path": f"weights/{md.get('artifact_key')}", **md}  # a warm-up is weights
    for step in exp.step_keys:
        for asset in step_assets(exp):
            md = latest(instance, exp, asset, step)
            if md is not None:
                yield step, asset, md


def artifact_problem(store: ArtifactStore, md: dict, asset: str) -> tuple[str | None, Any]:
    """What is wrong with the artifact a materialization names (its files, a link, or a content
    hash other than the one the materialization recorded), and how `--repair` fixes it (or None)."""
    try:
        kind, key = artifact_of(md, asset)
    except DagsterRLError as e:
        return str(e), None
    error = store.problem(kind, key)
    if isinstance(error, StoreLinkError):
        return str(error), lambda: store.move_link_aside(error)
    if isinstance(error, CorruptArtifactError):
        return str(error), lambda: store.move_aside(kind, key)
    if error is not None:
        return str(error), None
    recorded, stored = md.get("content_hash"), store.ref(kind, key).content_hash
    if recorded != stored:
        return (
            f"artifact {kind}/{key}: the materialization recorded content hash {recorded}, the store holds {stored} "
            "(its files and manifest were changed together after the step, or the materialization was not the "
            "step's own)"
        ), lambda: store.move_aside(kind, key, reason="mismatch")
    return None, None


def _rubric_weights(rubric: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in rubric.items() if k != "name")


def _seed_span(seeds: dict[str, int]) -> str:
    ids = sorted(seeds)
    return f"{ids[0]}={seeds[ids[0]]} .. {ids[-1]}={seeds[ids[-1]]}" if ids else "none"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="dagster-rl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifacts", default="", help="the artifact store's fsspec URL (default: $DAGSTER_HOME/artifacts)")
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
    verify = sub.add_parser(
        "verify",
        help="re-hash every artifact of an experiment's steps, compare it with its materialization; report each bad one (exit 1)",
    )
    verify.add_argument("experiment")
    verify.add_argument("--repair", action="store_true", help="move each bad artifact to the store's quarantine (nothing is deleted)")
    verify.set_defaults(fn=cmd_verify)
    for kind in BUILTIN_TASKS:  # the tasks' own subcommands (the language models' `serve`)
        for name, command in task_of(kind).commands.items():
            cmd = sub.add_parser(name, help=command.help)
            command.add_arguments(cmd)
            cmd.set_defaults(fn=command.run)
    args = parser.parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    main()
