"""Canonical content hashes: the identity of every artifact and cache key."""

import hashlib
import json
from typing import Any

from pydantic import BaseModel


def canonical_json(value: Any) -> bytes:
    """JSON with sorted keys and no whitespace; pydantic models are dumped first."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False, default=_dump).encode()


def _dump(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    raise TypeError(f"cannot hash a {type(value).__name__}: give a pydantic model or plain JSON data")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def content_hash(value: Any) -> str:
    """sha256 of the canonical JSON of `value`."""
    return sha256_hex(canonical_json(value))


def cache_key(kind: str, code_version: str, **inputs: Any) -> str:
    """The key an artifact is stored under: its kind, code version and every input that affects it."""
    return content_hash({"kind": kind, "code_version": code_version, "inputs": inputs})


def seed_of(*parts: Any) -> int:
    """A 63-bit seed derived from its parts, e.g. (experiment seed, step, prompt, sample)."""
    return int.from_bytes(hashlib.sha256(canonical_json(list(parts))).digest()[:8], "big") >> 1
