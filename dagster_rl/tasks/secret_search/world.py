"""Worlds: folders of documents, built deterministically from their id.

Exactly one document holds the sha256 digest of the world's secret. The secret itself is derived
from the world id in memory and never written anywhere.
"""

import hashlib
import random

from dagster_rl.base.hashing import seed_of

WORLD_CODE_VERSION = "world-1"
DIGEST_PREFIX = "secret-digest: "
NOTE_PREFIX = "note: read by "
_WORDS = "ledger archive memo draft budget roster minutes invoice summary appendix notes index".split()


def world_ids(n_worlds: int) -> list[str]:
    return [f"w{i}" for i in range(n_worlds)]


def doc_name(index: int) -> str:
    return f"doc_{index:03d}.txt"


def _secret(world_id: str) -> bytes:
    return hashlib.sha256(f"dagster-rl secret of world {world_id}".encode()).digest()[:16]


def secret_digest(world_id: str) -> str:
    """What a correct agent answers: the sha256 of the world's secret."""
    return hashlib.sha256(_secret(world_id)).hexdigest()


def secret_doc(world_id: str, n_docs: int) -> int:
    return seed_of("secret-doc", world_id) % n_docs


def build_world(world_id: str, n_docs: int) -> dict[str, bytes]:
    """The world's documents, file name -> content."""
    rng = random.Random(seed_of("world", world_id))
    holder = secret_doc(world_id, n_docs)
    docs = {}
    for i in range(n_docs):
        lines = [" ".join(rng.choice(_WORDS) for _ in range(8)) for _ in range(4)]
        if i == holder:
            lines.insert(rng.randrange(len(lines) + 1), DIGEST_PREFIX + secret_digest(world_id))
        docs[doc_name(i)] = ("\n".join(lines) + "\n").encode()
    return docs
