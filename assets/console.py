"""The code location's console logger: what a person at a terminal reads while a run goes.

Dagster's default console logger prints every event of a run at DEBUG (each step start, output,
materialization, check). This one prints the lines the driver marks for the console (a line per
step, progress while a step runs, which run waits for which) and every warning and error, one short
line each. It changes only what the terminal shows: the run's full event log is in the instance,
where the UI shows it. Set `loggers: {console: {config: {log_level: DEBUG}}}` in a run's config to
see everything on the terminal too.
"""

import logging
import sys

from dagster import Field, logger

CONSOLE = {"dagster_rl_console": True}  # `extra` of a log call whose line belongs on the console


class _ConsoleLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or bool(getattr(record, "dagster_rl_console", False))


class _Short(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        meta = getattr(record, "dagster_meta", None) or {}
        message = meta.get("orig_message") or record.getMessage()
        level = "" if record.levelno < logging.WARNING else f"{record.levelname} "
        where = f"{meta['step_key']}: " if level and meta.get("step_key") else ""
        return f"{self.formatTime(record, '%H:%M:%S')} {level}{where}{message}"


@logger(
    config_schema={"log_level": Field(str, is_required=False, default_value="INFO")},
    description="One line per training step, progress, warnings and errors; the full log stays in the run.",
)
def concise_console(init_context) -> logging.Logger:
    level = init_context.logger_config["log_level"].upper()
    log = logging.Logger("dagster_rl_console", level=logging.getLevelName(level))
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Short())
    if logging.getLevelName(level) > logging.DEBUG:
        handler.addFilter(_ConsoleLines())
    log.addHandler(handler)
    return log
