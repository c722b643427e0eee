"""Where this machine keeps its built-in model folders: $DAGSTER_RL_MODEL_CACHE, default
~/.cache/dagster_rl/models (the tiny models built in code, the packaged models converted), each
checked against the manifest written when it was built, and rebuilt when it does not match.

A folder is built in a temporary folder beside it; then its manifest (`MANIFEST.json`: the size and
sha256 of every file) is written, last and atomically (a temporary file renamed); then the folder
is renamed into place. So a reader sees a whole folder or none, and of two processes that build at
once one rename wins and the other's copy is removed.

Every use checks the folder against its manifest (`mismatch`): every listed file there, a regular
file of its size, nothing else beside them, and its sha256, computed once per process for a file
of a given size and modification time (the first use in a process reads the folder once more:
about 0.45 s for SmolLM2's 538 MB here; loading it takes longer). A folder that does not match (a
file truncated, changed or lost, a copy that stopped part way, a folder written before manifests
were) is built again and put in place of it; where that cannot be done (a read-only cache), the
error names the folder and what to do. Manifest entries are checked to be plain file names before
a path is made of them.
"""

import hashlib
import json
import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from dagster_rl.base.errors import DagsterRLError
from dagster_rl.store.layout import FILE_NAME

CACHE_VARIABLE = "DAGSTER_RL_MODEL_CACHE"
MANIFEST = "MANIFEST.json"
MANIFEST_VERSION = 1


class ModelCacheError(DagsterRLError):
    """A model folder of the cache that cannot be built (the cache cannot be written), or that does
    not match its manifest and cannot be built again."""

    retryable = False


def model_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_VARIABLE, Path.home() / ".cache" / "dagster_rl" / "models"))


_digests: dict[tuple[str, int, int], str] = {}
_lock = threading.Lock()


def file_sha256(path: Path) -> str:
    """The file's sha256, computed once per process for a given (path, size, mtime)."""
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    with _lock:
        if key not in _digests:
            h = hashlib.sha256()
            with path.open("rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            _digests[key] = h.hexdigest()
        return _digests[key]


def write_manifest(folder: Path) -> None:
    """Record the size and sha256 of every file of `folder` (plain files, no subfolder) in its
    manifest, written last: a temporary file, renamed."""
    files = {}
    for path in sorted(folder.iterdir()):
        if not path.is_file() or path.is_symlink() or not FILE_NAME.match(path.name):
            raise ModelCacheError(f"{path}: a model folder of the cache holds plain files only (its manifest lists them)")
        files[path.name] = {"size": path.stat().st_size, "sha256": file_sha256(path)}
    partial = folder / f".{MANIFEST}.partial"
    partial.write_text(json.dumps({"version": MANIFEST_VERSION, "files": files}, indent=1, sort_keys=True) + "\n")
    os.replace(partial, folder / MANIFEST)


def mismatch(folder: Path) -> str | None:
    """What is wrong with `folder` against its manifest ("no such folder", a file truncated, ...), or
    None when every file it lists is there, whole, and nothing else is."""
    if not folder.is_dir():
        return "no such folder"
    try:
        listed = json.loads((folder / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return f"it has no {MANIFEST} (written by an earlier version, or unfinished)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its {MANIFEST} cannot be read ({type(e).__name__}: {e})"
    if not isinstance(listed, dict) or not all(isinstance(n, str) and FILE_NAME.match(n) for n in listed):
        return f"its {MANIFEST} lists something other than plain file names"
    extra = sorted({p.name for p in folder.iterdir()} - set(listed) - {MANIFEST})
    if extra:
        return f"it holds {', '.join(extra[:3])}, which its {MANIFEST} does not list"
    for name, entry in listed.items():
        path = folder / name
        try:
            info = path.lstat()  # a link is not one of the files the build wrote
        except FileNotFoundError:
            return f"{name} is missing"
        expected = entry.get("size") if isinstance(entry, dict) else None
        if not stat.S_ISREG(info.st_mode):
            return f"{name} is not a regular file"
        if info.st_size != expected:
            return f"{name} holds {info.st_size} bytes, not the {expected} it was written with"
        if file_sha256(path) != entry.get("sha256"):
            return f"{name} is not the file it was written as (its sha256 differs)"
    return None


def cached_folder(cache: Path, name: str, build: Callable[[Path], object], what: str) -> Path:
    """`cache/name`, checked against its manifest; built by `build(folder)` (which writes the model
    into the empty folder it is given) when it is missing or does not match. `what` names the model
    in errors (`builtin:tiny-qwen2`)."""
    folder = cache / name
    problem = mismatch(folder)
    if problem is None:
        return folder
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache))
    except OSError as e:
        raise ModelCacheError(_unwritable(cache, folder, problem, what, e)) from None
    try:
        try:
            build(tmp)
            write_manifest(tmp)
        except OSError as e:
            raise ModelCacheError(_unwritable(cache, folder, problem, what, e)) from None
        _put_in_place(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    problem = mismatch(folder)
    if problem is not None:  # only if something changes it as it is made
        raise ModelCacheError(
            f"the model folder {folder} of {what} does not match its {MANIFEST} as soon as it is built: {problem}"
        )
    return folder


def _put_in_place(tmp: Path, folder: Path) -> None:
    """Rename the built `tmp` to `folder`; a folder there that does not match its manifest is moved
    aside first and removed, one that does (another process's, built meanwhile) is kept."""
    try:
        os.rename(tmp, folder)  # atomic; fails when a folder is there
        return
    except OSError:
        if mismatch(folder) is None:  # another process put a whole one in place first
            return
    aside = folder.with_name(f".{folder.name}-mismatched-{os.getpid()}-{threading.get_ident()}")
    try:
        os.rename(folder, aside)
    except FileNotFoundError:  # another process moved it aside
        pass
    try:
        os.rename(tmp, folder)
    except OSError:
        if mismatch(folder) is not None:
            raise
    finally:
        shutil.rmtree(aside, ignore_errors=True)


def _unwritable(cache: Path, folder: Path, problem: str, what: str, error: OSError) -> str:
    where = f"{CACHE_VARIABLE}={os.environ[CACHE_VARIABLE]}" if os.environ.get(CACHE_VARIABLE) else f"{CACHE_VARIABLE} is unset"
    why = f"{error.strerror or error}" + (f": {error.filename}" if error.filename else "")
    if problem == "no such folder":
        head = f"{what} is built once per machine into the model cache {cache} ({where}), which cannot be written ({why})"
        fix = f"set {CACHE_VARIABLE} to a folder this process can write (e.g. export {CACHE_VARIABLE}=$HOME/.cache/dagster_rl/models), or make {cache} writable"
    else:
        head = (
            f"the model folder {folder} of {what} does not match the manifest written with it ({problem}), and cannot be "
            f"built again in the model cache {cache} ({where}): {why}"
        )
        fix = f"delete {folder} where the cache can be written, or set {CACHE_VARIABLE} to a folder this process can write"
    return f"{head}. To fix: {fix}."
