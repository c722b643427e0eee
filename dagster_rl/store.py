"""Content-addressed artifact store over an fsspec URL.

An artifact is a folder `<root>/<kind>/<key>/` of files plus a `manifest.json` written last: the
manifest lists each file's sha256, and its own hash is the artifact's content hash. An artifact
without a manifest does not exist (a crash mid-write leaves nothing visible). Keys are never
overwritten: writing different content under an existing key is refused.
"""

import json
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import fsspec
from pydantic import BaseModel

from dagster_rl.errors import ArtifactConflictError, DagsterRLError
from dagster_rl.hashing import canonical_json, content_hash, sha256_hex

M = TypeVar("M", bound=BaseModel)

MANIFEST = "manifest.json"
DATA = "data.json"


class ArtifactRef(BaseModel):
    kind: str
    key: str
    content_hash: str
    uri: str


class ArtifactStore:
    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.url)

    def _dir(self, kind: str, key: str) -> str:
        return f"{self.root}/{kind}/{key}"

    def exists(self, kind: str, key: str) -> bool:
        return self.fs.exists(f"{self._dir(kind, key)}/{MANIFEST}")

    def _manifest(self, kind: str, key: str) -> dict[str, Any]:
        path = f"{self._dir(kind, key)}/{MANIFEST}"
        try:
            with self.fs.open(path, "rb") as f:
                return json.loads(f.read())
        except FileNotFoundError:
            raise DagsterRLError(
                f"artifact {kind}/{key} is not in the store at {self.url}; re-run the step that makes it"
            ) from None

    def ref(self, kind: str, key: str) -> ArtifactRef:
        manifest = self._manifest(kind, key)
        return ArtifactRef(kind=kind, key=key, content_hash=content_hash(manifest), uri=f"{self.url}/{kind}/{key}")

    def put(self, kind: str, key: str, files: dict[str, bytes]) -> ArtifactRef:
        """Store `files` under (kind, key) unless an identical artifact is there already."""
        manifest = {"files": {name: sha256_hex(data) for name, data in sorted(files.items())}}
        if self.exists(kind, key):
            if self._manifest(kind, key) != manifest:
                raise ArtifactConflictError(
                    f"artifact {kind}/{key} already exists with other content; the computation that makes it "
                    "is not deterministic, or its code changed without a new code version. Nothing was overwritten."
                )
            return self.ref(kind, key)
        folder = self._dir(kind, key)
        self.fs.makedirs(folder, exist_ok=True)
        for name, data in files.items():
            self._write_atomic(f"{folder}/{name}", data)
        self._write_atomic(f"{folder}/{MANIFEST}", canonical_json(manifest))
        return self.ref(kind, key)

    def _write_atomic(self, path: str, data: bytes) -> None:
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        with self.fs.open(tmp, "wb") as f:
            f.write(data)
        self.fs.mv(tmp, path)

    def get(self, kind: str, key: str, name: str) -> bytes:
        manifest = self._manifest(kind, key)
        if name not in manifest["files"]:
            raise DagsterRLError(f"artifact {kind}/{key} has no file {name!r}; it holds {sorted(manifest['files'])}")
        with self.fs.open(f"{self._dir(kind, key)}/{name}", "rb") as f:
            data = f.read()
        if sha256_hex(data) != manifest["files"][name]:
            raise DagsterRLError(f"artifact {kind}/{key}/{name} is corrupt (its hash does not match the manifest)")
        return data

    def get_all(self, kind: str, key: str) -> dict[str, bytes]:
        return {name: self.get(kind, key, name) for name in self._manifest(kind, key)["files"]}

    def put_model(self, kind: str, key: str, value: BaseModel) -> ArtifactRef:
        return self.put(kind, key, {DATA: canonical_json(value)})

    def get_model(self, kind: str, key: str, model: type[M]) -> M:
        return model.model_validate_json(self.get(kind, key, DATA))

    def get_or_put(self, kind: str, key: str, model: type[M], compute: Callable[[], M]) -> tuple[M, ArtifactRef, bool]:
        """The model stored under (kind, key), or `compute()` stored there: (value, ref, hit)."""
        if self.exists(kind, key):
            return self.get_model(kind, key, model), self.ref(kind, key), True
        value = compute()
        return value, self.put_model(kind, key, value), False

    def get_or_put_files(
        self, kind: str, key: str, compute: Callable[[], dict[str, bytes]]
    ) -> tuple[dict[str, bytes], ArtifactRef, bool]:
        """`get_or_put` for an artifact of several files (name -> bytes)."""
        if self.exists(kind, key):
            return self.get_all(kind, key), self.ref(kind, key), True
        files = compute()
        return files, self.put(kind, key, files), False

    def put_record(self, path: str, value: dict[str, Any]) -> dict[str, Any]:
        """Write a small JSON record once; return what is there (the first write wins)."""
        full = f"{self.root}/records/{path}.json"
        if not self.fs.exists(full):
            self.fs.makedirs(full.rsplit("/", 1)[0], exist_ok=True)
            self._write_atomic(full, canonical_json(value))
        with self.fs.open(full, "rb") as f:
            return json.loads(f.read())
