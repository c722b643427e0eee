"""What the artifact store's rules need of the files under its URL (`Storage`), and which storage a
URL gets (`open_storage`).

The rules (`dagster_rl.store.artifact_store`) validate every kind, key and file name
(`dagster_rl.store.layout`) before they call a storage, and a storage raises:
- `FileNotFoundError` or `NotADirectoryError` where nothing is stored;
- `StoreLinkError` for a symbolic link in place of one of the store's own folders, and
  `CorruptArtifactError` for one at or inside an artifact (a storage without links raises neither);
- `OSError` for a write the filesystem refuses.

Two storages implement it:
    `LocalStorage` (`local_storage`)      a local or mounted folder, no link followed below the root
    `FsspecStorage` (`fsspec_storage`)    any other fsspec URL (`s3://`, `gs://`, `memory://`, ...)
"""

from typing import Protocol

import fsspec
from fsspec.implementations.local import LocalFileSystem

from dagster_rl.store.fsspec_storage import FsspecStorage
from dagster_rl.store.local_storage import LocalStorage, MountedStorage


class Storage(Protocol):
    """The files of a store: artifacts under `<root>/<kind>/<key>/`, partial pointers, the quarantine
    (`dagster_rl.store.layout`)."""

    url: str  # the store's URL, as messages name it
    root: str  # the folder or prefix its paths start with

    def exists(self, kind: str, key: str) -> bool:
        """Whether (kind, key) has a manifest (where links exist, a link in place of the artifact counts:
        its read then finds it bad)."""
        ...

    def read(self, kind: str, key: str, name: str) -> bytes:
        """The bytes of the file `name` of the artifact (kind, key)."""
        ...

    def write(self, kind: str, key: str, files: dict[str, bytes], manifest: bytes) -> None:
        """Store an artifact that is not stored yet: its files, then its manifest, which makes it exist.
        Returns too when another writer stored (kind, key) first; the caller reads what is there."""
        ...

    def move_aside(self, kind: str, key: str, name: str) -> str:
        """Move the artifact's folder (or what stands in its place) to `quarantine/<kind>/<name>`; its
        path there."""
        ...

    def move_link_aside(self, path: str) -> str:
        """Move a link that stands in place of one of the store's folders to `quarantine/links/` (its
        target is not touched); say what was done."""
        ...

    def read_pointer(self, kind: str, key: str) -> bytes:
        """The key stored in the partial pointer of (kind, key)."""
        ...

    def write_pointer(self, kind: str, key: str, data: bytes) -> None:
        """Point the partial pointer of (kind, key) at `data` (a key), replacing what it held."""
        ...


def open_storage(url: str) -> Storage:
    """The storage of the store at `url`: a plain local folder is read and written without following
    a link; a local folder behind a subclass of fsspec's local filesystem (a read-only mount, say) is
    read that way and written through the subclass's calls, which may refuse; any other URL through
    fsspec."""
    fs, root = fsspec.core.url_to_fs(url)
    root = root.rstrip("/")
    if type(fs) is LocalFileSystem:
        return LocalStorage(url, root)
    if isinstance(fs, LocalFileSystem):
        return MountedStorage(url, root, fs)
    return FsspecStorage(url, root, fs)
