"""User code an experiment names: a `.py` file in the experiments folder, or an importable module;
and the plugins installed packages declare (the `dagster_rl.plugins` entry points).

Two forms, the same in every process that loads an experiment (the CLI's, a run's, a step's, the
webserver's code server, an environment's worker process):

    my_rewards.py            a file in the experiments folder (a plain name: no folder, no `..`)
    my_package.my_module     a module on the Python path (installed, or under the working directory)

and, for a callable, either followed by `:name` (`my_rewards.py:length_penalty`). A file is imported
under a module name of its own (`dagster_rl_user_<hash of its path>_<stem>`), once per process, so
two folders' `rewards.py` never shadow each other. Its bytes are what a cache key holds of it
(`source_of`): editing the file is a new key, moving the experiments folder is not.

An experiment's `plugins: [...]` lists the modules that register what it names (a task kind, a
text environment): `dagster_rl.core.experiment_files` imports them (`import_plugins`) before it
validates the rest of the file, so they are registered in whichever process reads it.

An installed package can declare its plugins instead, as entry points of the group
`dagster_rl.plugins`, each naming a module that registers on import:

    [project.entry-points."dagster_rl.plugins"]
    my_world = "my_package.world"

They are imported once per process, all of them, at the first lookup of a task kind or an
environment name that is not registered (`load_installed`); one that fails to import is named, with
its error, by the lookup that then finds nothing.
"""

import hashlib
import importlib
import importlib.metadata
import importlib.util
import re
import sys
import threading
import traceback
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
        except (Exception, SystemExit) as e:
            raise PluginError(f"{target!r} raised while it was imported{_where(e, None)}: {type(e).__name__}: {e}") from None
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
        if isinstance(e, KeyboardInterrupt):  # a person stopped it: not the plugin's fault
            raise
        raise PluginError(f"{path} raised while it was imported{_where(e, path)}: {type(e).__name__}: {e}") from None
    return module


def _where(error: BaseException, path: Path | None) -> str:
    """` (line N)`, or ` (at file.py, line N)` for a module: the last line of the plugin's own code
    in the error's traceback (an error raised by a module it imports is reported where the plugin
    called it); "" when its code is not in the traceback (a syntax error says its line itself)."""
    frames = traceback.extract_tb(error.__traceback__)
    if path is not None:
        own = [f for f in frames if f.filename == str(path)]
        return f" (line {own[-1].lineno})" if own else ""
    return f" (at {frames[-1].filename}, line {frames[-1].lineno})" if frames else ""


def import_plugins(references: object, folder: Path | None) -> None:
    """Import every plugin an experiment's `plugins` names (a file in `folder`, or a module), in order.
    Anything but a list of text is left to the experiment's validation, which says what is wrong."""
    if not isinstance(references, list):
        return
    for reference in references:
        if isinstance(reference, str):
            import_module(reference, folder)


def load_callable(reference: str, folder: Path | None) -> Callable[..., Any]:
    """The function `reference` (`file.py:name` or `package.module:name`) names."""
    target, attribute = check_reference(reference, callable_=True)
    module = import_module(target, folder)
    found = getattr(module, attribute or "", None)
    if not callable(found):
        raise PluginError(f"{reference!r}: {target} has no function {attribute!r}")
    return found


ENTRY_POINTS = "dagster_rl.plugins"  # the entry-point group of installed plugins
_installed: dict[str, str] | None = None  # after the first load: each entry point that failed -> its error
_installed_lock = threading.RLock()  # re-entrant: a plugin may look a name up while it is imported


def load_installed() -> dict[str, str]:
    """Import every `dagster_rl.plugins` entry point, once per process; each one that failed (as
    `name = value (distribution version)`) with its error (the others are imported all the same)."""
    global _installed
    with _installed_lock:
        if _installed is None:
            _installed = {}  # a lookup during the imports below finds what is registered so far
            for point in importlib.metadata.entry_points(group=ENTRY_POINTS):
                try:
                    point.load()
                except (Exception, SystemExit) as e:
                    dist = f" ({point.dist.name} {point.dist.version})" if point.dist is not None else ""
                    error = f"{type(e).__name__}: {e}{_where(e, None)}"
                    _installed[f"{point.name} = {point.value}{dist}"] = " ".join(error.split())
        return dict(_installed)


def installed_failures() -> str:
    """What a lookup that found nothing adds to its error: the installed plugins that failed to
    import ("" when none did)."""
    failed = load_installed()
    if not failed:
        return ""
    listed = "; ".join(f"{point}: {error}" for point, error in failed.items())
    return f". Installed plugins (entry points {ENTRY_POINTS}) that failed to import: {listed}"
