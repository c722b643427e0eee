"""A careless or hostile user: corrupted stores, tampered metadata, bad arguments, a read-only store.

Each test names the finding of issue 10 it reproduces.
"""

import shutil

import pytest
from dagster import AssetKey, AssetMaterialization

from assets.cli import main
from dagster_rl import counters
from resources import ArtifactStoreResource
from tests.conftest import demo_settings
from tests.harness import failure_message
from tests.test_store import ReadOnlyFileSystem  # noqa: F401  (registers the readonly:// protocol)

STEPS = ["0000", "0001", "0002", "0003"]


@pytest.fixture
def four_steps(lab):
    """Steps 0000..0003 of the demo settings, in a home of their own."""
    made = lab("four", demo_settings())
    assert made.run("demo", "0000", "0003").success
    return made


def cli(lab, monkeypatch, capsys, *argv: str) -> tuple[int, str]:
    """`dagster-rl <argv>` against the lab: (exit status, stdout + stderr, or the exit message)."""
    monkeypatch.setenv("DAGSTER_HOME", str(lab.home))
    monkeypatch.setenv("DAGSTER_RL_EXPERIMENTS", str(lab.home / "experiments"))
    try:
        main(list(argv))
        code = 0
    except SystemExit as e:
        code, message = (e.code, "") if isinstance(e.code, int) else (1, str(e.code))
        captured = capsys.readouterr()
        return code, captured.out + captured.err + message
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def artifact_dir(lab, asset: str, step: str):
    md = lab.latest("demo", asset, step)
    return lab.home / "artifacts" / md["artifact_path"]


# ---- 4. corrupted or tampered artifacts ------------------------------------------------------


def test_a_truncated_rollouts_file_is_found_by_verify_moved_aside_and_recomputed(four_steps, monkeypatch, capsys):
    lab = four_steps
    data = artifact_dir(lab, "rollouts", "0001") / "data.json"
    before = lab.latest("demo", "rollouts", "0001")
    data.write_bytes(data.read_bytes()[:100])

    code, out = cli(lab, monkeypatch, capsys, "verify", "demo")
    assert code == 1 and "verified 12 artifacts of demo" in out and ": 1 bad" in out
    assert f"BAD rollouts 0001: artifact rollouts/{before['artifact_key']}: its file data.json is corrupt" in out

    again = counters.snapshot()
    assert lab.run("demo", "0000", "0003").success  # the run moves it aside and computes it again
    redone = lab.latest("demo", "rollouts", "0001")
    assert redone["cache"] == "miss" and redone["trials_executed"] == 24
    assert redone["content_hash"] == before["content_hash"]  # the same bytes: seeded trials
    assert counters.read("trials_executed") - again.get("trials_executed", 0) == 24
    assert [p.name.split(".")[0] for p in (lab.home / "artifacts" / "quarantine" / "rollouts").iterdir()] == [before["artifact_key"]]
    assert cli(lab, monkeypatch, capsys, "verify", "demo")[0] == 0


def test_truncated_weights_of_a_predecessor_are_moved_aside_and_the_error_says_which_step_to_run(four_steps, monkeypatch, capsys):
    lab = four_steps
    manifest = artifact_dir(lab, "weights", "0002") / "manifest.json"
    key = lab.latest("demo", "weights", "0002")["artifact_key"]
    manifest.write_bytes(manifest.read_bytes()[:30])

    first = failure_message(lab.run("demo", "0003", "0003", raise_on_error=False))
    assert f"artifact weights/{key} has an unreadable manifest.json (30 bytes" in first
    assert "It was moved aside to" in first and "re-run the range from step 0002" in first
    second = failure_message(lab.run("demo", "0003", "0003", raise_on_error=False))
    assert "are not in the artifact store" in second and "re-run the range from step 0002" in second  # not the same crash again

    code, out = cli(lab, monkeypatch, capsys, "status", "demo")
    assert "experiment demo: 3 of 16 steps materialized" in out
    assert "0002  missing" in out and "0002: its weights artifact(s) are not in the store (moved aside or deleted): re-run from step 0002" in out
    assert lab.run("demo", "0002", "0003").success
    assert lab.latest("demo", "weights", "0002")["artifact_key"] == key and lab.latest("demo", "weights", "0002")["cache"] == "miss"


def test_a_data_file_deleted_under_its_manifest_is_recomputed_not_a_raw_error(four_steps):
    lab = four_steps
    (artifact_dir(lab, "rewards", "0003") / "data.json").unlink()
    result = lab.run("demo", "0000", "0003")
    assert result.success
    assert lab.latest("demo", "rewards", "0003")["cache"] == "miss"
    warnings = [e.message for e in lab.instance.all_logs(result.run_id) if e.level >= 30]
    assert any("its file data.json is missing, though its manifest lists it. It was moved aside to" in w for w in warnings), warnings


# ---- 5. metadata is never a path -------------------------------------------------------------


def test_a_tampered_artifact_key_in_metadata_is_refused_naming_it(four_steps, monkeypatch, capsys):
    lab = four_steps
    exp = lab.experiments["demo"]
    evil = lab.home / "evil" / "w"
    shutil.copytree(artifact_dir(lab, "weights", "0003"), evil)  # a plausible folder outside the store
    lab.instance.report_runless_asset_event(
        AssetMaterialization(
            asset_key=AssetKey(["demo", "weights"]),
            partition="0003",
            metadata={"artifact_key": "../../evil/w", "training_hash": exp.training_hash(), "checks_failed": ""},
        )
    )
    message = failure_message(lab.run("demo", "0004", "0004", raise_on_error=False))
    assert "artifact key of demo/weights 0003 '../../evil/w' is not a 64-digit hex content key; refusing to build a path" in message
    assert lab.instance.get_run_by_id(lab.instance.get_run_records()[0].dagster_run.run_id).tags[
        "dagster/retry_on_asset_or_op_failure"
    ] == "false"
    code, out = cli(lab, monkeypatch, capsys, "lineage", "demo", "3")
    assert code == 1 and "'../../evil/w' is not a 64-digit hex content key" in out


def test_lineage_follows_a_moved_dagster_home(four_steps, monkeypatch, capsys, tmp_path):
    lab = four_steps
    lab.close()
    moved = tmp_path / "moved_home"
    shutil.move(str(lab.home), moved)
    lab.home = moved
    code, out = cli(lab, monkeypatch, capsys, "lineage", "demo", "3")
    assert code == 0, out
    assert f"artifacts in file://{moved}/artifacts" in out and "step 0000  weights v1" in out


# ---- 7. errors that are messages -------------------------------------------------------------


def test_a_reversed_range_says_how_to_write_it(lab):
    fresh = lab("reversed", demo_settings())
    message = failure_message(fresh.run("demo", "0005", "0003", raise_on_error=False))
    assert "the range 0005...0003 of demo holds no step: its first step comes after its last: give it as 0003...0005" in message


@pytest.mark.parametrize("step", ["abc", "-1", "16", "3.5"])
def test_lineage_of_a_step_that_is_not_one_says_which_are(four_steps, monkeypatch, capsys, step):
    code, out = cli(four_steps, monkeypatch, capsys, "lineage", "demo", step)
    assert code == 1 and f"{step!r} is not a step of demo; give a number from 0 to 15" in out


def test_status_needs_no_judge(four_steps, monkeypatch, capsys):
    monkeypatch.setenv("DAGSTER_RL_JUDGE_URL", "http://127.0.0.1:9/v1")  # no DAGSTER_RL_JUDGE_MODEL
    code, out = cli(four_steps, monkeypatch, capsys, "status", "demo")
    assert code == 0 and "experiment demo: 4 of 16 steps materialized" in out


def test_a_read_only_store_serves_a_range_of_cache_hits(four_steps):
    lab = four_steps
    readonly = lab.reopen(artifact_store=ArtifactStoreResource(url=f"readonly://{lab.home}/artifacts"))
    assert readonly.run("demo", "0000", "0003").success
    assert all(readonly.latest("demo", a, s)["cache"] == "hit" for a in ("rollouts", "rewards", "weights") for s in STEPS)
    message = failure_message(readonly.run("demo", "0004", "0004", raise_on_error=False))
    assert "could not write artifact" in message and "Read-only file system" in message
