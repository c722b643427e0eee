"""`dagster-rl train`: the range checked (the experiment, its steps, DAGSTER_HOME, the steps before
it materialized), then run as one run of `<exp>_train` of the workspace's code location, in this
process, with the concise console (`assets.console`).
"""

import argparse
import signal
import sys

from assets.cli_inputs import find_experiment, home_problem, open_instance
from assets.run_tags import range_tags
from dagster_rl.core.experiment import Experiment, step_key

INTERRUPTED_EXIT = 130  # as a shell reports a command ended by Ctrl-C


def checked_range(args: argparse.Namespace) -> tuple[Experiment, int, int]:
    """The experiment and the (first, last) steps `train` names; exits saying what to write or set
    when the experiment, the range or DAGSTER_HOME is wrong."""
    exp = find_experiment(args.experiment)
    first, last = parse_range(exp, args.range)
    if (problem := home_problem()) is not None:
        sys.exit(f"dagster-rl: {problem}")
    return exp, first, last


def train_here(exp: Experiment, first: int, last: int, log_level: str) -> None:
    """Check that the steps before the range are materialized, then run the range as one run of
    `<exp>_train` on the instance, in this process, with the concise console; exits 1 when the run
    failed, `INTERRUPTED_EXIT` when it was interrupted (the console said why)."""
    with open_instance() as instance:
        from assets.predecessor import missing_before

        missing = missing_before(instance, exp, first)
        if missing:
            sys.exit(
                f"dagster-rl: step {step_key(first)} of {exp.name} starts from the weights of step {step_key(first - 1)}, which "
                f"are not materialized (missing: {', '.join(missing[:8])}{'...' if len(missing) > 8 else ''}). Run from step "
                f"{missing[0]}, e.g.\n    .venv/bin/dagster-rl train {exp.name} {missing[0]}...{step_key(last)}"
            )
        result = _execute(instance, exp, first, last, log_level)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the run has ended as it says: a late Ctrl-C changes nothing
        if not result.success:
            sys.exit(INTERRUPTED_EXIT if _was_interrupted(instance, result.run_id) else 1)  # the console said why


def parse_range(exp: Experiment, text: str | None) -> tuple[int, int]:
    """(first, last) of `FIRST...LAST` or one step (`7`, `0007`); every step when None. Exits
    with what to write instead when it is not a range of the experiment's steps."""
    if text is None:
        return 0, exp.n_steps - 1
    ends = text.split("...")
    every = f"{exp.name}'s steps are 0000...{step_key(exp.n_steps - 1)}"
    if len(ends) > 2 or not all(e.isdigit() for e in ends):
        sys.exit(
            f"dagster-rl: {text!r} is not a range of steps: give FIRST...LAST (e.g. 0008...0011) or one step (e.g. 8); {every}"
        )
    first, last = int(ends[0]), int(ends[-1])
    if last >= exp.n_steps:
        sys.exit(
            f"dagster-rl: the range {text} goes past the last step of {exp.name}, {step_key(exp.n_steps - 1)} "
            f"(n_steps: {exp.n_steps} in its experiment file): give a range within 0000...{step_key(exp.n_steps - 1)}, or raise n_steps"
        )
    if first > last:
        sys.exit(f"dagster-rl: the range {text} starts after it ends: give it as {step_key(last)}...{step_key(first)}")
    return first, last


def _was_interrupted(instance, run_id: str) -> bool:
    """Whether the run ended because it was interrupted (Ctrl-C, SIGTERM): canceled by it here, or
    failed with the interruption, as its log records."""
    from dagster import DagsterEventType

    from assets.console import interrupted
    from assets.workspace_run import interrupted_here

    if interrupted_here(run_id):  # Ctrl-C here canceled it
        return True
    records = instance.get_records_for_run(run_id, of_type=DagsterEventType.RUN_FAILURE, limit=1).records
    error = getattr(records[0].event_log_entry.dagster_event.event_specific_data, "error", None) if records else None
    return interrupted(error)


def _execute(instance, exp: Experiment, first: int, last: int, log_level: str):
    """One run of `<exp>_train` over first...last, a run of the workspace's code location (the UI's
    job page, timeline and Re-execute see it), executed in this process as `execute_job` executes
    one: each step in a child process of the code location's executor (`assets.workspace_run`)."""
    import warnings

    from assets.workspace_run import execute_here

    with warnings.catch_warnings():  # Dagster's notices about its own API, not about this run
        warnings.simplefilter("ignore", FutureWarning)
        config = {"loggers": {"console": {"config": {"log_level": log_level}}}}
        # a DagsterRLError (the workspace names no code location of this repository, the location refuses
        # to load): nothing ran; `main` prints it as one message, its traceback too with --debug
        return execute_here(instance, f"{exp.name}_train", config, range_tags(first, last))
