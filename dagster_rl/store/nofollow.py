"""Files under a root folder, reached without following a symbolic link anywhere below the root.

A path is walked one component at a time from the root's file descriptor, each component opened
relative to the last with `O_NOFOLLOW` (`openat`), so a link planted anywhere below the root (a
file, an artifact's folder, a kind's folder) is found and refused, never followed, and nothing can
swap a folder for a link between a check and the open. The root itself may be a link: it is
resolved once, where the user chose to put the store.

Local and mounted filesystems only: object stores have no links (a key is a name).
"""

import errno
import os
import stat
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class LinkFound(Exception):
    """A component below the root is a symbolic link: `depth` is its index among the parts (0: a
    folder right under the root), `path` where it is, `target` where it points."""

    def __init__(self, path: str, target: str, depth: int):
        super().__init__(f"{path} is a symbolic link (to {target})")
        self.path, self.target, self.depth = path, target, depth


def _refuse_if_link(dir_fd: int, name: str, path: str, depth: int) -> None:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.readlink(name, dir_fd=dir_fd)
        except OSError:
            target = "?"
        raise LinkFound(path, target, depth)


def _open_at(dir_fd: int, name: str, flags: int, path: str, depth: int, mode: int = 0o644) -> int:
    try:
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
            _refuse_if_link(dir_fd, name, path, depth)
        raise


@contextmanager
def folder(root: str, parts: Sequence[str], create: bool = False) -> Iterator[int]:
    """A file descriptor of the folder `root/parts...`, no link followed below `root`; missing
    folders are made when `create` (else `FileNotFoundError`)."""
    fd = os.open(root, DIR_FLAGS & ~os.O_NOFOLLOW)
    try:
        for depth, part in enumerate(parts):
            path = os.path.join(root, *parts[: depth + 1])
            try:
                child = _open_at(fd, part, os.O_RDONLY | os.O_DIRECTORY, path, depth)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass  # another writer made it: open what is there (a link is still refused)
                child = _open_at(fd, part, os.O_RDONLY | os.O_DIRECTORY, path, depth)
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def read(root: str, parts: Sequence[str]) -> bytes:
    """The bytes of the file `root/parts...`, no link followed below `root`."""
    with folder(root, parts[:-1]) as dir_fd:
        fd = _open_at(dir_fd, parts[-1], os.O_RDONLY, os.path.join(root, *parts), len(parts) - 1)
    with os.fdopen(fd, "rb") as f:
        return f.read()


def lexists(root: str, parts: Sequence[str]) -> bool:
    """Whether anything (a link included) is at `root/parts...`; a link above it raises `LinkFound`."""
    try:
        with folder(root, parts[:-1]) as dir_fd:
            os.stat(parts[-1], dir_fd=dir_fd, follow_symlinks=False)
    except (FileNotFoundError, NotADirectoryError):
        return False
    return True


def is_link(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return False


def write_new(dir_fd: int, name: str, data: bytes, path: str, depth: int) -> None:
    """Write a new file `name` in the folder `dir_fd` (refused if anything, a link included, is there)."""
    fd = _open_at(dir_fd, name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, path, depth)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
