"""`dagster-rl status` and `dagster-rl lineage` against a real instance; what the commands import;
where `dagster-rl train` finds its runs' code location."""

import json
import os
import subprocess
import sys

import pytest

from assets.cli import main


def test_status_lists_every_step_with_cache_and_reward(uninterrupted, monkeypatch, capsys):
    monkeypatch.setenv("DAGSTER_HOME", str(uninterrupted.home))
    monkeypatch.setenv("DAGSTER_RL_EXPERIMENTS", str(uninterrupted.home / "experiments"))
    main(["status", "demo"])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "experiment demo: 8 of 16 steps materialized"
    rows = [line.split() for line in out[2:]]
    assert [r[0] for r in rows] == [*(f"{i:04d}" for i in range(8)), "0008...0015"]  # every step of the experiment
    assert rows[8] == ["0008...0015", "not", "materialized"]
    md = uninterrupted.latest("demo", "weights", "0007")
    assert rows[7][3] == "24/24" and float(rows[7][4]) == round(md["mean_reward"], 3) and rows[7][7] == "8"
    main(["status", "demo", "--all"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [r[0] for r in rows] == [f"{i:04d}" for i in range(16)] and rows[15] == ["0015", "not", "materialized"]


def test_lineage_walks_every_behavior_policy_back_to_step_0(uninterrupted, monkeypatch, capsys):
    monkeypatch.setenv("DAGSTER_HOME", str(uninterrupted.home))
    monkeypatch.setenv("DAGSTER_RL_EXPERIMENTS", str(uninterrupted.home / "experiments"))
    main(["lineage", "demo", "5", "--json"])
    chain = json.loads(capsys.readouterr().out)
    assert [s["step"] for s in chain] == [5, 4, 3, 2, 1, 0]
    for newer, older in zip(chain, chain[1:], strict=False):
        assert newer["behavior_policy"]["content_hash"] == older["weights_hash"]
    assert chain[-1]["behavior_policy"]["partition"] == "initial"
    for s in chain:
        md = {a: uninterrupted.latest("demo", a, f"{s['step']:04d}") for a in ("rollouts", "rewards", "weights")}
        assert s["weights_hash"] == md["weights"]["content_hash"]
        assert s["rewards_hash"] == md["rewards"]["content_hash"]
        assert s["rollouts_hash"] == md["rollouts"]["content_hash"]
        assert s["rubric"]["name"] == "default" and len(s["seeds"]) == 24 and s["experiment"] == "demo"
    main(["lineage", "demo", "1"])
    text = capsys.readouterr().out
    assert "step 0001  weights v2" in text and "<- behavior policy: weights initial v0" in text
    main(["lineage", "demo", "1", "--trial", "s1-p0-n0"])  # a trial of a task whose records hold no tokens
    last = capsys.readouterr().out.splitlines()[-2:]
    assert last[0].startswith("trial s1-p0-n0 (step 0001, seed ") and ": reward " in last[0]
    assert json.loads(last[1])["world_id"] and "trial_id" not in json.loads(last[1])


IMPORTED = """import sys
from assets.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(sorted(m for m in ("torch", "peft", "transformers", "kubernetes", "dagster") if m in sys.modules))
"""


def imported_by(home, *argv: str) -> list[str]:
    env = {**os.environ, "DAGSTER_HOME": str(home)}
    env.pop("DAGSTER_RL_EXPERIMENTS", None)
    done = subprocess.run(
        [sys.executable, "-c", IMPORTED, *argv], env=env, capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(done.stdout.splitlines()[-1].replace("'", '"'))


def test_help_and_status_import_neither_torch_nor_kubernetes(tmp_path):
    """`dagster-rl --help`, `serve --help` and `status` answer without torch, peft, transformers (the language models'
    modules) or Kubernetes' client; `--help` without Dagster. (How fast: bench/cli_startup.py.)"""
    assert imported_by(tmp_path, "--help") == []
    assert imported_by(tmp_path, "status", "demo") == ["dagster"]
    assert imported_by(tmp_path, "runs", "demo") == ["dagster"]
    assert imported_by(tmp_path, "serve", "--help") == []  # a task's command: its server's module loads when it runs


def test_train_runs_belong_to_the_workspace_location_that_loads_the_definitions(tmp_path):
    """The origin of a `dagster-rl train` run: the location of workspace.yaml that loads
    assets.definitions, as Dagster's workspace loader reads it; a workspace without one is refused."""
    from assets.workspace_run import job_origin
    from dagster_rl.base.errors import DagsterRLError

    origin = job_origin("demo_train")
    assert origin.repository_origin.code_location_origin.location_name == "dagster_rl"
    assert (origin.repository_origin.repository_name, origin.job_name) == ("__repository__", "demo_train")
    other = tmp_path / "workspace.yaml"
    other.write_text("load_from:\n  - python_module: {module_name: assets.experiment_errors, location_name: files}\n")
    with pytest.raises(
        DagsterRLError, match=r"names no code location that loads the module assets.definitions \(its locations: files\)"
    ):
        job_origin("demo_train", other)
