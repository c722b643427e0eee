"""A careless or hostile user: corrupted stores, tampered metadata, bad arguments, a read-only store.

Each test names the finding of issue 10 (or, in the last section, of issue 20) it reproduces.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from dagster import AssetKey, AssetMaterialization

from assets.cli import main
from dagster_rl.base import counters
from resources import ArtifactStoreResource
from tests import REPO
from tests.harness import failure_message
from tests.settings import demo_settings

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
    assert [p.name.split(".")[0] for p in (lab.home / "artifacts" / "quarantine" / "rollouts").iterdir()] == [
        before["artifact_key"]
    ]
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
    assert (
        re.search(r"^0002 +missing ", out, re.M)
        and "0002: its weights artifact(s) are not in the store (moved aside or deleted): re-run from step 0002" in out
    )
    assert lab.run("demo", "0002", "0003").success
    assert (
        lab.latest("demo", "weights", "0002")["artifact_key"] == key and lab.latest("demo", "weights", "0002")["cache"] == "miss"
    )


def test_a_data_file_deleted_under_its_manifest_is_recomputed_not_a_raw_error(four_steps):
    lab = four_steps
    (artifact_dir(lab, "rewards", "0003") / "data.json").unlink()
    result = lab.run("demo", "0000", "0003")
    assert result.success
    assert lab.latest("demo", "rewards", "0003")["cache"] == "miss"
    warnings = [e.message for e in lab.instance.all_logs(result.run_id) if e.level >= 30]
    assert any("its file data.json is missing, though its manifest lists it. It was moved aside to" in w for w in warnings), (
        warnings
    )


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
    assert (
        "artifact key of demo/weights 0003 '../../evil/w' is not a 64-digit hex content key; refusing to build a path" in message
    )
    assert (
        lab.instance.get_run_by_id(lab.instance.get_run_records()[0].dagster_run.run_id).tags[
            "dagster/retry_on_asset_or_op_failure"
        ]
        == "false"
    )
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


# ---- issue 20: trust nothing the step did not compute ---------------------------------------


def tamper(art_dir, change) -> None:
    """Change an artifact's data.json and its manifest together, consistently: the manifest's own
    hashes then vouch for the change."""
    from dagster_rl.base.hashing import canonical_json, sha256_hex

    data = canonical_json(change(json.loads((art_dir / "data.json").read_bytes())))
    (art_dir / "data.json").write_bytes(data)
    manifest = json.loads((art_dir / "manifest.json").read_bytes())
    manifest["files"]["data.json"] = sha256_hex(data)
    (art_dir / "manifest.json").write_bytes(canonical_json(manifest))


def seen_foreign_notes(rollouts: dict) -> dict:
    rollouts["trajectories"][0]["foreign_notes_seen"] = 5
    return rollouts


def test_rollouts_changed_with_their_manifest_are_caught_by_verify_and_stop_the_step(four_steps, monkeypatch, capsys):
    """Finding 3: data and manifest edited together passed `verify`, and the next step trained from them."""
    lab = four_steps
    before = lab.latest("demo", "rollouts", "0001")
    tamper(artifact_dir(lab, "rollouts", "0001"), seen_foreign_notes)
    stored = lab.store().ref("rollouts", before["artifact_key"]).content_hash

    code, out = cli(lab, monkeypatch, capsys, "verify", "demo")
    assert code == 1 and ": 1 bad" in out, out
    assert (
        f"BAD rollouts 0001: artifact rollouts/{before['artifact_key']}: the materialization recorded content hash {before['content_hash']}, the store holds {stored}"
        in out
    )
    assert "`dagster-rl verify demo --repair` moves the bad artifacts aside" in out and "re-run from step 0001" in out
    code, out = cli(lab, monkeypatch, capsys, "lineage", "demo", "3")  # issue 24: lineage flags it as verify does
    assert (
        code == 1
        and f"  MISMATCH rollouts 0001: artifact rollouts/{before['artifact_key']}: the materialization recorded content hash {before['content_hash']}, the store holds {stored}"
        in out
    ), out
    assert "1 mismatch(es) with what Dagster recorded" in out and "re-run from step 0001" in out

    message = failure_message(lab.run("demo", "0000", "0003", raise_on_error=False))
    assert (
        f"artifact rollouts/{before['artifact_key']} is not what Dagster recorded: the materialization of demo/rollouts 0001 recorded content hash {before['content_hash']}, the store holds {stored}"
        in message
    )
    assert "It was moved aside to" in message and "Then re-run the range from step 0001." in message
    assert lab.latest("demo", "rollouts", "0001")["content_hash"] == before["content_hash"], "nothing was materialized from it"
    assert lab.run("demo", "0000", "0003").success  # the fix the error names
    redone = lab.latest("demo", "rollouts", "0001")
    assert redone["cache"] == "miss" and redone["content_hash"] == before["content_hash"]
    assert cli(lab, monkeypatch, capsys, "verify", "demo")[0] == 0


def test_predecessor_weights_changed_with_their_manifest_are_refused_naming_both_hashes(four_steps, monkeypatch, capsys):
    lab = four_steps
    md = lab.latest("demo", "weights", "0002")

    def all_mass_on_doc_0(weights: dict) -> dict:
        weights["doc_prior"] = {w: [1.0] + [0.0] * (len(p) - 1) for w, p in weights["doc_prior"].items()}
        return weights

    tamper(artifact_dir(lab, "weights", "0002"), all_mass_on_doc_0)
    stored = lab.store().ref("weights", md["artifact_key"]).content_hash
    message = failure_message(lab.run("demo", "0003", "0003", raise_on_error=False))
    assert (
        f"the materialization of demo/weights 0002 recorded content hash {md['content_hash']}, the store holds {stored}"
        in message
    )
    assert "Then re-run the range from step 0002." in message
    assert lab.run("demo", "0002", "0003").success
    assert lab.latest("demo", "weights", "0002")["content_hash"] == md["content_hash"]


def report(lab, name: str, partition: str, metadata: dict) -> None:
    """A runless materialization (the UI's "Report materialization", or the API), as a careless user makes one."""
    from dagster import MetadataValue

    values = {k: MetadataValue.json(v) if isinstance(v, dict) else v for k, v in metadata.items()}
    lab.instance.report_runless_asset_event(
        AssetMaterialization(asset_key=AssetKey([name, "weights"]), partition=partition, metadata=values)
    )


def test_another_steps_weights_reported_as_the_predecessor_are_refused(four_steps, monkeypatch, capsys):
    """Finding 3: step 0001's metadata reported as step 0004 made step 0005 train from step 0001's weights."""
    lab = four_steps
    one = lab.latest("demo", "weights", "0001")
    report(lab, "demo", "0003", one)  # every field of step 0001's materialization, content hash included
    code, out = cli(lab, monkeypatch, capsys, "verify", "demo")  # issue 24: verify found nothing wrong
    assert code == 1 and ": 1 bad" in out, out
    assert (
        f"BAD weights 0003: the materialization of demo/weights 0003 names artifact weights/{one['artifact_key']}, which "
        "step 0001 of experiment demo made: not the step's own" in out
    ), out
    assert "then re-run from step 0003" in out
    code, out = cli(lab, monkeypatch, capsys, "lineage", "demo", "3")  # it printed step 0001's chain under 0003's name, unflagged
    assert (
        code == 1
        and f"  MISMATCH weights 0003: the materialization of demo/weights 0003 names artifact weights/{one['artifact_key']}"
        in out
    ), out
    assert "1 mismatch(es) with what Dagster recorded" in out and "re-run from step 0003." in out, out
    done = lineage_into_a_closed_pipe(lab, "demo", "3")  # `lineage demo 3 | head -1`: it exited 0 without its summary
    assert (
        done.returncode == 1 and "1 mismatch(es) with what Dagster recorded" in done.stderr and "Traceback" not in done.stderr
    ), done.stderr
    result = lab.run("demo", "0004", "0004", raise_on_error=False)
    message = failure_message(result)
    assert (
        f"the materialization of demo/weights 0003 points to artifact weights/{one['artifact_key']}, which step 0001 of "
        "experiment demo trained (stats.json); step 0004 of demo trains only from the weights of step 0003 of demo." in message
    ), message
    assert "refusing to train from it. To fix, re-run the range from step 0003" in message
    assert lab.instance.get_run_by_id(result.run_id).tags["dagster/retry_on_asset_or_op_failure"] == "false"
    assert lab.run("demo", "0003", "0004").success  # the fix the error names
    assert lab.latest("demo", "rollouts", "0004")["behavior_policy"]["partition"] == "0003"
    assert lab.latest("demo", "weights", "0003")["content_hash"] != one["content_hash"]


def test_a_materialization_without_metadata_is_not_dagster_rls_and_says_the_step_to_re_run(four_steps, monkeypatch, capsys):
    """Issue 24: a runless materialization without metadata showed as `None/None nan`, and the run
    after it said to re-run from 0000 (its `training_hash` was None)."""
    lab = four_steps
    report(lab, "demo", "0004", {})
    said = "the materialization of demo/weights 0004 was not written by dagster-rl: it records no artifact"
    code, out = cli(lab, monkeypatch, capsys, "status", "demo")
    row = next(line for line in out.splitlines() if line.startswith("0004"))
    assert code == 0 and row.split() == ["0004", "foreign"] and "None" not in out and "nan" not in out, out
    assert f"0004: {said}" in out and "Re-run the range from step 0004" in out
    for argv in (("verify", "demo"), ("lineage", "demo", "4")):
        code, out = cli(lab, monkeypatch, capsys, *argv)
        assert code == 1 and said in out and "step 0004" in out and "0000" not in out.split(said)[1], out
    message = failure_message(lab.run("demo", "0005", "0005", raise_on_error=False))
    assert said in message and "Re-run the range from step 0004" in message and "from 0000" not in message, message
    assert lab.run("demo", "0004", "0005").success  # the fix it names


def lineage_into_a_closed_pipe(lab, *argv: str) -> subprocess.CompletedProcess:
    """`dagster-rl lineage <argv>` with its stdout a pipe whose reader is gone before anything is written."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write fails
    env = {**os.environ, "DAGSTER_HOME": str(lab.home), "DAGSTER_RL_EXPERIMENTS": str(lab.home / "experiments")}
    done = subprocess.run(
        [str(Path(sys.executable).parent / "dagster-rl"), "lineage", *argv], stdout=write_end, stderr=subprocess.PIPE,
        env=env, text=True, timeout=120,
    )  # fmt: skip
    os.close(write_end)
    return done


def test_lineage_into_a_closed_pipe_ends_quietly(four_steps):
    """Issue 24: `dagster-rl lineage demo 3 | head -1` ended in a BrokenPipeError traceback."""
    done = lineage_into_a_closed_pipe(four_steps, "demo", "3", "--json")
    assert done.returncode == 0 and done.stderr == "", done.stderr


def test_another_experiments_weights_reported_as_the_predecessor_are_refused(lab):
    both = lab("two", demo_settings(), demo_settings(name="other", seed=7))
    assert both.run("demo", "0000", "0001").success and both.run("other", "0000", "0001").success
    theirs = both.latest("other", "weights", "0001")
    report(both, "demo", "0001", {**theirs, "training_hash": both.experiments["demo"].training_hash()})
    message = failure_message(both.run("demo", "0002", "0002", raise_on_error=False))
    assert (
        f"points to artifact weights/{theirs['artifact_key']}, which step 0001 of experiment other trained (stats.json)"
        in message
    )
    assert "step 0002 of demo trains only from the weights of step 0001 of demo" in message


def test_lineage_only_reads_and_verify_repair_moves_bad_artifacts_aside(four_steps, monkeypatch, capsys):
    """Finding 7: `dagster-rl lineage`, a read command, moved corrupt artifacts to quarantine."""
    lab = four_steps
    key = lab.latest("demo", "rewards", "0002")["artifact_key"]
    data = artifact_dir(lab, "rewards", "0002") / "data.json"
    data.write_bytes(data.read_bytes()[:50])
    quarantine = lab.home / "artifacts" / "quarantine"

    code, out = cli(lab, monkeypatch, capsys, "lineage", "demo", "3")
    assert code == 1 and f"artifact rewards/{key}: its file data.json is corrupt" in out
    assert "Nothing was moved (a read-only command): `dagster-rl verify <experiment> --repair` moves it aside" in out
    assert data.exists() and not quarantine.exists()
    assert cli(lab, monkeypatch, capsys, "status", "demo")[0] == 0 and not quarantine.exists()
    assert cli(lab, monkeypatch, capsys, "verify", "demo")[0] == 1 and not quarantine.exists()

    code, out = cli(lab, monkeypatch, capsys, "verify", "demo", "--repair")
    assert code == 1 and f"BAD rewards 0002: artifact rewards/{key}: its file data.json is corrupt" in out
    assert f"repaired: It was moved aside to {lab.home}/artifacts/quarantine/rewards/{key}." in out
    assert "Re-run from step 0002" in out
    assert not data.exists() and [p.name.split(".")[0] for p in (quarantine / "rewards").iterdir()] == [key]
    assert lab.run("demo", "0000", "0003").success and cli(lab, monkeypatch, capsys, "verify", "demo")[0] == 0


def test_a_data_file_linked_outside_the_store_is_reported_and_never_read(four_steps, monkeypatch, capsys):
    """Finding 2: a data.json replaced by a link to an outside file (manifest updated) passed verify,
    and the run read the outside file into its event log."""
    from dagster_rl.base.hashing import canonical_json, sha256_hex

    lab = four_steps
    secret = lab.home / "secret.json"
    secret.write_text('{"SECRET": "outside the store"}')
    art = artifact_dir(lab, "rewards", "0001")
    (art / "data.json").unlink()
    (art / "data.json").symlink_to(secret)
    (art / "manifest.json").write_bytes(canonical_json({"files": {"data.json": sha256_hex(secret.read_bytes())}}))

    code, out = cli(lab, monkeypatch, capsys, "verify", "demo")
    assert code == 1 and f"BAD rewards 0001: artifact rewards/{art.name}: {art}/data.json is a symbolic link (to {secret})" in out
    result = lab.run("demo", "0000", "0003", raise_on_error=False)  # its manifest no longer matches the event log's record
    message = failure_message(result)
    assert f"artifact rewards/{art.name} is not what Dagster recorded" in message and "It was moved aside to" in message
    logged = message + " ".join(str(e.message) for e in lab.instance.all_logs(result.run_id))
    assert "SECRET" not in logged, "the outside file is never read"
    assert lab.run("demo", "0000", "0003").success and lab.latest("demo", "rewards", "0001")["cache"] == "miss"
    assert secret.read_text() == '{"SECRET": "outside the store"}'

    # a link whose manifest was left alone: the read refuses it, moves it aside and computes it again
    art = artifact_dir(lab, "rollouts", "0002")
    (art / "data.json").unlink()
    (art / "data.json").symlink_to(secret)
    result = lab.run("demo", "0000", "0003")
    assert result.success and lab.latest("demo", "rollouts", "0002")["cache"] == "miss"
    logged = " ".join(str(e.message) for e in lab.instance.all_logs(result.run_id))
    assert f"{art}/data.json is a symbolic link (to {secret}); the store never follows links" in logged and "SECRET" not in logged


def test_a_kind_folder_linked_outside_the_store_stops_the_run_and_nothing_lands_outside(four_steps, monkeypatch, capsys):
    """Finding 2: `artifacts/rollouts` replaced by a link made new artifacts go outside the store, silently."""
    lab = four_steps
    rollouts, outside = lab.home / "artifacts" / "rollouts", lab.home / "outside"
    shutil.move(str(rollouts), str(outside))
    rollouts.symlink_to(outside)
    before = sorted(p.name for p in outside.iterdir())
    message = failure_message(lab.run("demo", "0004", "0004", raise_on_error=False))
    assert f"holds a symbolic link in place of one of its folders: {rollouts} -> {outside}" in message
    assert "point the store's URL (DAGSTER_RL_ARTIFACTS, --artifacts) at it instead" in message
    assert sorted(p.name for p in outside.iterdir()) == before, "nothing was written through the link"
    code, out = cli(lab, monkeypatch, capsys, "verify", "demo", "--repair")
    assert code == 1 and f"repaired: moved the link {rollouts} to" in out
    assert lab.run("demo", "0000", "0004").success and sorted(p.name for p in outside.iterdir()) == before


def test_without_dagster_home_the_code_location_and_the_cli_refuse_with_the_line_to_set(tmp_path):
    """Finding 7: with DAGSTER_HOME unset, `dagster asset materialize` exited 0 on a throwaway instance."""
    env = {k: v for k, v in os.environ.items() if k != "DAGSTER_HOME"}
    for argv in (
        [sys.executable, "-c", "import assets.definitions"],
        [str(Path(sys.executable).parent / "dagster-rl"), "status", "demo"],
    ):
        done = subprocess.run(
            argv, cwd=tmp_path, env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120
        )
        assert done.returncode != 0, (argv, done.stdout, done.stderr)
        assert "DAGSTER_HOME is not set" in done.stderr and "export DAGSTER_HOME=$PWD/.dagster_home" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr, done.stderr  # issue 24: one message, no traceback before it
    assert not (tmp_path / ".dagster_home").exists()


def test_every_error_of_train_and_of_the_code_location_is_one_message(lab, tmp_path):
    """Issue 24: `dagster-rl train` with the judge's URL set and no model printed a 57-line
    traceback before the message; `dagster asset materialize` with DAGSTER_HOME unset, one as well."""
    home = lab("errors", demo_settings()).home
    env = {**os.environ, "DAGSTER_HOME": str(home), "DAGSTER_RL_EXPERIMENTS": str(home / "experiments")}
    env["DAGSTER_RL_JUDGE_URL"] = "http://127.0.0.1:9/v1"
    env.pop("DAGSTER_RL_JUDGE_MODEL", None)
    done = subprocess.run(
        [str(Path(sys.executable).parent / "dagster-rl"), "train", "demo", "0000...0000"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    said = (
        "DAGSTER_RL_JUDGE_URL is set, so the judge is an LLM over that endpoint: set DAGSTER_RL_JUDGE_MODEL to its model's name"
    )
    assert done.returncode == 1 and done.stderr == f"dagster-rl: {said}\n", done.stderr
    debug = subprocess.run(
        [str(Path(sys.executable).parent / "dagster-rl"), "--debug", "train", "demo", "0000...0000"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert debug.returncode == 1 and "Traceback" in debug.stderr and said in debug.stderr  # --debug: the traceback too

    env.pop("DAGSTER_HOME")
    env.pop("DAGSTER_RL_JUDGE_URL")
    argv = [
        str(Path(sys.executable).parent / "dagster"),
        "asset",
        "materialize",
        "-m",
        "assets.definitions",
        "--select",
        "group:demo",
        "--partition",
        "0000",
    ]
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert (
        done.stderr.rstrip().endswith("(`make demo` and `make ui` use .dagster_home)")
        and "dagster_rl code location: DAGSTER_HOME is not set" in done.stderr
    )


def test_a_sandbox_root_that_is_a_file_fails_the_run_naming_it(lab, tmp_path):
    """Finding 7: a sandbox_root that was a file gave 24 trial failures of `NotADirectoryError(20, 'Not a directory')`."""
    from resources import RolloutEnvironment

    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    bad = lab("sandbox", demo_settings(), rollout=RolloutEnvironment(sandbox_root=str(a_file)))
    result = bad.run("demo", "0000", "0000", raise_on_error=False)
    message = failure_message(result)
    assert f"the sandbox folder {a_file}/dagster_rl_sandboxes (the rollout environment's sandbox_root" in message
    assert f"cannot hold sandboxes: Not a directory ({a_file}/dagster_rl_sandboxes)" in message
    assert bad.instance.get_run_by_id(result.run_id).tags["dagster/retry_on_asset_or_op_failure"] == "false"


def test_weights_stored_before_they_recorded_their_experiment_say_to_start_from_0000():
    from assets.predecessor import _check_trained_by
    from dagster_rl.base.errors import MissingPredecessorError
    from dagster_rl.core.experiment_files import parse_experiment

    exp = parse_experiment(demo_settings())
    _check_trained_by(
        exp, "0002", "k" * 64, {"step": 2, "experiment": "demo"}, "re-run the range from step 0002"
    )  # its own: accepted
    with pytest.raises(MissingPredecessorError, match=r"names step 2 but no experiment; .* To fix, re-run the range from 0000"):
        _check_trained_by(exp, "0002", "k" * 64, {"step": 2}, "re-run the range from step 0002")
    with pytest.raises(
        MissingPredecessorError, match=r"holds no record of a training step \(stats.json\): initial or warm-up weights"
    ):
        _check_trained_by(exp, "0002", "k" * 64, {}, "re-run the range from step 0002")
