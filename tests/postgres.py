"""A throwaway PostgreSQL server on 127.0.0.1 for tests, started by deploy/postgres-test-server.sh.

    def test_x(postgres_server): postgres_server.env  # {"DAGSTER_PG_HOST": ..., ...}  (a session fixture)

Without Debian's `postgresql` server binaries the fixture skips, unless env CI is set: then it
fails, so a CI image that lost PostgreSQL cannot pass by skipping.
"""

import glob
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import REPO
from tests.machine import free_port, missing

SCRIPT = REPO / "deploy" / "postgres-test-server.sh"


def postgres_bin() -> str | None:
    """The newest /usr/lib/postgresql/*/bin holding initdb and pg_ctl (or $PG_BIN), else None."""
    candidates = (
        [os.environ["PG_BIN"]] if os.environ.get("PG_BIN") else sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=_version)
    )
    for path in reversed(candidates):
        if os.access(f"{path}/initdb", os.X_OK) and os.access(f"{path}/pg_ctl", os.X_OK):
            return path
    return None


def _version(path: str) -> tuple[int, ...]:
    part = path.rstrip("/").split("/")[-2]
    return tuple(int(p) for p in part.split(".") if p.isdigit())


def require_postgres() -> str:
    """The binaries' folder; skip the test when they are absent, fail instead under CI."""
    found = postgres_bin()
    if found is None:
        missing(
            "PostgreSQL server binaries not found (/usr/lib/postgresql/*/bin/initdb, pg_ctl); "
            "install Debian's package: apt-get install -y postgresql"
        )
    return found


@dataclass(frozen=True)
class PostgresServer:
    directory: Path
    port: int
    env: dict[str, str]  # DAGSTER_PG_HOST, _PORT, _USER, _PASSWORD, _DB

    @property
    def url(self) -> str:
        e = self.env
        return f"postgresql://{e['DAGSTER_PG_USER']}:{e['DAGSTER_PG_PASSWORD']}@{e['DAGSTER_PG_HOST']}:{e['DAGSTER_PG_PORT']}/{e['DAGSTER_PG_DB']}"


def _script(cmd: str, directory: Path, port: int, bin_dir: str) -> str:
    done = subprocess.run(
        ["bash", str(SCRIPT), cmd, str(directory), str(port)],
        env={**os.environ, "PG_BIN": bin_dir},
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{SCRIPT.name} {cmd} {directory} {port} failed ({done.returncode}):\n{done.stderr}{done.stdout}")
    return done.stdout


@contextmanager
def running_postgres(port: int | None = None) -> Iterator[PostgresServer]:
    """Start a server in a fresh /tmp folder (reachable by the `postgres` user); stop and delete it after."""
    bin_dir = require_postgres()
    directory = Path(tempfile.mkdtemp(prefix="dagster-rl-pg-", dir="/tmp"))
    port = port or free_port()
    try:
        out = _script("start", directory, port, bin_dir)
        env = dict(line.split("=", 1) for line in out.splitlines() if line.startswith("DAGSTER_PG_"))
        yield PostgresServer(directory, port, env)
    finally:
        try:
            _script("stop", directory, port, bin_dir)
        finally:
            shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    with running_postgres() as server:
        yield server
