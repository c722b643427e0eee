"""Dagster resources: the loop's environments and the artifact store, configured by pydantic fields."""

from resources.artifact_store import ArtifactStoreResource
from resources.environments import JudgeEnvironment, RolloutEnvironment, TrainerEnvironment

__all__ = ["ArtifactStoreResource", "JudgeEnvironment", "RolloutEnvironment", "TrainerEnvironment"]
