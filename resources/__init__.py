"""Dagster resources: the loop's environments, the trainer's launchers (torchrun on this machine,
an Indexed Job on Kubernetes), the artifact store, and a local run launcher. Each is configured by
pydantic fields; see each class's Examples. `dagster_internals` holds the names of Dagster's private
API that `assets/` and `resources/` use, and the Dagster version they were checked against.

Each is imported on first use (`from resources import X`), so that a module that needs one
resource (`dagster-rl status` needs the artifact store's) does not load Kubernetes' client too.
"""

import importlib

_MODULES = {
    "ArtifactStoreResource": "resources.artifact_store",
    "JudgeEnvironment": "resources.environments",
    "PipesK8sJobLauncher": "resources.k8s_launcher",
    "PipesTorchrunLauncher": "resources.trainer_launcher",
    "RolloutEnvironment": "resources.environments",
    "SandboxEnvironment": "resources.environments",
    "TrainerEnvironment": "resources.environments",
}

__all__ = sorted(_MODULES)


def __getattr__(name: str):
    if name not in _MODULES:
        raise AttributeError(f"module 'resources' has no attribute {name!r}")
    return getattr(importlib.import_module(_MODULES[name]), name)
