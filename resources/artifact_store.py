"""Where artifacts live: the content-addressed store (`dagster_rl.store`) as a Dagster resource."""

import os
from collections.abc import Callable
from pathlib import Path

from dagster import ConfigurableResource
from pydantic import Field

from dagster_rl.store import ArtifactStore


def default_artifact_url() -> str:
    home = os.environ.get("DAGSTER_HOME") or str(Path.cwd() / ".dagster_home")
    return f"file://{Path(home).resolve()}/artifacts"


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
