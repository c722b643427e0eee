"""The store's layout: what a key, a kind and a file name may be, and where each thing lies.

    <root>/<kind>/<key>/<file>...         an artifact: its files and `manifest.json`
    <root>/partials/<kind>/<key>          the key of the latest partial artifact of (kind, key)
    <root>/quarantine/<kind>/<aside>      an artifact moved aside (`aside_name`), never deleted
    <root>/quarantine/links/<aside>       a link found in place of one of the store's folders

Keys are the 64-digit hex content keys of `dagster_rl.base.hashing.cache_key`, kinds are lowercase
identifiers, file names plain names: every one is validated before a path is built from it, so no
key or manifest read from metadata or a tampered store can lead a read or a write outside the store.
"""

import re
from datetime import UTC, datetime
from typing import Any

from dagster_rl.base.errors import CorruptArtifactError, InvalidArtifactKeyError

MANIFEST = "manifest.json"
DATA = "data.json"
PARTIALS = "partials"
QUARANTINE = "quarantine"
KEY = re.compile(r"^[0-9a-f]{64}$")
KIND = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


def check_key(key: Any, what: str = "artifact key") -> str:
    """`key` if it is a 64-digit lowercase hex content key; `InvalidArtifactKeyError` otherwise."""
    if not isinstance(key, str) or not KEY.match(key):
        raise InvalidArtifactKeyError(
            f"{what} {str(key)[:100]!r} is not a 64-digit hex content key; refusing to build a path from it "
            "(was the materialization's metadata written by something other than dagster-rl?)"
        )
    return key


def check_kind(kind: Any) -> str:
    """`kind` if it is a lowercase identifier; `InvalidArtifactKeyError` otherwise."""
    if not isinstance(kind, str) or not KIND.match(kind):
        raise InvalidArtifactKeyError(f"artifact kind {str(kind)[:100]!r} is not a lowercase identifier")
    return kind


def check_name(kind: str, key: str, name: Any) -> str:
    """`name` if it is a plain file name; `CorruptArtifactError` (a manifest lists it) otherwise."""
    if not isinstance(name, str) or not FILE_NAME.match(name):
        raise CorruptArtifactError(
            f"artifact {kind}/{key} lists a file named {str(name)[:100]!r}, which is not a plain file name"
        )
    return name


def stamp() -> str:
    """The time now, as the suffix of what is moved aside: `20260102T030405123456Z`."""
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")


def aside_name(key: str, reason: str) -> str:
    """The name under `quarantine/<kind>/` of the artifact `key` moved aside for `reason`."""
    return f"{check_key(key)}.{stamp()}.{reason}"
