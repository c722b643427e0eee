"""The artifact store: content addressed, never overwritten, corruption detected."""

import pytest

from dagster_rl.errors import ArtifactConflictError, DagsterRLError
from dagster_rl.store import ArtifactStore


def test_put_get_and_content_hash_is_stable(tmp_path):
    store = ArtifactStore(f"file://{tmp_path}")
    ref = store.put("weights", "k1", {"a.bin": b"\x00\x01", "b.json": b"{}"})
    assert store.exists("weights", "k1")
    assert store.get_all("weights", "k1") == {"a.bin": b"\x00\x01", "b.json": b"{}"}
    again = store.put("weights", "k1", {"b.json": b"{}", "a.bin": b"\x00\x01"})
    assert again == ref
    assert ArtifactStore(f"file://{tmp_path}").ref("weights", "k1").content_hash == ref.content_hash


def test_other_content_under_an_existing_key_is_refused_and_nothing_is_lost(tmp_path):
    store = ArtifactStore(f"file://{tmp_path}")
    store.put("rollouts", "k", {"data.json": b"[1]"})
    with pytest.raises(ArtifactConflictError, match="Nothing was overwritten"):
        store.put("rollouts", "k", {"data.json": b"[2]"})
    assert store.get("rollouts", "k", "data.json") == b"[1]"


def test_an_artifact_without_manifest_does_not_exist(tmp_path):
    store = ArtifactStore(f"file://{tmp_path}")
    (tmp_path / "weights" / "half").mkdir(parents=True)
    (tmp_path / "weights" / "half" / "data.json").write_bytes(b"partial")
    assert not store.exists("weights", "half")
    with pytest.raises(DagsterRLError, match="re-run the step that makes it"):
        store.get("weights", "half", "data.json")


def test_corruption_is_detected(tmp_path):
    store = ArtifactStore(f"file://{tmp_path}")
    store.put("weights", "k", {"data.json": b"good"})
    (tmp_path / "weights" / "k" / "data.json").write_bytes(b"evil")
    with pytest.raises(DagsterRLError, match="corrupt"):
        store.get("weights", "k", "data.json")


def test_a_record_is_written_once(tmp_path):
    store = ArtifactStore(f"file://{tmp_path}")
    assert store.put_record("runs/r1", {"started_at": "t0"}) == {"started_at": "t0"}
    assert store.put_record("runs/r1", {"started_at": "t1"}) == {"started_at": "t0"}


def test_works_over_another_fsspec_filesystem():
    store = ArtifactStore("memory://dagster-rl-test")
    ref = store.put("worlds", "w", {"doc.txt": b"hello"})
    assert ref.uri == "memory://dagster-rl-test/worlds/w"
    assert store.get("worlds", "w", "doc.txt") == b"hello"
