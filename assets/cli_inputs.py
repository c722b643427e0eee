"""What every `dagster-rl` command reads: an experiment by name, the instance of $DAGSTER_HOME, the
artifact store, a step's latest materialization; and what a command does when its reader closes
stdout.

Dagster is imported by the functions that use it, so that `--help` and `status` answer at once.
"""

import argparse
import os
import sys
from pathlib import Path

from assets.experiments import experiments_dir, missing_folder, problems, read
from dagster_rl.core.experiment import Experiment


def find_experiment(name: str) -> Experiment:
    files = read()
    if (missing := missing_folder(files)) is not None:
        sys.exit(f"dagster-rl: {missing}")
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


def open_store(args: argparse.Namespace, repair: bool = False):
    """The artifact store, read-only unless `repair` (verify --repair): nothing is moved aside."""
    from dagster_rl.store.artifact_store import ArtifactStore
    from resources.artifact_store import default_artifact_url

    return ArtifactStore(args.artifacts or default_artifact_url(), quarantine=repair)


NEW_HOME = (
    "make demo creates one there; or:\n"
    "    mkdir -p $DAGSTER_HOME && cp deploy/dagster.local.yaml $DAGSTER_HOME/dagster.yaml && .venv/bin/dagster instance migrate"
)


def home_problem() -> str | None:
    """What is wrong with $DAGSTER_HOME for Dagster (unset, relative, not a folder), and what to do."""
    from resources.artifact_store import DAGSTER_HOME_UNSET

    home = os.environ.get("DAGSTER_HOME", "").strip()
    if not home:
        return DAGSTER_HOME_UNSET
    if not os.path.isabs(home):
        return f"DAGSTER_HOME={home} is a relative path, which Dagster refuses: set an absolute one, e.g.\n    export DAGSTER_HOME=$PWD/{home}"
    if not Path(home).is_dir():
        return f"DAGSTER_HOME={home} is not a folder: {NEW_HOME}"
    return None


def open_instance():
    """The instance of $DAGSTER_HOME; exits saying what to set when it cannot be one (never a throwaway one)."""
    problem = home_problem()
    if problem:
        sys.exit(f"dagster-rl: {problem}")
    from dagster import DagsterInstance

    return DagsterInstance.get()


def latest(instance, exp: Experiment, asset: str, step: str | None) -> dict | None:
    """The metadata values of the latest materialization of `<exp>/<asset>` for `step` (None: an
    unpartitioned asset, the warm-up), and its run id."""
    from dagster import AssetKey, AssetRecordsFilter

    key = AssetKey([exp.name, asset])
    records = instance.fetch_materializations(
        AssetRecordsFilter(asset_key=key, asset_partitions=[step]) if step is not None else key, limit=1
    ).records
    if not records:
        return None
    return {"run_id": records[0].run_id, **{k: v.value for k, v in records[0].asset_materialization.metadata.items()}}


def not_ours_message(md: dict, what: str, step: str) -> str | None:
    from assets.predecessor import not_ours

    return not_ours(md, what, step or "0000")


def quiet_closed_stdout() -> None:
    """Point stdout at /dev/null, so that Python's flush at exit does not fail on the closed pipe again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass
