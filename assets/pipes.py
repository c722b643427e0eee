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

    return run
