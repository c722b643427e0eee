"""Where artifacts live: the content-addressed store (`dagster_rl.store.artifact_store`) as a Dagster resource."""

import os
from collections.abc import Callable
from pathlib import Path

from dagster import ConfigurableResource
from pydantic import Field

from dagster_rl.base.errors import DagsterHomeError
from dagster_rl.store.artifact_store import ArtifactStore

DAGSTER_HOME_UNSET = (
    "DAGSTER_HOME is not set: Dagster would record runs in a throwaway instance, deleted when the command "
    "ends, while their artifacts stayed on disk. Set it to the folder that keeps the instance, e.g.\n"
    "    export DAGSTER_HOME=$PWD/.dagster_home\n"
    "(`make demo` and `make ui` use .dagster_home)"
)


def dagster_home() -> Path:
    """$DAGSTER_HOME; a `DagsterHomeError` that says what to set when it is unset (never a throwaway
    instance, never a guess such as ./.dagster_home)."""
    home = os.environ.get("DAGSTER_HOME", "").strip()
    if not home:
        raise DagsterHomeError(DAGSTER_HOME_UNSET)
    return Path(home)


def default_artifact_url() -> str:
    return f"file://{dagster_home().resolve()}/artifacts"


class ArtifactStoreResource(ConfigurableResource):
    """Where artifacts live: any fsspec URL (`file:///...`, `s3://bucket/prefix`, ...).

    Examples:
        .. code-block:: python

            from dagster import Definitions
            from resources import ArtifactStoreResource

            defs = Definitions(assets=[...], resources={"artifact_store": ArtifactStoreResource(url="s3://my-bucket/dagster-rl")})
    """

    url: str = Field("", description="fsspec URL; empty means $DAGSTER_HOME/artifacts")

    def get_store(self, warn: Callable[[str], None] | None = None) -> ArtifactStore:
        """The store; `warn` hears what it repairs (a corrupt artifact moved aside, one adopted)."""
        return ArtifactStore(self.url or default_artifact_url(), warn)
