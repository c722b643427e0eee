"""What the tests ask of this machine: a free port on 127.0.0.1, and what a missing requirement does
(the test skips, unless env CI is set: then it fails, so that a CI image that lost PostgreSQL, vLLM or
a model package cannot pass by skipping)."""

import os
import socket
from typing import NoReturn

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def missing(reason: str) -> NoReturn:
    """Skip the test for want of what `reason` names; fail it instead where CI is set."""
    if in_ci():
        pytest.fail(f"CI is set and {reason}", pytrace=False)
    pytest.skip(reason)
