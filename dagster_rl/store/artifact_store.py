"""Content-addressed artifact store: the caching rules, on the storage its URL names
(`dagster_rl.store.storage`: a local folder, no link followed, or any fsspec URL).

An artifact is a folder `<root>/<kind>/<key>/` of files plus a `manifest.json`: the manifest lists
each file's sha256, and its own hash is the artifact's content hash. An artifact without a manifest
does not exist; the storage writes the manifest last, so a crash mid-write leaves nothing visible (on
a local disk an artifact is renamed into place in one step, so of two writers of one key exactly one
wins). Kinds, keys and file names are validated before a path is built from them
(`dagster_rl.store.layout`).

Keys are never overwritten. When an artifact is already stored under a key:
- kinds in `ADOPTING_KINDS` (float compute that may differ in its last bits between two
  computations of one key on a GPU: trained `weights`, sampled `rollouts`, `evaluations`, and the
  LLM judge's `judge_calls`) keep the first writer's artifact; a second writer with other bytes
  adopts it, and the step continues from the stored one. Its warning says what differs
  (`dagster_rl.base.differences`), and calls it float rounding only when nothing but floats differ,
  within `differences.ROUNDING`;
- every other kind (rewards, worlds, ...) is deterministic: other content under an existing key is
  an `ArtifactConflictError`, since the code changed without a new code version.

A corrupt artifact (a file whose hash does not match the manifest, a missing file, an unreadable
manifest, a symbolic link) is moved aside to `<root>/quarantine/<kind>/<key>.<time>` (never deleted):
`get_or_put` then computes it again; a plain read raises `CorruptArtifactError` naming it and saying
where it went. A store opened with `quarantine=False` (the read-only commands: `dagster-rl status`,
`lineage`, `verify`) moves nothing: it says what is wrong and leaves the store as it found it. A
link in place of one of the store's own folders is a `StoreLinkError`: the store stops and names it
(`dagster_rl.store.local_storage`).

A *partial* artifact holds what a step computed when some of its trials failed (see
`dagster_rl.core.steps.trial_set`). It is never stored under the key a complete computation uses, but
under a key of its own (the complete key and the trials that are missing); `partial(kind, key)`
finds the latest one, so a re-run attempts only the missing trials.
"""

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel

from dagster_rl.base.differences import Difference, compare
from dagster_rl.base.errors import (
    ArtifactConflictError,
    ArtifactMismatchError,
    CorruptArtifactError,
    DagsterRLError,
    InvalidArtifactKeyError,
    MissingArtifactError,
    StoreLinkError,
    StoreWriteError,
)
from dagster_rl.base.hashing import cache_key, canonical_json, content_hash, sha256_hex
from dagster_rl.store.layout import DATA, MANIFEST, aside_name, check_key, check_kind, check_name
from dagster_rl.store.storage import Storage, open_storage

__all__ = ["ADOPTING_KINDS", "DATA", "ArtifactRef", "ArtifactStore", "Recorded", "check_key"]

M = TypeVar("M", bound=BaseModel)
Warn = Callable[[str], None]

ADOPTING_KINDS = frozenset({"weights", "rollouts", "evaluations", "judge_calls"})


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


def adoption_warning(kind: str, key: str, difference: Difference | str | None) -> str:
    """What a writer that adopts the stored artifact is told: what differs, and whether it is float
    rounding (`difference` is why, when the stored artifact could not be read to compare; None when
    its files read back as this writer's own)."""
    head = f"artifact {kind}/{key} was stored by another computation of the same key with other bytes"
    tail = "kept the first one, and this step continues from it"
    if difference is None:
        return f"{head} (its files now read back as this computation's own); {tail}"
    if isinstance(difference, str):
        return f"{head} (the stored one could not be read to compare: {difference}); {tail}"
    if difference.rounding:
        return f"{head}: {difference.describe()}; {tail}"
    return (
        f"{head}: {difference.describe()}: an input that changes these bytes is missing from the key, or the "
        f"computation is not deterministic (on another machine or device a sampled token may flip); {tail}"
    )


class ArtifactStore:
    """The caching rules of the module doc, on `storage` (by default the one `url` names)."""

    def __init__(self, url: str, warn: Warn | None = None, quarantine: bool = True, storage: Storage | None = None):
        self.url = url.rstrip("/")
        self.storage = storage or open_storage(self.url)
        self.root = self.storage.root
        self.warn: Warn = warn or (lambda message: None)
        self.quarantine = quarantine  # False: a read-only command; nothing is moved
        self._recorded: dict[tuple[str, str], Recorded] = {}  # what Dagster's event log says of artifacts (`expect`)

    def expect(self, kind: str, key: str, content_hash: str, what: str, fix: str) -> None:
        """An independent record (a Dagster materialization, `what`) says the artifact under (kind, key)
        has `content_hash`: a read that finds other content stops with `ArtifactMismatchError`, which
        names both hashes and says `fix` (e.g. "re-run the range from step 0003"). A consistent
        change of an artifact's files and manifest passes the manifest's own hashes; not this."""
        recorded = self._recorded.setdefault((check_kind(kind), check_key(key)), Recorded(what=what, fix=fix))
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

    def exists(self, kind: str, key: str) -> bool:
        """Whether an artifact is stored under (kind, key). Locally a link there counts (its read
        then finds it bad); a link in place of the kind's folder is a `StoreLinkError`."""
        return self.storage.exists(check_kind(kind), check_key(key))

    # ---- reading ---------------------------------------------------------------------------

    def _manifest(self, kind: str, key: str) -> dict[str, str]:
        """The artifact's file name -> sha256; `CorruptArtifactError` when the manifest is unreadable."""
        try:
            raw = self.storage.read(check_kind(kind), check_key(key), MANIFEST)
        except (FileNotFoundError, NotADirectoryError):
            raise MissingArtifactError(
                f"artifact {kind}/{key} is not in the store at {self.url}; re-run the step that makes it"
            ) from None
        try:
            files = json.loads(raw)["files"]
            if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
                raise TypeError("files is not a mapping of names to hashes")
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptArtifactError(f"artifact {kind}/{key} has an unreadable {MANIFEST} ({len(raw)} bytes: {e})") from None
        manifest = {check_name(kind, key, name): digest for name, digest in files.items()}
        self._compare_with_record(kind, key, manifest)
        return manifest

    def _read(self, kind: str, key: str, name: str, manifest: dict[str, str]) -> bytes:
        if name not in manifest:
            raise DagsterRLError(f"artifact {kind}/{key} has no file {name!r}; it holds {sorted(manifest)}")
        try:
            data = self.storage.read(kind, key, name)
        except FileNotFoundError:
            raise CorruptArtifactError(
                f"artifact {kind}/{key}: its file {name} is missing, though its manifest lists it"
            ) from None
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
            moved = (
                self.move_aside(kind, key, reason="mismatch") if self.quarantine else "Nothing was moved (a read-only command)."
            )
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
        manifest = {check_name(kind, key, name): sha256_hex(data) for name, data in sorted(files.items())}
        if not self.exists(kind, key):
            self._recorded.pop((kind, key), None)  # what this run writes now is what its materialization records
            try:
                self.storage.write(kind, key, files, canonical_json({"files": manifest}))
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
        try:
            difference: Difference | str | None = compare(self.get_all(kind, key), files)
        except DagsterRLError as e:
            difference = str(e)
        self.warn(adoption_warning(kind, key, difference))
        return self._ref(kind, key, stored), True

    def put_model(self, kind: str, key: str, value: BaseModel) -> ArtifactRef:
        return self.put(kind, key, {DATA: canonical_json(value)})

    def move_aside(self, kind: str, key: str, reason: str = "corrupt") -> str:
        """Move the artifact's folder (or the link in its place) to the quarantine, never delete it;
        say what was done."""
        name = aside_name(key, reason)
        try:
            target = self.storage.move_aside(check_kind(kind), key, name)
        except StoreLinkError as e:
            return f"It could not be moved aside: {e}"
        except OSError as e:
            return f"It could not be moved aside ({e}): move or delete {self.root}/{kind}/{key} by hand, then re-run."
        self._recorded.pop((kind, key), None)  # what is computed again in its place is recorded anew
        return f"It was moved aside to {target}, so that the step that makes it computes it again."

    def move_link_aside(self, error: StoreLinkError) -> str:
        """Move a link that stands in place of one of the store's folders to the quarantine (its
        target is not touched); say what was done."""
        return self.storage.move_link_aside(error.path)

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
            self.storage.write_pointer(kind, key, partial_key.encode())
        except OSError as e:
            raise StoreWriteError(f"could not record the partial artifact of {kind}/{key} in the store at {self.url}: {e}") from e
        return ref

    def partial(self, kind: str, key: str) -> str | None:
        """The key of the latest partial artifact of (kind, key), when one is stored (a pointer the
        storage cannot trust, a link say, is ignored with a warning)."""
        try:
            raw = self.storage.read_pointer(check_kind(kind), check_key(key))
        except (FileNotFoundError, NotADirectoryError):
            return None
        except CorruptArtifactError as e:
            self.warn(str(e))
            return None
        partial_key = check_key(raw.decode(errors="replace").strip(), f"partial of {kind}/{key}")
        return partial_key if self.exists(kind, partial_key) else None
