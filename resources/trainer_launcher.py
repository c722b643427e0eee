"""The trainer's launcher: `torchrun` on this machine as a Dagster Pipes subprocess of the driver,
for one step (`run`) or for a range of steps (`start`: a trainer session's workers)."""

import logging
import os
import time
import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from dagster import (
    AssetExecutionContext,
    BetaWarning,
    ConfigurableResource,
    PipesSubprocessClient,
    PipesTempFileContextInjector,
    PipesTempFileMessageReader,
    PreviewWarning,
    open_pipes_session,
)
from pydantic import Field

from dagster_rl.runtime.workers import ProcessWorkers

REPO = Path(__file__).resolve().parent.parent


class PipesTorchrunLauncher(ConfigurableResource):
    """Runs the trainer's command (`torchrun ... -m dagster_rl.tasks.lm.train.entrypoint <job.json | session>`)
    through Dagster Pipes: global rank 0 of the workers reports its log line and metrics into the
    run's event log. `run` waits for one step's command (`PipesSubprocessClient`; its stderr reaches
    the step's compute log); `start` leaves a session's workers running beside the driver, with one
    Pipes session open until they are closed, and logs each step's report as it arrives.

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
        with no_preview_notices():
            invocation = PipesSubprocessClient(cwd=self.cwd or str(REPO)).run(command=command, context=context, env=env)
        for message in invocation.get_custom_messages():
            context.log.info(f"trainer rank 0 reported: {message}")
        _lift_typed_output_requirement(context)

    def start(self, context: AssetExecutionContext, command: list[str], env: dict[str, str]) -> "PipesWorkers":
        stack = ExitStack()
        with no_preview_notices():
            session = stack.enter_context(
                open_pipes_session(context, PipesTempFileContextInjector(), PipesTempFileMessageReader())
            )
        _lift_typed_output_requirement(context)  # the driver yields its own materializations while the session is open
        try:
            workers = ProcessWorkers(
                command, {**os.environ, **env, **session.get_bootstrap_env_vars()}, cwd=self.cwd or str(REPO)
            )
        except BaseException:
            stack.close()
            raise
        return PipesWorkers(context, session, stack, workers)


class ReportedMessages:
    """Logs rank 0's Pipes messages (one per step) into the run as they arrive, each once."""

    def __init__(self, context, session):
        self.context, self.session, self.logged = context, session, 0

    def log_new(self, at_least: int = 0, wait_s: float = 0.0) -> None:
        """Log what arrived; wait up to `wait_s` until `at_least` messages did (rank 0 reports a
        step before it answers, and the reader polls its file every 10 ms)."""
        deadline = time.monotonic() + wait_s
        while len(self.session.get_custom_messages()) < at_least and time.monotonic() < deadline:
            time.sleep(0.005)
        messages = self.session.get_custom_messages()
        for message in messages[self.logged :]:
            self.context.log.info(f"trainer rank 0 reported: {message}")
        self.logged = len(messages)


class PipesWorkers:
    """A session's torchrun on this machine, inside its Pipes session (`dagster_rl.runtime.workers.Workers`)."""

    def __init__(self, context, session, stack: ExitStack, workers: ProcessWorkers):
        self.context, self.stack, self.workers = context, stack, workers
        self.messages = ReportedMessages(context, session)
        self.steps = 0

    def check(self) -> None:
        self.messages.log_new()
        self.workers.check()

    def stepped(self) -> None:
        self.steps += 1
        self.messages.log_new(at_least=self.steps, wait_s=1.0)  # the step's report, in the log before the step's end

    def close(self, grace_s: float) -> None:
        with ended_by_the_driver(self.context, grace_s):
            try:
                self.workers.close(grace_s)
            finally:
                self.stack.close()  # the Pipes session: its reader reads what is left
                self.messages.log_new()
                _lift_typed_output_requirement(self.context)


class _NoClosingMessage(logging.Filter):
    """Pipes' warnings that the workers did not close (or, ended while starting, did not open) their side."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not message.startswith(("[pipes] did not receive closed message", "[pipes] did not receive any messages"))


@contextmanager
def ended_by_the_driver(context, grace_s: float) -> Iterator[None]:
    """Around closing a session's workers: with no grace, the driver ends them (a failed step, an
    interrupted run), so they cannot send Pipes their closing message (nor, ended while starting,
    any message), and Pipes' warning that they did not is what was meant, not news: it is left out
    of the log."""
    quiet = _NoClosingMessage() if grace_s <= 0 else None
    if quiet is not None:
        context.log.addFilter(quiet)
    try:
        yield
    finally:
        if quiet is not None:
            context.log.removeFilter(quiet)


@contextmanager
def no_preview_notices() -> Iterator[None]:
    """Dagster's notices that a Pipes API it calls itself is in preview: about Dagster, not about the run."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PreviewWarning)
        warnings.simplefilter("ignore", BetaWarning)
        yield


def _lift_typed_output_requirement(context: AssetExecutionContext) -> None:
    """Pipes, used inside an asset, makes the step require an Output per asset. The driver reports a
    range of partitions as one AssetMaterialization per step instead, so the requirement is lifted
    after each trainer call. dagster 1.13 has no public switch for this: private attribute, pinned
    version; tests/test_lm_driver.py fails if it stops working."""
    step = context.op_execution_context._step_execution_context
    step._requires_typed_event_stream = False
