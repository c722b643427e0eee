"""User code an experiment names: a `.py` file in the experiments folder, or an importable module.

Two forms, the same in every process that loads an experiment (the CLI's, a run's, a step's, the
webserver's code server, an environment's worker process):

    my_rewards.py            a file in the experiments folder (a plain name: no folder, no `..`)
    my_package.my_module     a module on the Python path (installed, or under the working directory)

and, for a callable, either followed by `:name` (`my_rewards.py:length_penalty`). A file is imported
under a module name of its own (`dagster_rl_user_<hash of its path>_<stem>`), once per process, so
two folders' `rewards.py` never shadow each other. Its bytes are what a cache key holds of it
(`source_of`): editing the file is a new key, moving the experiments folder is not.
"""

import hashlib
import importlib
import importlib.util
import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

FILE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\.py$")
MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
MAX_SOURCE_BYTES = 4 << 20  # a plugin file is code, not data


class PluginError(ValueError):
    """A plugin reference that does not name a loadable module or callable (a ValueError: pydantic
    reports it as the field's error)."""


def check_reference(reference: str, callable_: bool = False) -> tuple[str, str | None]:
    """(module or file, attribute): the parts of `reference`, checked for form only (nothing imported)."""
    target, sep, attribute = reference.partition(":")
    if callable_ and (not sep or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", attribute)):
        raise PluginError(
            f"{reference!r} does not name a function: write `file.py:function` (a file in the experiments folder) "
            "or `package.module:function`"
        )
    if not callable_ and sep:
        raise PluginError(f"{reference!r} names a module, without `:`: `file.py` or `package.module`")
    if not (FILE.match(target) or (MODULE.match(target) and not target.endswith(".py"))):
        raise PluginError(
            f"{reference!r}: {target!r} is neither a file name in the experiments folder (`name.py`, no folder) nor a "
            "module name (`package.module`)"
        )
    return target, attribute if sep else None


def _file(target: str, folder: Path | None) -> Path:
    if folder is None:
        raise PluginError(f"{target!r} is a file in the experiments folder, and this experiment was not read from one")
    path = folder / target
    if not path.is_file():
        raise PluginError(f"{path}: no such file (the experiments folder {folder} holds the experiment's plugin files)")
    if path.resolve().parent != folder.resolve():
        raise PluginError(f"{path} is a link to {path.resolve()}, outside the experiments folder {folder}: copy the file in")
    return path


def source_of(reference: str, folder: Path | None) -> bytes:
    """The bytes of the code `reference` names: its file's (a `.py` in the experiments folder, or the
    module's source file). What a cache key holds of a plugin."""
    target, _ = check_reference(reference, callable_=":" in reference)
    if FILE.match(target):
        path = _file(target, folder)
    else:
        spec = importlib.util.find_spec(target)
        if spec is None or spec.origin is None or not Path(spec.origin).is_file():
            raise PluginError(f"{reference!r}: no module {target!r} on the Python path")
        path = Path(spec.origin)
    data = path.read_bytes()
    if len(data) > MAX_SOURCE_BYTES:
        raise PluginError(f"{path}: {len(data)} bytes, more than the {MAX_SOURCE_BYTES} a plugin file may hold")
    return data


def import_module(target: str, folder: Path | None) -> ModuleType:
    """The module `target` names (a file in `folder`, or a module name), imported once per process."""
    target, _ = check_reference(target)
    if not FILE.match(target):
        try:
            return importlib.import_module(target)
        except ImportError as e:
            raise PluginError(f"{target!r} cannot be imported: {e}") from None
    path = _file(target, folder)
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    name = f"dagster_rl_user_{digest}_{path.stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise PluginError(f"{path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as e:
        del sys.modules[name]
        raise PluginError(f"{path} raised while it was imported: {type(e).__name__}: {e}") from None
    return module


def load_callable(reference: str, folder: Path | None) -> Callable[..., Any]:
    """The function `reference` (`file.py:name` or `package.module:name`) names."""
    target, attribute = check_reference(reference, callable_=True)
    module = import_module(target, folder)
    found = getattr(module, attribute or "", None)
    if not callable(found):
        raise PluginError(f"{reference!r}: {target} has no function {attribute!r}")
    return found
