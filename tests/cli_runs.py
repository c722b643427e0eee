"""The project's commands run as processes over a Dagster home of their own, as a person at a
terminal runs them: `dagster asset materialize` of a range of steps, `dagster-rl train` interrupted
once it has printed a given line."""

import os
import subprocess
from pathlib import Path

from dagster import AssetKey, DagsterInstance

from tests import REPO
from tests.harness import new_dagster_home
from tests.servers import BIN
from tests.settings import write_experiments

QUIET = {"PYTHONWARNINGS": "ignore::FutureWarning,ignore:Parameter `include_sources`"}
CONSOLE = '{"loggers": {"console": {"config": {"log_level": "INFO"}}}}'


def home_with(tmp_path: Path, *raws: dict) -> tuple[Path, dict[str, str]]:
    home = new_dagster_home(tmp_path / "home")
    write_experiments(home / "experiments", *raws)
    DagsterInstance.from_config(str(home)).dispose()  # the schema, before two processes open it at once
    env = {**os.environ, **QUIET, "DAGSTER_HOME": str(home), "DAGSTER_RL_EXPERIMENTS": str(home / "experiments")}
    return home, env


def materialize(env: dict[str, str], exp: str, first: str, last: str) -> subprocess.Popen:
    argv = [str(BIN / "dagster"), "asset", "materialize", "-m", "assets.definitions", "--select", f"group:{exp}"]
    argv += ["--partition-range", f"{first}...{last}", "--config-json", CONSOLE]
    return subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def weights_steps(home: Path, exp: str) -> list[tuple[str, str]]:
    """(partition, run id) of every materialization of `<exp>/weights`, oldest first."""
    with DagsterInstance.from_config(str(home)) as instance:
        records = instance.fetch_materializations(AssetKey([exp, "weights"]), limit=1000, ascending=True).records
        return [(r.asset_materialization.partition, r.run_id) for r in records]


def train_until(env: dict[str, str], cwd: Path, argv: list[str], ready: str, sig: int, group: bool) -> tuple[int, list[str]]:
    """`dagster-rl train <argv>` in a session of its own (as a terminal's foreground job); once its
    output has a line holding `ready`, `sig` to its process group (a terminal's Ctrl-C reaches every
    process of the group) or to it alone (`kill`). (exit status, lines of output)."""
    proc = subprocess.Popen(
        [str(BIN / "dagster-rl"), "train", *argv], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if ready in line:
            (os.killpg if group else os.kill)(proc.pid, sig)
            break
    lines += proc.stdout.read().splitlines()
    return proc.wait(60), lines
