"""The code location's console logger: what a person at a terminal reads while a run goes.

Dagster's default console logger prints every event of a run at DEBUG (each step start, output,
materialization, check). This one prints, one short line each:
- the run's start (its id, job and range of steps) and its end (succeeded, failed, canceled);
- the lines the driver marks for the console (a line per step, progress while a step or a long
  phase runs, which run waits for which);
- a failed step's error: its type and message, which say what was wrong and what to do, e.g.
  `MissingPredecessorError: ... Run step 0002 first, e.g. the range 0002...0004.`;
- an interrupted run (Ctrl-C, SIGTERM): one line, `run 1a2b3c4d (demo_train, steps 0000...0007)
  interrupted; re-run the same range to resume`, and not the interruption's errors;
- every other warning and error.
It changes only what the terminal shows: the run's full event log, tracebacks included, is in the
instance, where the UI's run page shows it. Set `loggers: {console: {config: {log_level: DEBUG}}}`
in a run's config to see everything on the terminal too.
"""

import logging
import sys
from typing import NoReturn

from dagster import DagsterEventType, Field, logger

from assets.run_tags import RESUME, run_range
from assets.workspace_run import interrupted_here

CONSOLE = {"dagster_rl_console": True}  # `extra` of a log call whose line belongs on the console
_LIFECYCLE = (
    DagsterEventType.RUN_START,
    DagsterEventType.RUN_SUCCESS,
    DagsterEventType.RUN_FAILURE,
    DagsterEventType.RUN_CANCELED,
    DagsterEventType.STEP_FAILURE,
)
# Dagster's wrappers around the error user code raised: the error to show is their cause
_WRAPPERS = {"DagsterExecutionStepExecutionError", "DagsterUserCodeExecutionError", "DagsterResourceFunctionError"}


def user_error(error) -> str:
    """`Type: message` of the error user code raised, from a Dagster `SerializableErrorInfo`
    (Dagster's wrappers skipped: the first error that is not one)."""
    while error.cls_name in _WRAPPERS and error.cause is not None:
        error = error.cause
    if error.cls_name == "ChildProcessCrashException":  # its message is only its class's path
        return f"{error.cls_name}: the step's process died (killed, or out of memory); re-run the same range to resume"
    message = error.message.split("\nStack Trace:", 1)[0].strip()  # the stacks Dagster puts in a message stay in the run's log
    head, sep, rest = message.partition(": ")
    if sep and head.endswith(error.cls_name):  # `module.Class: message` as traceback prints it
        message = rest
    return f"{error.cls_name}: " + "\n".join(line.rstrip() for line in message.splitlines())


INTERRUPTED = frozenset({"DagsterExecutionInterruptedError", "KeyboardInterrupt"})


def interrupted(error) -> bool:
    """Whether a Dagster `SerializableErrorInfo` is an interruption (Ctrl-C, SIGTERM), in its chain."""
    while error is not None:
        if error.cls_name in INTERRUPTED:
            return True
        error = error.cause or getattr(error, "context", None)
    return False


class _Stderr(logging.StreamHandler):
    """A handler that writes to `sys.stderr` as it is when a record comes (as logging's last resort does)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


class _NotAnInterruption(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return type(error).__name__ not in INTERRUPTED


def quiet_interrupted_connection_closes() -> None:
    """SQLAlchemy logs an error, with its traceback, when an exception interrupts its closing of a
    connection: Dagster raises its interruption (Ctrl-C, SIGTERM) wherever the process is, and the
    SQLite instance's pool may be closing one then. The run's one line says it was interrupted; any
    other error of the pool still reaches the terminal."""
    pool = logging.getLogger("sqlalchemy.pool")
    if not any(isinstance(f, _NotAnInterruption) for h in pool.handlers for f in h.filters):
        handler = _Stderr()
        handler.setLevel(logging.WARNING)
        handler.addFilter(_NotAnInterruption())
        pool.addHandler(handler)
        pool.propagate = False


def _interrupted_event(event, run_id: str | None) -> bool:
    """A step or run that failed with the interruption, or the end of a run an interrupt canceled here."""
    if event.event_type == DagsterEventType.RUN_CANCELED:
        return interrupted_here(run_id)
    data = getattr(event, "event_specific_data", None)
    return event.event_type in (DagsterEventType.STEP_FAILURE, DagsterEventType.RUN_FAILURE) and interrupted(
        getattr(data, "error", None)
    )


def event_line(event, run_id: str | None, tags: dict) -> str | None:
    """The console's line for a run's start or end or a step's failure (None: no line of its own)."""
    kind, run = event.event_type, f"run {run_id[:8]}" if run_id else "the run"
    steps, job = run_range(tags), "" if event.job_name.startswith("__") else event.job_name  # not __ASSET_JOB
    what = ", ".join(filter(None, [job, f"steps {steps}" if steps else ""]))
    what = f" ({what})" if what else ""
    if kind == DagsterEventType.RUN_START:
        return f"{run} started{what}"
    if kind == DagsterEventType.RUN_SUCCESS:
        return f"{run} succeeded{what}"
    if kind == DagsterEventType.RUN_CANCELED:  # by Ctrl-C at this terminal (`workspace_run`), or from the UI
        return f"{run}{what} {RESUME}" if interrupted_here(run_id) else f"{run} canceled{what}"
    data = event.event_specific_data
    error = getattr(data, "error", None)
    if kind == DagsterEventType.STEP_FAILURE:
        return user_error(error) if error is not None else None
    if kind == DagsterEventType.RUN_FAILURE:
        if interrupted(error):  # Ctrl-C or SIGTERM: nothing failed; its steps so far are stored
            return f"{run}{what} {RESUME}"
        reason = getattr(data, "failure_reason", None)
        said = f": {user_error(error)}\n" if error is not None and getattr(reason, "value", None) != "STEP_FAILURE" else ". "
        return f"{run} failed{what}{said}Its full log, with the traceback, is on the run's page in the UI (make ui, Runs)."
    return None


# Dagster's word, in the run's process, that its steps are being interrupted: what follows (steps that end
# without an event, the interruption's errors) is the interruption, which the run's failure line says
_INTERRUPTING = "Multiprocess executor: received termination signal"


class _ConsoleLines(logging.Filter):
    def __init__(self, level: int):
        super().__init__()
        self.level = level
        self.interrupting = False

    def filter(self, record: logging.LogRecord) -> bool:
        meta = getattr(record, "dagster_meta", None) or {}
        event = meta.get("dagster_event")
        if self.level > logging.DEBUG:
            if event is not None and _interrupted_event(event, meta.get("run_id")):
                return event.event_type in (
                    DagsterEventType.RUN_FAILURE,
                    DagsterEventType.RUN_CANCELED,
                )  # one line says it: the run's end
            if event is not None and event.event_type == DagsterEventType.RUN_CANCELED:
                return True  # the run's end (canceled from the UI)
            if event is not None and str(event.message or "").startswith(_INTERRUPTING):
                self.interrupting = True
            if self.interrupting:
                return False
        if self.level <= logging.DEBUG or record.levelno >= max(self.level, logging.WARNING):
            return record.levelno >= self.level
        if self.level > logging.INFO:
            return False
        return bool(getattr(record, "dagster_rl_console", False)) or (event is not None and event.event_type in _LIFECYCLE)


class _Short(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        meta = getattr(record, "dagster_meta", None) or {}
        event = meta.get("dagster_event")
        message = (
            (event_line(event, meta.get("run_id"), dict(meta.get("job_tags") or {})) if event is not None else None)
            or meta.get("orig_message")
            or record.getMessage()
        )
        quiet = event is not None and _interrupted_event(event, meta.get("run_id"))
        level = "" if record.levelno < logging.WARNING or quiet else f"{record.levelname} "
        where = f"{meta['step_key']}: " if level and meta.get("step_key") else ""
        return f"{self.formatTime(record, '%H:%M:%S')} {level}{where}{message}"


def refuse_to_load(error: BaseException) -> NoReturn:
    """Fail the code location's import with `error`, a dagster-rl error whose message says what to do.
    Dagster's code server shows it in the UI as the location's load error (with its stack); a command
    that imports the location in its own process (`dagster asset materialize -m assets.definitions`)
    ends with it as one line on the terminal, `dagster_rl code location: <message>`, not a traceback."""
    previous = sys.excepthook

    def one_line(kind, value, tb) -> None:
        if value is error:
            print(f"dagster_rl code location: {value}", file=sys.stderr)
        else:
            previous(kind, value, tb)

    sys.excepthook = one_line
    raise error


@logger(
    config_schema={"log_level": Field(str, is_required=False, default_value="INFO")},
    description="One line per training step, progress, a failed step's error, warnings; the full log stays in the run.",
)
def concise_console(init_context) -> logging.Logger:
    level = logging.getLevelName(init_context.logger_config["log_level"].upper())
    log = logging.Logger("dagster_rl_console", level=logging.DEBUG)  # the filter decides, by level and kind
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Short())
    handler.addFilter(_ConsoleLines(level if isinstance(level, int) else logging.INFO))
    log.addHandler(handler)
    return log
