"""Dagster resources: the loop's environments, the trainer's launcher, the artifact store, and a
local run launcher. Each is configured by pydantic fields; see each class's Examples."""

from resources.artifact_store import ArtifactStoreResource
from resources.environments import JudgeEnvironment, RolloutEnvironment, TrainerEnvironment
from resources.trainer_launcher import PipesTorchrunLauncher

__all__ = ["ArtifactStoreResource", "JudgeEnvironment", "PipesTorchrunLauncher", "RolloutEnvironment", "TrainerEnvironment"]
