"""Episode folders on this machine, named by their owner; the folders of dead owners removed.

Every folder a process makes for episodes lies under `<root>/owner-<pid>-<start>/`, where
`<pid>-<start>` is the process's identity (`dagster_rl.runtime.lifetime.identity`: its pid and
start time, so a later process that reuses the pid is another owner). A process that is killed
(`kill -9` of a step's process) cannot remove its folders; the next process that opens the same
root removes the folders of every owner that is no longer running (`remove_orphans`), as a
trainer session's workers are stopped once their driver is gone.
"""

import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

from dagster_rl.base.errors import SandboxError
from dagster_rl.runtime.lifetime import alive, identity

OWNER = re.compile(r"^owner-(\d+)-(\d+)$")


def owner_folder(root: Path) -> Path:
    """This process's folder under `root` (made on first use; the root is made too)."""
    pid, _, started = identity().partition(":")
    folder = root / f"owner-{pid}-{started}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        folder.mkdir(mode=0o711, exist_ok=True)
    except OSError as e:
        what = "is a file, not a folder" if root.is_file() else f"cannot hold sandboxes: {e.strerror or e} ({e.filename or root})"
        raise SandboxError(f"the sandbox folder {root} {what}") from None
    return folder


def trial_folder(root: Path, label: str) -> Path:
    """A new folder for one trial under this process's owner folder of `root` (the folders of dead
    owners under `root` removed first)."""
    remove_orphans(root)
    return Path(tempfile.mkdtemp(prefix=f"{plain_name(label)}-", dir=owner_folder(root)))


def plain_name(label: str) -> str:
    """`label` as a file name: letters, digits, `_ . -`, at most 64 characters."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", label)[:64] or "trial"


def remove_orphans(root: Path) -> list[Path]:
    """Remove the owner folders under `root` whose process is gone; return them."""
    removed: list[Path] = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = OWNER.match(entry.name)
        if match is None or entry.is_symlink() or not entry.is_dir():
            continue
        if not alive(f"{match.group(1)}:{match.group(2)}"):
            remove_tree(entry)
            removed.append(entry)
    return removed


def remove_tree(path: Path) -> None:
    """Remove a folder whatever its programs did to it (folders made unreadable or unwritable)."""

    def allow(function, name, _excinfo) -> None:
        try:
            parent = os.path.dirname(name)
            os.chmod(parent, stat.S_IRWXU)
            if os.path.isdir(name) and not os.path.islink(name):
                os.chmod(name, stat.S_IRWXU)
                shutil.rmtree(name, onerror=allow)
            else:
                os.unlink(name)
        except FileNotFoundError:
            pass

    if path.is_symlink():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path, onerror=allow)
