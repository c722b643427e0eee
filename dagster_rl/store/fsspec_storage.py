"""An artifact store's files under any fsspec URL (`s3://bucket/prefix`, `gs://`, `memory://`, ...).

Object stores have no atomic rename of a folder: an artifact's files are written first and its
manifest, which makes it exist, last; each file is written under a temporary name and moved into
place. Object stores have no links either: a key is a name, and the names the rules check
(`dagster_rl.store.layout`) keep every read and write under the store's prefix.
"""

import uuid
from typing import Any

from dagster_rl.store.layout import MANIFEST, PARTIALS, QUARANTINE


class FsspecStorage:
    """`dagster_rl.store.storage.Storage` through an fsspec filesystem's own calls."""

    def __init__(self, url: str, root: str, fs: Any):
        self.url, self.root, self.fs = url, root, fs

    def _dir(self, kind: str, key: str) -> str:
        return f"{self.root}/{kind}/{key}"

    def _pointer(self, kind: str, key: str) -> str:
        return f"{self.root}/{PARTIALS}/{kind}/{key}"

    def exists(self, kind: str, key: str) -> bool:
        return bool(self.fs.exists(f"{self._dir(kind, key)}/{MANIFEST}"))

    def read(self, kind: str, key: str, name: str) -> bytes:
        return self._read(f"{self._dir(kind, key)}/{name}")

    def write(self, kind: str, key: str, files: dict[str, bytes], manifest: bytes) -> None:
        folder = self._dir(kind, key)
        self.fs.makedirs(folder, exist_ok=True)
        for name, data in [*files.items(), (MANIFEST, manifest)]:
            self._write_atomic(f"{folder}/{name}", data)

    def move_aside(self, kind: str, key: str, name: str) -> str:
        target = f"{self.root}/{QUARANTINE}/{kind}/{name}"
        self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        self.fs.mv(self._dir(kind, key), target, recursive=True)
        return target

    def move_link_aside(self, path: str) -> str:
        return f"the link {path} could not be moved aside (the store at {self.url} has no links): remove it by hand"

    def read_pointer(self, kind: str, key: str) -> bytes:
        return self._read(self._pointer(kind, key))

    def write_pointer(self, kind: str, key: str, data: bytes) -> None:
        pointer = self._pointer(kind, key)
        self.fs.makedirs(pointer.rsplit("/", 1)[0], exist_ok=True)
        self._write_atomic(pointer, data)

    def _read(self, path: str) -> bytes:
        with self.fs.open(path, "rb") as f:
            return f.read()

    def _write_atomic(self, path: str, data: bytes) -> None:
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        with self.fs.open(tmp, "wb") as f:
            f.write(data)
        self.fs.mv(tmp, path)
