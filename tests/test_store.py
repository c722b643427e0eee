"""The artifact store: content addressed, never overwritten, corruption detected and moved aside,
hostile keys refused, first writer wins."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from dagster_rl.base.errors import (
    ArtifactConflictError,
    CorruptArtifactError,
    DagsterRLError,
    InvalidArtifactKeyError,
    MissingArtifactError,
    StoreWriteError,
)
from dagster_rl.base.hashing import cache_key, canonical_json
from dagster_rl.store.artifact_store import ADOPTING_KINDS, ArtifactStore, check_key

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


# ---- hostile and corrupted stores ------------------------------------------------------------


def test_keys_kinds_and_file_names_are_checked_before_a_path_is_built(tmp_path):
    store = ArtifactStore(f"file://{tmp_path}/store")
    (tmp_path / "evil" / "w").mkdir(parents=True)
    (tmp_path / "evil" / "w" / "manifest.json").write_text('{"files": {}}')
    for kind, key in (("weights", "../../evil/w"), ("weights", K.upper()), ("../evil", K), ("weights", K + "/..")):
        with pytest.raises(InvalidArtifactKeyError, match="refusing to build a path|not a lowercase identifier"):
            store.exists(kind, key)
    with pytest.raises(InvalidArtifactKeyError, match="'../../evil/w' is not a 64-digit hex content key"):
        check_key("../../evil/w")
    store.put("weights", K, {"data.json": b"1"})  # a tampered manifest that names a file outside the artifact
    (tmp_path / "store" / "weights" / K / "manifest.json").write_text('{"files": {"../../../evil/w/manifest.json": "00"}}')
    with pytest.raises(CorruptArtifactError, match="not a plain file name"):
        store.get_all("weights", K)


def test_a_truncated_file_is_moved_aside_and_computed_again(tmp_path):
    heard = []
    store = ArtifactStore(f"file://{tmp_path}", warn=heard.append)
    store.put("rollouts", K, {"data.json": b'{"trials": [1, 2, 3]}'})
    (tmp_path / "rollouts" / K / "data.json").write_bytes(b'{"trials": [1,')
    calls = []
    files, ref, hit = store.get_or_put_files("rollouts", K, lambda: calls.append(1) or {"data.json": b'{"trials": [1, 2, 3]}'})
    assert (files, hit, calls) == ({"data.json": b'{"trials": [1, 2, 3]}'}, False, [1])
    assert store.verify("rollouts", K) is None
    [moved] = (tmp_path / "quarantine" / "rollouts").iterdir()  # moved aside, never deleted
    assert moved.name.startswith(K) and (moved / "data.json").read_bytes() == b'{"trials": [1,'
    assert len(heard) == 1 and f"artifact rollouts/{K}: its file data.json is corrupt" in heard[0]
    assert f"moved aside to {tmp_path}/quarantine/rollouts/{K}." in heard[0] and "Computing it again now." in heard[0]


def test_a_truncated_manifest_and_a_deleted_file_are_errors_that_name_the_artifact(tmp_path):
    store = ArtifactStore(f"file://{tmp_path}")
    store.put("weights", K, {"data.json": b"w"})
    (tmp_path / "weights" / K / "manifest.json").write_bytes(b'{"files": {"data.js')
    with pytest.raises(CorruptArtifactError, match=rf"artifact weights/{K} has an unreadable manifest.json \(19 bytes") as err:
        store.get("weights", K, "data.json")
    assert "It was moved aside to" in str(err.value) and not store.exists("weights", K)

    store.put("weights", K1, {"data.json": b"w", "b.bin": b"b"})
    (tmp_path / "weights" / K1 / "b.bin").unlink()
    with pytest.raises(
        CorruptArtifactError, match=rf"artifact weights/{K1}: its file b.bin is missing, though its manifest lists it"
    ):
        store.get_all("weights", K1)
    assert not store.exists("weights", K1)
    with pytest.raises(MissingArtifactError, match="is not in the store"):
        store.get("weights", K1, "data.json")


def test_verify_rehashes_without_moving_anything(tmp_path):
    store = ArtifactStore(f"file://{tmp_path}")
    store.put("weights", K, {"data.json": b"good"})
    assert store.verify("weights", K) is None
    (tmp_path / "weights" / K / "data.json").write_bytes(b"evil")
    assert "its file data.json is corrupt" in store.verify("weights", K)
    assert store.exists("weights", K) and "not in the store" in store.verify("weights", K1)


def test_adopting_kinds_keep_the_first_writer_and_the_step_continues_from_it(tmp_path):
    heard = []
    store = ArtifactStore(f"file://{tmp_path}", warn=heard.append)
    assert {"weights", "rollouts"} <= ADOPTING_KINDS and "rewards" not in ADOPTING_KINDS
    first = store.put("weights", K, {"data.json": b"1.0000001"})
    assert store.put("weights", K, {"data.json": b"1.0000002"}) == first  # a GPU's last bits differ
    assert store.get("weights", K, "data.json") == b"1.0000001" and "kept the first one" in heard[0]


def test_an_adopted_artifact_is_called_float_rounding_only_within_the_rounding_bound(tmp_path):
    """Issue 24: a second writer that stored another experiment's 2-world prior under the 3-world
    prior's key was told "float compute differs in its last bits". The warning says what differs."""
    from safetensors.numpy import save

    heard = []
    store = ArtifactStore(f"file://{tmp_path}", warn=heard.append)
    prior = {"version": 0, "doc_prior": {"w0": [0.25] * 4, "w1": [0.25] * 4, "w2": [0.25] * 4}}
    store.put("weights", K, {"data.json": canonical_json(prior)})
    two_worlds = {"version": 0, "doc_prior": {"w0": [0.25] * 4, "w1": [0.25] * 4}}
    store.put("weights", K, {"data.json": canonical_json(two_worlds)})
    assert heard[-1] == (
        f"artifact weights/{K} was stored by another computation of the same key with other bytes: data.json differ; "
        "first: data.json.doc_prior: ['w0', 'w1', 'w2'] vs ['w0', 'w1']. Not float rounding: more than floats differ: an "
        "input that changes these bytes is missing from the key, or the computation is not deterministic (on another "
        "machine or device a sampled token may flip); kept the first one, and this step continues from it"
    )
    rounded = {"version": 0, "doc_prior": {w: [0.25, 0.25, 0.25, 0.25 + 3e-8] for w in ("w0", "w1", "w2")}}
    store.put("weights", K, {"data.json": canonical_json(rounded)})
    assert (
        "Float rounding: only floats differ, by at most 3e-08 (relative), within 0.0001" in heard[-1]
        and "missing" not in heard[-1]
    )
    adapter = np.array([[0.5, -1.25], [2.0, 0.0]], dtype=np.float32)
    store.put("weights", HALF, {"adapter_model.safetensors": save({"a": adapter})})
    store.put("weights", HALF, {"adapter_model.safetensors": save({"a": adapter + np.float32(1e-6)})})
    assert "adapter_model.safetensors:a[" in heard[-1] and "Float rounding" in heard[-1]
    store.put("weights", HALF, {"adapter_model.safetensors": save({"a": adapter * 2})})
    assert "Not float rounding: floats differ by up to 0.5 (relative), beyond 0.0001" in heard[-1], heard[-1]


def test_of_two_concurrent_writers_of_one_key_exactly_one_wins_whole(tmp_path):
    store = ArtifactStore(f"file://{tmp_path}")
    for i in range(20):
        key = cache_key("race", "1", i=i)
        payloads = [{"data.json": bytes([w]) * 100_000, "b.bin": bytes([w]) * 1000} for w in range(4)]
        with ThreadPoolExecutor(4) as pool:
            refs = list(pool.map(lambda files, key=key: store.put("weights", key, files), payloads))
        assert len({r.content_hash for r in refs}) == 1 and store.verify("weights", key) is None
        stored = store.get_all("weights", key)
        assert stored in payloads
    assert not list(tmp_path.glob("weights/.staging-*")), "no staging folder is left behind"


def test_a_partial_artifact_is_kept_apart_from_the_clean_key(tmp_path):
    store = ArtifactStore(f"file://{tmp_path}")
    assert store.partial("rollouts", K) is None
    ref = store.put_partial("rollouts", K, {"data.json": b"19 of 24"}, ["s0-p1-n0"])
    assert not store.exists("rollouts", K) and store.partial("rollouts", K) == ref.key != K
    later = store.put_partial("rollouts", K, {"data.json": b"23 of 24"}, ["s0-p2-n0"])
    assert store.partial("rollouts", K) == later.key and store.exists("rollouts", ref.key)  # the older one stays


def test_a_read_only_store_serves_what_it_holds_and_says_why_it_cannot_write(tmp_path):
    ArtifactStore(f"file://{tmp_path}").put("weights", K, {"data.json": b"w"})
    store = ArtifactStore(f"readonly://{tmp_path}")
    files, _, hit = store.get_or_put_files("weights", K, lambda: pytest.fail("a stored artifact is not computed again"))
    assert hit and files == {"data.json": b"w"}
    with pytest.raises(
        StoreWriteError, match=rf"could not write artifact weights/{K1} to the store at readonly://.*Read-only file system"
    ):
        store.put("weights", K1, {"data.json": b"w"})


# ---- symbolic links (finding 2 of issue 20) --------------------------------------------------


def _outside(tmp_path, text: bytes = b"SECRET outside the store"):
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    (outside / "secret.txt").write_bytes(text)
    return outside / "secret.txt"


def test_a_data_file_replaced_by_a_link_with_its_manifest_updated_is_refused_and_moved_aside(tmp_path):
    from dagster_rl.base.hashing import canonical_json, sha256_hex

    secret = _outside(tmp_path)
    heard = []
    store = ArtifactStore(f"file://{tmp_path}/store", warn=heard.append)
    store.put("rollouts", K, {"data.json": b"[1, 2, 3]"})
    art = tmp_path / "store" / "rollouts" / K
    (art / "data.json").unlink()
    (art / "data.json").symlink_to(secret)
    (art / "manifest.json").write_bytes(canonical_json({"files": {"data.json": sha256_hex(secret.read_bytes())}}))

    problem = store.verify("rollouts", K)
    assert problem == f"artifact rollouts/{K}: {art}/data.json is a symbolic link (to {secret}); the store never follows links"
    with pytest.raises(CorruptArtifactError) as err:
        store.get("rollouts", K, "data.json")
    assert "symbolic link" in str(err.value) and "SECRET" not in str(err.value) and "It was moved aside to" in str(err.value)
    assert not store.exists("rollouts", K) and secret.read_bytes() == b"SECRET outside the store"
    [moved] = (tmp_path / "store" / "quarantine" / "rollouts").iterdir()
    assert (moved / "data.json").is_symlink()  # moved aside whole, link included: nothing deleted
    files, _, hit = store.get_or_put_files("rollouts", K, lambda: {"data.json": b"[1, 2, 3]"})
    assert not hit and files == {"data.json": b"[1, 2, 3]"} and store.verify("rollouts", K) is None


@pytest.mark.parametrize("what", ["folder", "manifest"])
def test_an_artifact_folder_or_manifest_that_is_a_link_is_corrupt_and_its_target_is_untouched(tmp_path, what):
    elsewhere = ArtifactStore(f"file://{tmp_path}/elsewhere")
    elsewhere.put("weights", K, {"data.json": b"weights of another store"})
    store = ArtifactStore(f"file://{tmp_path}/store")
    store.put("weights", K1, {"data.json": b"w"})
    if what == "folder":
        (tmp_path / "store" / "weights" / K).symlink_to(tmp_path / "elsewhere" / "weights" / K)
        link = tmp_path / "store" / "weights" / K
    else:
        (tmp_path / "store" / "weights" / K).mkdir()
        link = tmp_path / "store" / "weights" / K / "manifest.json"
        link.symlink_to(tmp_path / "elsewhere" / "weights" / K / "manifest.json")
    assert store.exists("weights", K), "something is there: the read finds it bad"
    assert f"{link} is a symbolic link" in store.verify("weights", K)
    with pytest.raises(CorruptArtifactError, match="symbolic link"):
        store.get_all("weights", K)
    assert elsewhere.get("weights", K, "data.json") == b"weights of another store"
    assert not store.exists("weights", K) and store.verify("weights", K1) is None


def test_a_kind_folder_replaced_by_a_link_is_never_written_through(tmp_path):
    from dagster_rl.base.errors import StoreLinkError

    outside = tmp_path / "outside"
    outside.mkdir()
    store = ArtifactStore(f"file://{tmp_path}/store")
    store.put("rewards", K1, {"data.json": b"1"})
    (tmp_path / "store" / "rollouts").symlink_to(outside)
    with pytest.raises(
        StoreLinkError, match=rf"holds a symbolic link in place of one of its folders: {tmp_path}/store/rollouts -> {outside}"
    ):
        store.put("rollouts", K, {"data.json": b"new"})
    assert list(outside.iterdir()) == [], "nothing was written outside the store"
    with pytest.raises(StoreLinkError):
        store.exists("rollouts", K)
    assert "holds a symbolic link" in store.verify("rollouts", K)
    with pytest.raises(StoreLinkError):
        store.put_partial("rollouts", K, {"data.json": b"part"}, ["s0-p0-n0"])
    assert list(outside.iterdir()) == []
    (tmp_path / "store" / "partials").symlink_to(outside)
    with pytest.raises(StoreLinkError):
        store.put_partial("rewards", K, {"data.json": b"part"}, ["s0-p0-n0"])
    assert list(outside.iterdir()) == []

    said = store.move_link_aside(StoreLinkError("", str(tmp_path / "store" / "rollouts")))
    assert said.startswith(f"moved the link {tmp_path}/store/rollouts to {tmp_path}/store/quarantine/links/rollouts.")
    store.put("rollouts", K, {"data.json": b"new"})
    assert store.get("rollouts", K, "data.json") == b"new" and list(outside.iterdir()) == []


def test_the_root_itself_may_be_a_link(tmp_path):
    (tmp_path / "disk").mkdir()
    (tmp_path / "store").symlink_to(tmp_path / "disk")
    store = ArtifactStore(f"file://{tmp_path}/store")
    store.put("weights", K, {"data.json": b"w"})
    assert store.get("weights", K, "data.json") == b"w" and (tmp_path / "disk" / "weights" / K / "data.json").exists()


def test_a_read_only_command_moves_nothing(tmp_path):
    ArtifactStore(f"file://{tmp_path}").put("rollouts", K, {"data.json": b"good"})
    (tmp_path / "rollouts" / K / "data.json").write_bytes(b"evil")
    reader = ArtifactStore(f"file://{tmp_path}", quarantine=False)
    with pytest.raises(
        CorruptArtifactError, match=r"Nothing was moved \(a read-only command\): `dagster-rl verify <experiment> --repair`"
    ):
        reader.get("rollouts", K, "data.json")
    assert reader.exists("rollouts", K) and not (tmp_path / "quarantine").exists()


def test_a_link_in_place_of_a_partials_folder_is_refused_and_can_be_moved_aside(tmp_path):
    from dagster_rl.base.errors import StoreLinkError

    outside = tmp_path / "outside"
    outside.mkdir()
    store = ArtifactStore(f"file://{tmp_path}/store")
    store.put_partial("rollouts", K, {"data.json": b"part"}, ["s0-p0-n0"])
    (tmp_path / "store" / "partials" / "rewards").symlink_to(outside)
    with pytest.raises(StoreLinkError) as err:
        store.put_partial("rewards", K, {"data.json": b"part"}, ["s0-p0-n0"])
    assert list(outside.iterdir()) == []
    assert store.move_link_aside(err.value).startswith(f"moved the link {tmp_path}/store/partials/rewards to")
    assert store.put_partial("rewards", K, {"data.json": b"part"}, ["s0-p0-n0"]).key == store.partial("rewards", K)


def test_a_store_whose_root_is_missing_or_a_file_holds_nothing_and_says_why_it_cannot_write(tmp_path):
    assert not ArtifactStore(f"file://{tmp_path}/missing").exists("weights", K)
    (tmp_path / "a_file").write_text("x")
    store = ArtifactStore(f"file://{tmp_path}/a_file")
    assert not store.exists("weights", K)
    with pytest.raises(StoreWriteError, match=rf"could not write artifact weights/{K} to the store at file://{tmp_path}/a_file"):
        store.put("weights", K, {"data.json": b"w"})
