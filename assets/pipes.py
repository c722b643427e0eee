"""Launching the trainer's `torchrun` through Dagster Pipes: its logs and metrics reach the run."""

from pathlib import Path

from dagster import AssetExecutionContext, PipesSubprocessClient

REPO = Path(__file__).resolve().parent.parent


def pipes_runner(context: AssetExecutionContext):
    """A runner for `LMTrainer`: runs the command as a Pipes subprocess of this step; rank 0 of the
    workers reports its log line and metrics back into the run's event log."""
    client = PipesSubprocessClient(cwd=str(REPO))

    def run(command: list[str], env: dict[str, str]) -> None:
        invocation = client.run(command=command, context=context, env=env)
        for message in invocation.get_custom_messages():
            context.log.info(f"trainer rank 0 reported: {message}")
        _lift_typed_output_requirement(context)

    return run


def _lift_typed_output_requirement(context: AssetExecutionContext) -> None:
    """Pipes, used inside an asset, makes the step require an Output per asset. The driver reports a
    range of partitions as one AssetMaterialization per step instead, so it lifts that requirement
    after each trainer call. dagster 1.13 has no public switch for this: private attribute, pinned
    version; tests/test_lm_driver.py fails if it stops working."""
    step = context.op_execution_context._step_execution_context  # noqa: SLF001
    step._requires_typed_event_stream = False  # noqa: SLF001
