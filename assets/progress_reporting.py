"""The driver's progress on the console while steps and phases run: a thread that logs what runs,
and how long the loop took to produce each step."""

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from dagster_rl.core.progress import Progress

FIRST_PROGRESS_S = 10.0  # the first progress line comes this soon (or after `every_s`, when sooner)


@contextmanager
def reporting(progress: Progress, log: Callable[[str], None], every_s: float, idle: str = "") -> Iterator[None]:
    """Log the progress of the running steps and phases in a thread, while inside: first after
    `min(FIRST_PROGRESS_S, every_s)` (a run's step process takes some seconds to start: the console
    is never silent for `every_s` from the run's start), then every `every_s` seconds. Between
    steps and phases, `idle` says what runs (e.g. `demo: steps 0000...0007`)."""
    stop, began = threading.Event(), time.monotonic()

    def tick() -> None:
        wait = min(FIRST_PROGRESS_S, every_s)
        while not stop.wait(wait):
            for line in progress.lines() or ([f"{idle}, {time.monotonic() - began:.0f} s so far"] if idle else []):
                log(line)
            wait = every_s

    thread = threading.Thread(target=tick, name="dagster-rl-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def timed(items: Iterator, clock: Callable[[], float] = time.monotonic) -> Iterator[tuple]:
    """(item, seconds the loop took to produce it): the time the driver waited for each step, not
    the time Dagster took to record what the driver yielded (materializations, checks)."""
    while True:
        began = clock()
        try:
            item = next(items)
        except StopIteration:
            return
        yield item, clock() - began
