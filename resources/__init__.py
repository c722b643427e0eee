"""Dagster resources: the loop's environments, the trainer's launchers (torchrun on this machine,
an Indexed Job on Kubernetes), the artifact store, and a local run launcher. Each is configured by
pydantic fields; see each class's Examples."""

from resources.artifact_store import ArtifactStoreResource
from resources.environments import JudgeEnvironment, RolloutEnvironment, TrainerEnvironment
from resources.k8s_launcher import PipesK8sJobLauncher
from resources.trainer_launcher import PipesTorchrunLauncher

__all__ = [
    "ArtifactStoreResource",
    "JudgeEnvironment",
    "PipesK8sJobLauncher",
    "PipesTorchrunLauncher",
    "RolloutEnvironment",
    "TrainerEnvironment",
]
