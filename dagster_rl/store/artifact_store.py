"""Content-addressed artifact store over an fsspec URL.

An artifact is a folder `<root>/<kind>/<key>/` of files plus a `manifest.json`: the manifest lists
each file's sha256, and its own hash is the artifact's content hash. An artifact without a manifest
does not exist. On a local disk an artifact is written in a private staging folder and renamed into
place in one step, so a crash mid-write leaves nothing visible and of two writers of one key exactly
one wins; elsewhere (object stores have no atomic rename) the files are written first and the
manifest last.

Keys are the 64-digit hex content keys of `dagster_rl.core.hashing.cache_key`, kinds are lowercase
identifiers, file names plain names: every one is validated before a path is built from it, so no
key or manifest read from metadata or a tampered store can lead a read or a write outside the store.

Keys are never overwritten. When an artifact is already stored under a key:
- kinds in `ADOPTING_KINDS` (float compute that may differ in its last bits between two
  computations of one key on a GPU: trained `weights`, sampled `rollouts`, `evaluations`, and the
  LLM judge's `judge_calls`) keep the first writer's artifact; a second writer with other bytes
  adopts it, and the step continues from the stored one. Its warning says what differs
  (`dagster_rl.core.differences`), and calls it float rounding only when nothing but floats differ,
  within `differences.ROUNDING`;
- every other kind (rewards, worlds, ...) is deterministic: other content under an existing key is
  an `ArtifactConflictError`, since the code changed without a new code version.

A corrupt artifact (a file whose hash does not match the manifest, a missing file, an unreadable
manifest, a symbolic link) is moved aside to `<root>/quarantine/<kind>/<key>.<time>` (never deleted):
`get_or_put` then computes it again; a plain read raises `CorruptArtifactError` naming it and saying
where it went. A store opened with `quarantine=False` (the read-only commands: `dagster-rl status`,
`lineage`, `verify`) moves nothing: it says what is wrong and leaves the store as it found it.

Links. On a local (or mounted) filesystem no read or write follows a symbolic link below the root:
every path is walked from the root one folder at a time with `O_NOFOLLOW` (`dagster_rl.store.nofollow`),
so a link is refused, never followed, and nothing lands outside the store. A link at or inside an
artifact (its folder, its manifest, a file) makes the artifact corrupt (moved aside as above); a
link in place of a folder of the store's own layout (`<root>/rollouts`, `<root>/quarantine`, ...)
is a `StoreLinkError`: the store stops and names it (point the store's URL at another disk instead
of linking inside it). The root itself may be a link. Object stores have no links: there a key is a
name, and the names checked below keep every read and write under the store's prefix.

A *partial* artifact holds what a step computed when some of its trials failed (see
`dagster_rl.core.steps.trial_set`). It is never stored under the key a complete computation uses, but
under a key of its own (the complete key and the trials that are missing); `partial(kind, key)`
finds the latest one, so a re-run attempts only the missing trials.
"""

import errno
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem
from pydantic import BaseModel

from dagster_rl.store import nofollow
from dagster_rl.core.differences import compare
from dagster_rl.core.errors import ArtifactConflictError, ArtifactMismatchError, CorruptArtifactError, DagsterRLError, InvalidArtifactKeyError, MissingArtifactError, StoreLinkError, StoreWriteError
from dagster_rl.core.hashing import cache_key, canonical_json, content_hash, sha256_hex

M = TypeVar("M", bound=BaseModel)
Warn = Callable[[str], None]

MANIFEST = "manifest.json"
DATA = "data.json"
ADOPTING_KINDS = frozenset({"weights", "rollouts", "evaluations", "judge_calls"})
KEY = re.compile(r"^[0-9a-f]{64}$")
KIND = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


def check_key(key: Any, what: str = "artifact key") -> str:
    """`key` if it is a 64-digit lowercase hex content key; `InvalidArtifactKeyError` otherwise."""
    if not isinstance(key, str) or not KEY.match(key):
        raise InvalidArtifactKeyError(
            f"{what} {str(key)[:100]!r} is not a 64-digit hex content key; refusing to build a path from it "
            "(was the materialization's metadata written by something other than dagster-rl?)"
        )
    return key


def _check_kind(kind: str) -> str:
    if not isinstance(kind, str) or not KIND.match(kind):
        raise InvalidArtifactKeyError(f"artifact kind {str(kind)[:100]!r} is not a lowercase identifier")
    return kind


def _check_name(kind: str, key: str, name: Any) -> str:
    if not isinstance(name, str) or not FILE_NAME.match(name):
        raise CorruptArtifactError(f"artifact {kind}/{key} lists a file named {str(name)[:100]!r}, which is not a plain file name")
    return name


@dataclass
class Recorded:
    """What an independent record (Dagster's event log) says of one artifact (`ArtifactStore.expect`)."""

    what: str  # e.g. "demo/rollouts 0003"
    fix: str  # what to do when the store holds other content, e.g. "re-run the range from step 0003"
    hashes: set[str] = field(default_factory=set)


class ArtifactRef(BaseModel):
    kind: str
    key: str
    content_hash: str
    uri: str

    @property
    def path(self) -> str:
        """Where the artifact lies relative to the store's root: what metadata records."""
        return f"{self.kind}/{self.key}"


class ArtifactStore:
    def __init__(self, url: str, warn: Warn | None = None, quarantine: bool = True):
        self.url = url.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.url)
        self.root = self.root.rstrip("/")
        # any local folder (a read-only subclass too) is read without following links; only the
        # plain local filesystem is written that way (a subclass may refuse writes: use its calls)
        self._nofollow = isinstance(self.fs, LocalFileSystem)
        self._local = type(self.fs) is LocalFileSystem
        self._real = os.path.realpath(self.root) if self._nofollow else self.root  # the root may be a link
        self.warn: Warn = warn or (lambda message: None)
        self.quarantine = quarantine  # False: a read-only command; nothing is moved
        self._recorded: dict[tuple[str, str], Recorded] = {}  # what Dagster's event log says of artifacts (`expect`)

    def expect(self, kind: str, key: str, content_hash: str, what: str, fix: str) -> None:
        """An independent record (a Dagster materialization, `what`) says the artifact under (kind, key)
        has `content_hash`: a read that finds other content stops with `ArtifactMismatchError`, which
        names both hashes and says `fix` (e.g. "re-run the range from step 0003"). A consistent
        change of an artifact's files and manifest passes the manifest's own hashes; not this."""
        recorded = self._recorded.setdefault((_check_kind(kind), check_key(key)), Recorded(what=what, fix=fix))
        recorded.hashes.add(content_hash)

    def _compare_with_record(self, kind: str, key: str, manifest: dict[str, str]) -> None:
        recorded = self._recorded.get((kind, key))
        stored = content_hash({"files": manifest})
        if recorded is not None and stored not in recorded.hashes:
            raise ArtifactMismatchError(
                f"artifact {kind}/{key} is not what Dagster recorded: the materialization of {recorded.what} recorded "
                f"content hash {' or '.join(sorted(recorded.hashes))}, the store holds {stored} (its files and manifest "
                "were changed together after the step stored them, or the materialization is not the step's own)."
            )

    def _dir(self, kind: str, key: str) -> str:
        return f"{self.root}/{_check_kind(kind)}/{check_key(key)}"

    def exists(self, kind: str, key: str) -> bool:
        """Whether an artifact is stored under (kind, key). Locally a link there counts (its read
        then finds it bad); a link in place of the kind's folder is a `StoreLinkError`."""
        if not self._nofollow:
            return self.fs.exists(f"{self._dir(kind, key)}/{MANIFEST}")
        _check_kind(kind), check_key(key)
        with self._links(kind, key):
            try:
                with nofollow.folder(self._real, [kind]) as kind_fd:
                    if nofollow.is_link(kind_fd, key):
                        return True
            except (FileNotFoundError, NotADirectoryError):  # no store yet, or a file where a folder should be
                return False
            return nofollow.lexists(self._real, [kind, key, MANIFEST])

    @contextmanager
    def _links(self, kind: str, key: str) -> Iterator[None]:
        """Map a link found below the root: inside the artifact, it is corrupt; above it, the store is."""
        try:
            yield
        except nofollow.LinkFound as e:
            if e.depth == 0:
                raise StoreLinkError(self._link_message(e), e.path) from None
            raise CorruptArtifactError(
                f"artifact {kind}/{key}: {e.path} is a symbolic link (to {e.target}); the store never follows links"
            ) from None

    def _link_message(self, e: nofollow.LinkFound) -> str:
        return (
            f"the artifact store at {self.url} holds a symbolic link in place of one of its folders: {e.path} -> "
            f"{e.target}. The store never follows links (reads and writes would leave it). Remove the link (its "
            "target is not touched; `dagster-rl verify <experiment> --repair` moves it to the quarantine), or, to keep "
            "artifacts on another disk, point the store's URL (DAGSTER_RL_ARTIFACTS, --artifacts) at it instead."
        )

    def _read_file(self, kind: str, key: str, name: str) -> bytes:
        if not self._nofollow:
            with self.fs.open(f"{self._dir(kind, key)}/{name}", "rb") as f:
                return f.read()
        with self._links(kind, key):
            return nofollow.read(self._real, [kind, key, name])

    # ---- reading ---------------------------------------------------------------------------

    def _manifest(self, kind: str, key: str) -> dict[str, str]:
        """The artifact's file name -> sha256; `CorruptArtifactError` when the manifest is unreadable."""
        try:
            raw = self._read_file(_check_kind(kind), check_key(key), MANIFEST)
        except (FileNotFoundError, NotADirectoryError):
            raise MissingArtifactError(f"artifact {kind}/{key} is not in the store at {self.url}; re-run the step that makes it") from None
        try:
            files = json.loads(raw)["files"]
            if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
                raise TypeError("files is not a mapping of names to hashes")
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptArtifactError(f"artifact {kind}/{key} has an unreadable {MANIFEST} ({len(raw)} bytes: {e})") from None
        manifest = {_check_name(kind, key, name): digest for name, digest in files.items()}
        self._compare_with_record(kind, key, manifest)
        return manifest

    def _read(self, kind: str, key: str, name: str, manifest: dict[str, str]) -> bytes:
        if name not in manifest:
            raise DagsterRLError(f"artifact {kind}/{key} has no file {name!r}; it holds {sorted(manifest)}")
        try:
            data = self._read_file(kind, key, name)
        except FileNotFoundError:
            raise CorruptArtifactError(f"artifact {kind}/{key}: its file {name} is missing, though its manifest lists it") from None
        if sha256_hex(data) != manifest[name]:
            raise CorruptArtifactError(
                f"artifact {kind}/{key}: its file {name} is corrupt ({len(data)} bytes whose hash does not match the manifest)"
            )
        return data

    def _checked(self, kind: str, key: str, read: Callable[[], Any]) -> Any:
        """read(), moving the artifact aside when it turns out corrupt (and re-raising, with where it went)."""
        try:
            return read()
        except ArtifactMismatchError as e:
            fix = self._recorded[(kind, key)].fix
            moved = self.move_aside(kind, key, reason="mismatch") if self.quarantine else "Nothing was moved (a read-only command)."
            raise ArtifactMismatchError(f"{e} {moved} Then {fix}.") from None
        except CorruptArtifactError as e:
            if not self.quarantine:
                raise CorruptArtifactError(
                    f"{e}. Nothing was moved (a read-only command): `dagster-rl verify <experiment> --repair` moves it "
                    "aside, as does the next run that reads it, and that run computes it again."
                ) from None
            raise CorruptArtifactError(f"{e}. {self.move_aside(kind, key)}") from None

    def ref(self, kind: str, key: str) -> ArtifactRef:
        manifest = self._checked(kind, key, lambda: self._manifest(kind, key))
        return self._ref(kind, key, manifest)

    def _ref(self, kind: str, key: str, manifest: dict[str, str]) -> ArtifactRef:
        return ArtifactRef(kind=kind, key=key, content_hash=content_hash({"files": manifest}), uri=f"{self.url}/{kind}/{key}")

    def names(self, kind: str, key: str) -> list[str]:
        """The names of the artifact's files, as its manifest lists them."""
        return sorted(self._checked(kind, key, lambda: self._manifest(kind, key)))

    def get(self, kind: str, key: str, name: str) -> bytes:
        return self._checked(kind, key, lambda: self._read(kind, key, name, self._manifest(kind, key)))

    def get_all(self, kind: str, key: str) -> dict[str, bytes]:
        return self._get_all(kind, key)[0]

    def _get_all(self, kind: str, key: str) -> tuple[dict[str, bytes], ArtifactRef]:
        def read() -> tuple[dict[str, bytes], ArtifactRef]:
            manifest = self._manifest(kind, key)
            return {name: self._read(kind, key, name, manifest) for name in manifest}, self._ref(kind, key, manifest)

        return self._checked(kind, key, read)

    def get_model(self, kind: str, key: str, model: type[M]) -> M:
        return model.model_validate_json(self.get(kind, key, DATA))

    def verify(self, kind: str, key: str) -> str | None:
        """What is wrong with the stored artifact (re-hashing every file; a link is wrong), or None;
        moves nothing."""
        problem = self.problem(kind, key)
        return None if problem is None else str(problem)

    def problem(self, kind: str, key: str) -> DagsterRLError | None:
        """`verify`'s finding as the error a read would raise (corrupt, missing, a link), or None."""
        try:
            manifest = self._manifest(kind, key)
            for name in manifest:
                self._read(kind, key, name, manifest)
        except (CorruptArtifactError, MissingArtifactError, InvalidArtifactKeyError, StoreLinkError, ArtifactMismatchError) as e:
            return e
        return None

    # ---- writing ---------------------------------------------------------------------------

    def put(self, kind: str, key: str, files: dict[str, bytes]) -> ArtifactRef:
        """Store `files` under (kind, key); an artifact already there is kept (see the module doc)."""
        return self._put(kind, key, files)[0]

    def _put(self, kind: str, key: str, files: dict[str, bytes]) -> tuple[ArtifactRef, bool]:
        """(ref, adopted): adopted is True when the stored artifact is another writer's, with other bytes."""
        manifest = {_check_name(kind, key, name): sha256_hex(data) for name, data in sorted(files.items())}
        folder = self._dir(kind, key)
        if not self.exists(kind, key):
            self._recorded.pop((kind, key), None)  # what this run writes now is what its materialization records
            try:
                self._commit(kind, key, folder, files, manifest)
            except nofollow.LinkFound as e:
                raise StoreLinkError(self._link_message(e), e.path) from None
            except OSError as e:
                raise StoreWriteError(f"could not write artifact {kind}/{key} to the store at {self.url}: {e}") from e
        stored = self._checked(kind, key, lambda: self._manifest(kind, key))
        if stored == manifest:
            return self._ref(kind, key, stored), False
        if kind not in ADOPTING_KINDS:
            raise ArtifactConflictError(
                f"artifact {kind}/{key} already exists with other content; the computation that makes it "
                "is not deterministic, or its code changed without a new code version. Nothing was overwritten."
            )
        self.warn(self._adopted(kind, key, files))
        return self._ref(kind, key, stored), True

    def _adopted(self, kind: str, key: str, files: dict[str, bytes]) -> str:
        """What a writer that adopts the stored artifact is told: what differs, and whether it is float rounding."""
        try:
            difference = compare(self.get_all(kind, key), files)
        except DagsterRLError as e:
            difference, unreadable = None, str(e)
        head = f"artifact {kind}/{key} was stored by another computation of the same key with other bytes"
        tail = "kept the first one, and this step continues from it"
        if difference is None:
            return f"{head} (the stored one could not be read to compare: {unreadable}); {tail}"
        if difference.rounding:
            return f"{head}: {difference.describe()}; {tail}"
        return (
            f"{head}: {difference.describe()}: an input that changes these bytes is missing from the key, or the "
            f"computation is not deterministic (on another machine or device a sampled token may flip); {tail}"
        )

    def _commit(self, kind: str, key: str, folder: str, files: dict[str, bytes], manifest: dict[str, str]) -> None:
        if not self._local:  # no atomic rename: files first, the manifest (which makes it exist) last
            if self._nofollow:
                self._refuse_links([kind, key])
            self.fs.makedirs(folder, exist_ok=True)
            for name, data in files.items():
                self._write_atomic(f"{folder}/{name}", data)
            self._write_atomic(f"{folder}/{MANIFEST}", canonical_json({"files": manifest}))
            return
        os.makedirs(self._real, exist_ok=True)
        staging = f".staging-{key}-{uuid.uuid4().hex}"
        with nofollow.folder(self._real, [kind], create=True) as kind_fd:
            os.mkdir(staging, 0o755, dir_fd=kind_fd)
            try:
                with nofollow.folder(self._real, [kind, staging]) as staging_fd:
                    for name, data in [*files.items(), (MANIFEST, canonical_json({"files": manifest}))]:
                        nofollow.write_new(staging_fd, name, data, f"{self.root}/{kind}/{staging}/{name}", 2)
                for attempt in range(2):
                    try:
                        os.rename(staging, key, src_dir_fd=kind_fd, dst_dir_fd=kind_fd)
                        return
                    except OSError as e:
                        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                            raise
                        if self.exists(kind, key):
                            return  # another writer was first (or a link is there: the read that follows finds it)
                        if attempt == 0:  # a folder without a manifest: an interrupted write of an older version
                            self.move_aside(kind, key, reason="incomplete")
                raise OSError(f"could not move {self.root}/{kind}/{staging} into place at {folder}")
            finally:
                shutil.rmtree(staging, ignore_errors=True, dir_fd=kind_fd)

    def _refuse_links(self, parts: list[str]) -> None:
        """For a local filesystem written through fsspec's calls (a subclass): no link on the way."""
        for depth in range(len(parts)):
            try:
                with nofollow.folder(self._real, parts[: depth + 1]):
                    pass
            except (FileNotFoundError, NotADirectoryError):
                return

    def _write_atomic(self, path: str, data: bytes) -> None:
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        with self.fs.open(tmp, "wb") as f:
            f.write(data)
        self.fs.mv(tmp, path)

    def put_model(self, kind: str, key: str, value: BaseModel) -> ArtifactRef:
        return self.put(kind, key, {DATA: canonical_json(value)})

    def move_aside(self, kind: str, key: str, reason: str = "corrupt") -> str:
        """Move the artifact's folder (or the link in its place) to the quarantine, never delete it;
        say what was done."""
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
        name = f"{check_key(key)}.{stamp}.{reason}"
        target = f"{self.root}/quarantine/{_check_kind(kind)}/{name}"
        try:
            if self._local:
                with nofollow.folder(self._real, ["quarantine", kind], create=True) as q_fd, nofollow.folder(self._real, [kind]) as kind_fd:
                    os.rename(key, name, src_dir_fd=kind_fd, dst_dir_fd=q_fd)  # a link is moved, not followed
            else:
                self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
                self.fs.mv(self._dir(kind, key), target, recursive=True)
        except nofollow.LinkFound as e:
            return f"It could not be moved aside: {self._link_message(e)}"
        except OSError as e:
            return f"It could not be moved aside ({e}): move or delete {self._dir(kind, key)} by hand, then re-run."
        self._recorded.pop((kind, key), None)  # what is computed again in its place is recorded anew
        return f"It was moved aside to {target}, so that the step that makes it computes it again."

    def move_link_aside(self, error: StoreLinkError) -> str:
        """Move a link that stands in place of one of the store's folders to the quarantine (its
        target is not touched); say what was done."""
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
        parts = os.path.relpath(error.path, self.root).split(os.sep)
        name = f"{'.'.join(parts)}.{stamp}.link"
        try:
            with nofollow.folder(self._real, ["quarantine", "links"], create=True) as q_fd, nofollow.folder(self._real, parts[:-1]) as fd:
                if not nofollow.is_link(fd, parts[-1]):
                    return f"{error.path} is no longer a link"
                os.rename(parts[-1], name, src_dir_fd=fd, dst_dir_fd=q_fd)
        except (OSError, nofollow.LinkFound) as e:
            return f"the link {error.path} could not be moved aside ({e}): remove it by hand"
        return f"moved the link {error.path} to {self.root}/quarantine/links/{name} (its target is untouched)"

    # ---- cache -----------------------------------------------------------------------------

    def get_or_put(self, kind: str, key: str, model: type[M], compute: Callable[[], M]) -> tuple[M, ArtifactRef, bool]:
        """The model stored under (kind, key), or `compute()` stored there: (value, ref, hit)."""
        made: list[M] = []

        def files() -> dict[str, bytes]:
            made.append(compute())
            return {DATA: canonical_json(made[0])}

        stored, ref, hit, adopted = self._get_or_put_files(kind, key, files)
        value = made[0] if made and not adopted else model.model_validate_json(stored[DATA])
        return value, ref, hit

    def get_or_put_files(
        self, kind: str, key: str, compute: Callable[[], dict[str, bytes]]
    ) -> tuple[dict[str, bytes], ArtifactRef, bool]:
        """`get_or_put` for an artifact of several files (name -> bytes)."""
        files, ref, hit, _ = self._get_or_put_files(kind, key, compute)
        return files, ref, hit

    def _get_or_put_files(
        self, kind: str, key: str, compute: Callable[[], dict[str, bytes]]
    ) -> tuple[dict[str, bytes], ArtifactRef, bool, bool]:
        """(files, ref, hit, adopted). A stored artifact that turns out corrupt is moved aside and
        computed again; one that another writer stored first is adopted (see the module doc)."""
        if self.exists(kind, key):
            try:
                files, ref = self._get_all(kind, key)
                return files, ref, True, False
            except CorruptArtifactError as e:
                self.warn(f"{e} Computing it again now.")
        files = compute()
        ref, adopted = self._put(kind, key, files)
        return (self.get_all(kind, key) if adopted else files), ref, False, adopted

    # ---- partial artifacts -----------------------------------------------------------------

    def put_partial(self, kind: str, key: str, files: dict[str, bytes], missing: list[str]) -> ArtifactRef:
        """Store what a computation of (kind, key) made when `missing` trials failed, under a key of
        its own, and remember it as the latest partial of `key`."""
        partial_key = cache_key("partial", "store-partial-1", of_kind=kind, of_key=check_key(key), missing=sorted(missing))
        ref = self.put(kind, partial_key, files)
        try:
            if self._local:
                tmp = f".{key}.tmp-{uuid.uuid4().hex}"
                with nofollow.folder(self._real, ["partials", _check_kind(kind)], create=True) as fd:
                    nofollow.write_new(fd, tmp, partial_key.encode(), f"{self.root}/partials/{kind}/{tmp}", 2)
                    os.rename(tmp, key, src_dir_fd=fd, dst_dir_fd=fd)  # replaces a file, or the link itself
            else:
                pointer = self._pointer(kind, key)
                if self._nofollow:
                    self._refuse_links(["partials", kind])
                self.fs.makedirs(pointer.rsplit("/", 1)[0], exist_ok=True)
                self._write_atomic(pointer, partial_key.encode())
        except nofollow.LinkFound as e:
            raise StoreLinkError(self._link_message(e), e.path) from None
        except OSError as e:
            raise StoreWriteError(f"could not record the partial artifact of {kind}/{key} in the store at {self.url}: {e}") from e
        return ref

    def partial(self, kind: str, key: str) -> str | None:
        """The key of the latest partial artifact of (kind, key), when one is stored."""
        try:
            if self._nofollow:
                try:
                    raw = nofollow.read(self._real, ["partials", _check_kind(kind), check_key(key)])
                except nofollow.LinkFound as e:
                    if e.depth < 2:
                        raise StoreLinkError(self._link_message(e), e.path) from None
                    self.warn(f"the partial pointer {e} is ignored: the store never follows links")
                    return None
            else:
                with self.fs.open(self._pointer(kind, key), "rb") as f:
                    raw = f.read()
        except (FileNotFoundError, NotADirectoryError):
            return None
        partial_key = check_key(raw.decode(errors="replace").strip(), f"partial of {kind}/{key}")
        return partial_key if self.exists(kind, partial_key) else None

    def _pointer(self, kind: str, key: str) -> str:
        return f"{self.root}/partials/{_check_kind(kind)}/{check_key(key)}"

