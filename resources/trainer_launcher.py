"""The trainer's launcher: `torchrun` on this machine as a Dagster Pipes subprocess of the driver."""

from pathlib import Path

from dagster import AssetExecutionContext, ConfigurableResource, PipesSubprocessClient
from pydantic import Field

REPO = Path(__file__).resolve().parent.parent


class PipesTorchrunLauncher(ConfigurableResource):
    """Runs the trainer's command (`torchrun ... -m dagster_rl.lm.worker job.json`) through Dagster
    Pipes (`PipesSubprocessClient`): global rank 0 of the workers reports its log line and metrics
    into the run's event log, and its stderr reaches the step's compute log.

    Examples:
        .. code-block:: python

            from dagster import Definitions
            from resources import ArtifactStoreResource, PipesTorchrunLauncher, TrainerEnvironment

            defs = Definitions(
                assets=[...],
                resources={
                    "trainer": TrainerEnvironment(launcher=PipesTorchrunLauncher(cwd="/srv/dagster-rl"), timeout_s=7200),
                    "artifact_store": ArtifactStoreResource(),
                },
            )
    """

    cwd: str = Field("", description="working directory of the trainer processes; empty: the project root")

    def run(self, context: AssetExecutionContext, command: list[str], env: dict[str, str]) -> None:
        invocation = PipesSubprocessClient(cwd=self.cwd or str(REPO)).run(command=command, context=context, env=env)
        for message in invocation.get_custom_messages():
            context.log.info(f"trainer rank 0 reported: {message}")
        _lift_typed_output_requirement(context)


def _lift_typed_output_requirement(context: AssetExecutionContext) -> None:
    """Pipes, used inside an asset, makes the step require an Output per asset. The driver reports a
    range of partitions as one AssetMaterialization per step instead, so the requirement is lifted
    after each trainer call. dagster 1.13 has no public switch for this: private attribute, pinned
    version; tests/test_lm_driver.py fails if it stops working."""
    step = context.op_execution_context._step_execution_context  # noqa: SLF001
    step._requires_typed_event_stream = False  # noqa: SLF001
