"""The model cache ($DAGSTER_RL_MODEL_CACHE) keeps its folders whole (findings 3 and 4 of issue 36):
a built-in model's folder that no longer matches the manifest written with it (a truncated
`model.safetensors` failed every run with `SafetensorError: incomplete metadata`, and was never
rebuilt) is built again; in a read-only cache, whole folders are used and a broken or missing one
is an error that names the folder, the variable and what to do."""

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dagster_rl.tasks.lm.model.cache import MANIFEST, ModelCacheError, mismatch
from dagster_rl.tasks.lm.model.policy import load_base
from dagster_rl.tasks.lm.model.tiny import resolve_model
from tests import REPO
from tests.lm_fixtures import subprocess_env
from tests.machine import missing

TINY = "builtin:tiny-qwen2"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A model cache of the test's own, holding builtin:tiny-qwen2 as it was first built."""
    monkeypatch.setenv("DAGSTER_RL_MODEL_CACHE", str(tmp_path / "models"))
    resolve_model(TINY)
    return tmp_path / "models"


def contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def truncate(folder: Path) -> None:
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_a_byte(folder: Path) -> None:
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # the same size: only its sha256 tells
    path.write_bytes(bytes(data))


DAMAGES = {
    "truncated": truncate,
    "a byte flipped": flip_a_byte,
    "a file lost": lambda folder: (folder / "tokenizer.json").unlink(),
    "no manifest (an earlier version's)": lambda folder: (folder / MANIFEST).unlink(),
    "a file added": lambda folder: (folder / "model.safetensors.index.json").write_text("{}"),
    "a file made a link": lambda folder: (
        (folder / "config.json").unlink() or (folder / "config.json").symlink_to("/etc/hostname")
    ),
}


def test_the_folder_records_what_was_written(cache):
    folder = cache / "tiny-qwen2"
    listed = json.loads((folder / MANIFEST).read_text())["files"]
    assert set(listed) == {p.name for p in folder.iterdir()} - {MANIFEST} and "model.safetensors" in listed
    weights = folder / "model.safetensors"
    assert listed["model.safetensors"]["size"] == weights.stat().st_size > 0
    assert listed["model.safetensors"]["sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert [p.name for p in cache.iterdir()] == ["tiny-qwen2"]  # nothing left of the temporary folder


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_folder_that_does_not_match_its_manifest_is_built_again(cache, damage):
    folder = cache / "tiny-qwen2"
    whole = contents(folder)
    DAMAGES[damage](folder)
    assert mismatch(folder) is not None
    model, tok = load_base(TINY)  # truncated, this was `SafetensorError: incomplete metadata`, on every run
    assert contents(folder) == whole  # the same bytes: the build is deterministic
    assert [p.name for p in cache.iterdir()] == ["tiny-qwen2"]  # the damaged copy is gone, no temporary folder left
    assert model.config.vocab_size == len(tok)


# ---- a read-only cache: a real read-only mount (bubblewrap), since these tests run as root ----------------------


def read_only(cache: Path, code: str) -> subprocess.CompletedProcess:
    """Run `code` in Python with the model cache mounted read-only (bubblewrap: `--ro-bind`)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        missing("bubblewrap (bwrap) mounts the model cache read-only for this test: apt-get install bubblewrap")
    cache.mkdir(parents=True, exist_ok=True)
    argv = [bwrap, "--bind", "/", "/", "--ro-bind", str(cache), str(cache), "--dev", "/dev", "--proc", "/proc"]
    env = subprocess_env({"DAGSTER_RL_MODEL_CACHE": str(cache)})
    done = subprocess.run([*argv, sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    if "Operation not permitted" in done.stderr and "bwrap" in done.stderr:
        missing(f"bubblewrap cannot make a mount namespace here: {done.stderr.strip()}")
    return done


LOAD = f"""
from dagster_rl.tasks.lm.model.cache import ModelCacheError
from dagster_rl.tasks.lm.model.policy import load_base
try:
    load_base({TINY!r})
except ModelCacheError as e:
    raise SystemExit(f"ModelCacheError: {{e}}")
print("loaded")
"""


def test_a_read_only_cache_serves_its_whole_folders_and_names_what_to_do_for_the_others(cache, tmp_path):
    folder = cache / "tiny-qwen2"
    assert read_only(cache, LOAD).stdout.strip() == "loaded"  # whole: used as it is

    truncate(folder)
    done = read_only(cache, LOAD)
    assert done.returncode == 1 and done.stderr.startswith("ModelCacheError: "), done.stderr[-3000:]
    assert (
        f"the model folder {folder} of {TINY} does not match the manifest written with it (model.safetensors holds "
        f"{folder.joinpath('model.safetensors').stat().st_size} bytes, not the "
    ) in done.stderr
    assert (
        f"and cannot be built again in the model cache {cache} (DAGSTER_RL_MODEL_CACHE={cache}): Read-only file system"
        in done.stderr
    )
    assert f"To fix: delete {folder} where the cache can be written, or set DAGSTER_RL_MODEL_CACHE to a folder" in done.stderr

    empty = tmp_path / "empty"  # finding 4: the error advised "a local model folder, or a hub id"
    done = read_only(empty, LOAD)
    assert done.returncode == 1, done.stderr[-3000:]
    said = done.stderr.strip()
    assert said.startswith(
        f"ModelCacheError: {TINY} is built once per machine into the model cache {empty} (DAGSTER_RL_MODEL_CACHE={empty}), "
        f"which cannot be written (Read-only file system: {empty}/.tiny-qwen2-"
    ), said
    assert said.endswith(
        "To fix: set DAGSTER_RL_MODEL_CACHE to a folder this process can write (e.g. export "
        f"DAGSTER_RL_MODEL_CACHE=$HOME/.cache/dagster_rl/models), or make {empty} writable."
    ), said
    assert "hub id" not in done.stderr


def test_a_cache_that_is_a_file_is_named_with_the_variable(tmp_path, monkeypatch):
    """A cache path that cannot be a folder (a file is in the way): the same error, not the hub advice."""
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("DAGSTER_RL_MODEL_CACHE", str(tmp_path / "a_file" / "models"))
    with pytest.raises(
        ModelCacheError,
        match=r"into the model cache .*a_file/models \(DAGSTER_RL_MODEL_CACHE=.*\), which cannot be written \(Not a directory",
    ):
        load_base(TINY)
