"""An artifact store's files in a local (or mounted) folder, no symbolic link followed below its root.

Every path is walked from the root one folder at a time with `O_NOFOLLOW` (`dagster_rl.store.nofollow`),
so a link is refused, never followed, and nothing lands outside the store. A link at or inside an
artifact (its folder, its manifest, a file) makes the artifact corrupt (`CorruptArtifactError`: the
rules move it aside); a link in place of a folder of the store's own layout (`<root>/rollouts`,
`<root>/quarantine`, ...) is a `StoreLinkError`: the store stops and names it (point the store's URL
at another disk instead of linking inside it). The root itself may be a link.

An artifact is written in a private staging folder and renamed into place in one step, so a crash
mid-write leaves nothing visible and of two writers of one key exactly one wins.
"""

import errno
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from dagster_rl.base.errors import CorruptArtifactError, StoreLinkError
from dagster_rl.store import nofollow
from dagster_rl.store.fsspec_storage import FsspecStorage
from dagster_rl.store.layout import MANIFEST, PARTIALS, QUARANTINE, aside_name, stamp


class LocalStorage:
    """`dagster_rl.store.storage.Storage` in a local folder, every read and write without following a link."""

    def __init__(self, url: str, root: str):
        self.url, self.root = url, root
        self._real = os.path.realpath(root)  # the root may be a link

    def exists(self, kind: str, key: str) -> bool:
        with self._links(kind, key):
            try:
                with nofollow.folder(self._real, [kind]) as kind_fd:
                    if nofollow.is_link(kind_fd, key):
                        return True
            except (FileNotFoundError, NotADirectoryError):  # no store yet, or a file where a folder should be
                return False
            return nofollow.lexists(self._real, [kind, key, MANIFEST])

    def read(self, kind: str, key: str, name: str) -> bytes:
        with self._links(kind, key):
            return nofollow.read(self._real, [kind, key, name])

    def write(self, kind: str, key: str, files: dict[str, bytes], manifest: bytes) -> None:
        try:
            self._write(kind, key, files, manifest)
        except nofollow.LinkFound as e:
            raise self._link_error(e) from None

    def _write(self, kind: str, key: str, files: dict[str, bytes], manifest: bytes) -> None:
        os.makedirs(self._real, exist_ok=True)
        staging = f".staging-{key}-{uuid.uuid4().hex}"
        with nofollow.folder(self._real, [kind], create=True) as kind_fd:
            os.mkdir(staging, 0o755, dir_fd=kind_fd)
            try:
                with nofollow.folder(self._real, [kind, staging]) as staging_fd:
                    for name, data in [*files.items(), (MANIFEST, manifest)]:
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
                            self._move_incomplete_aside(kind, key)
                raise OSError(f"could not move {self.root}/{kind}/{staging} into place at {self.root}/{kind}/{key}")
            finally:
                shutil.rmtree(staging, ignore_errors=True, dir_fd=kind_fd)

    def _move_incomplete_aside(self, kind: str, key: str) -> None:
        try:
            self.move_aside(kind, key, aside_name(key, "incomplete"))
        except (OSError, StoreLinkError):
            pass  # the rename that follows fails again, and says where

    def move_aside(self, kind: str, key: str, name: str) -> str:
        try:
            with (
                nofollow.folder(self._real, [QUARANTINE, kind], create=True) as q_fd,
                nofollow.folder(self._real, [kind]) as kind_fd,
            ):
                os.rename(key, name, src_dir_fd=kind_fd, dst_dir_fd=q_fd)  # a link is moved, not followed
        except nofollow.LinkFound as e:
            raise self._link_error(e) from None
        return f"{self.root}/{QUARANTINE}/{kind}/{name}"

    def move_link_aside(self, path: str) -> str:
        parts = os.path.relpath(path, self.root).split(os.sep)
        name = f"{'.'.join(parts)}.{stamp()}.link"
        try:
            with (
                nofollow.folder(self._real, [QUARANTINE, "links"], create=True) as q_fd,
                nofollow.folder(self._real, parts[:-1]) as fd,
            ):
                if not nofollow.is_link(fd, parts[-1]):
                    return f"{path} is no longer a link"
                os.rename(parts[-1], name, src_dir_fd=fd, dst_dir_fd=q_fd)
        except (OSError, nofollow.LinkFound) as e:
            return f"the link {path} could not be moved aside ({e}): remove it by hand"
        return f"moved the link {path} to {self.root}/{QUARANTINE}/links/{name} (its target is untouched)"

    def read_pointer(self, kind: str, key: str) -> bytes:
        try:
            return nofollow.read(self._real, [PARTIALS, kind, key])
        except nofollow.LinkFound as e:
            if e.depth < 2:
                raise self._link_error(e) from None
            raise CorruptArtifactError(f"the partial pointer {e} is ignored: the store never follows links") from None

    def write_pointer(self, kind: str, key: str, data: bytes) -> None:
        tmp = f".{key}.tmp-{uuid.uuid4().hex}"
        try:
            with nofollow.folder(self._real, [PARTIALS, kind], create=True) as fd:
                nofollow.write_new(fd, tmp, data, f"{self.root}/{PARTIALS}/{kind}/{tmp}", 2)
                os.rename(tmp, key, src_dir_fd=fd, dst_dir_fd=fd)  # replaces a file, or the link itself
        except nofollow.LinkFound as e:
            raise self._link_error(e) from None

    @contextmanager
    def _links(self, kind: str, key: str) -> Iterator[None]:
        """Map a link found below the root: inside the artifact, it is corrupt; above it, the store is."""
        try:
            yield
        except nofollow.LinkFound as e:
            if e.depth == 0:
                raise self._link_error(e) from None
            raise CorruptArtifactError(
                f"artifact {kind}/{key}: {e.path} is a symbolic link (to {e.target}); the store never follows links"
            ) from None

    def _link_error(self, e: nofollow.LinkFound) -> StoreLinkError:
        return StoreLinkError(
            f"the artifact store at {self.url} holds a symbolic link in place of one of its folders: {e.path} -> "
            f"{e.target}. The store never follows links (reads and writes would leave it). Remove the link (its "
            "target is not touched; `dagster-rl verify <experiment> --repair` moves it to the quarantine), or, to keep "
            "artifacts on another disk, point the store's URL (DAGSTER_RL_ARTIFACTS, --artifacts) at it instead.",
            e.path,
        )


class MountedStorage(LocalStorage):
    """A local folder behind a subclass of fsspec's local filesystem (a read-only mount, say): read as
    `LocalStorage` reads, written through the subclass's own calls (which may refuse a write) once no
    link is found on the way."""

    def __init__(self, url: str, root: str, fs: Any):
        super().__init__(url, root)
        self._calls = FsspecStorage(url, root, fs)

    def write(self, kind: str, key: str, files: dict[str, bytes], manifest: bytes) -> None:
        self._refuse_links([kind, key])
        self._calls.write(kind, key, files, manifest)

    def move_aside(self, kind: str, key: str, name: str) -> str:
        return self._calls.move_aside(kind, key, name)

    def write_pointer(self, kind: str, key: str, data: bytes) -> None:
        self._refuse_links([PARTIALS, kind])
        self._calls.write_pointer(kind, key, data)

    def _refuse_links(self, parts: list[str]) -> None:
        """`StoreLinkError` when a link stands on the way to `root/parts...` (as far as it exists)."""
        try:
            for depth in range(len(parts)):
                with nofollow.folder(self._real, parts[: depth + 1]):
                    pass
        except (FileNotFoundError, NotADirectoryError):
            return
        except nofollow.LinkFound as e:
            raise self._link_error(e) from None
