"""The artifact store: content addressed, never overwritten, corruption detected."""

import pytest

from dagster_rl.errors import ArtifactConflictError, DagsterRLError
from dagster_rl.hashing import cache_key
from dagster_rl.store import ArtifactStore

K1, K, HALF, W = (cache_key("test", "1", name=n) for n in ("k1", "k", "half", "w"))


def test_put_get_and_content_hash_is_stable(tmp_path):
    store = ArtifactStore(f"file://{tmp_path}")
    ref = store.put("weights", K1, {"a.bin": b"\x00\x01", "b.json": b"{}"})
    assert store.exists("weights", K1)
    assert store.get_all("weights", K1) == {"a.bin": b"\x00\x01", "b.json": b"{}"}
    again = store.put("weights", K1, {"b.json": b"{}", "a.bin": b"\x00\x01"})
    assert again == ref
    assert ArtifactStore(f"file://{tmp_path}").ref("weights", K1).content_hash == ref.content_hash


def test_other_content_under_an_existing_key_is_refused_and_nothing_is_lost(tmp_path):
    store = ArtifactStore(f"file://{tmp_path}")
    store.put("rewards", K, {"data.json": b"[1]"})  # rewards: a deterministic kind
    with pytest.raises(ArtifactConflictError, match="Nothing was overwritten"):
        store.put("rewards", K, {"data.json": b"[2]"})
    assert store.get("rewards", K, "data.json") == b"[1]"


def test_an_artifact_without_manifest_does_not_exist(tmp_path):
    store = ArtifactStore(f"file://{tmp_path}")
    (tmp_path / "weights" / HALF).mkdir(parents=True)
    (tmp_path / "weights" / HALF / "data.json").write_bytes(b"partial")
    assert not store.exists("weights", HALF)
    with pytest.raises(DagsterRLError, match="re-run the step that makes it"):
        store.get("weights", HALF, "data.json")


def test_corruption_is_detected(tmp_path):
    store = ArtifactStore(f"file://{tmp_path}")
    store.put("weights", K, {"data.json": b"good"})
    (tmp_path / "weights" / K / "data.json").write_bytes(b"evil")
    with pytest.raises(DagsterRLError, match="corrupt"):
        store.get("weights", K, "data.json")


def test_works_over_another_fsspec_filesystem():
    store = ArtifactStore("memory://dagster-rl-test")
    ref = store.put("worlds", W, {"doc.txt": b"hello"})
    assert ref.uri == f"memory://dagster-rl-test/worlds/{W}" and ref.path == f"worlds/{W}"
    assert store.get("worlds", W, "doc.txt") == b"hello"
