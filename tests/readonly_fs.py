"""The `readonly://` fsspec protocol, registered for every test (`pytest_plugins` in conftest.py): a
local folder that refuses every write, as a read-only mount or bucket policy would (the tests run as
root, for whom file modes do not stop a write)."""

import fsspec
from fsspec.implementations.local import LocalFileSystem


class ReadOnlyFileSystem(LocalFileSystem):
    protocol = "readonly"

    def _refuse(self, *args, **kwargs):
        raise PermissionError(30, "Read-only file system")

    def _open(self, path, mode="rb", **kwargs):
        if any(c in mode for c in "wax+"):
            self._refuse()
        return super()._open(path, mode, **kwargs)

    makedirs = mkdir = mv = rm = rm_file = touch = _refuse


fsspec.register_implementation("readonly", ReadOnlyFileSystem, clobber=True)
