"""How far the running steps are: trials generated and judged of planned, for the run's log; and
the long phases that are not a step's trials (a warm-up, a first model load, a held-out evaluation).

A loop reports into the `Progress` of its `Backends` as trials land; the driver logs `lines()`
while a range runs (at least every 30 s), so a stalled rollout server or judge shows as a stall
(the same counts, a growing time), not as silence. A step whose trials are all generated while
judgements are still out says `judging` (a task may judge each trial as it lands, in the generating
phase): a judge that never answers shows as one. A long phase says what it is and how long it has
run, from `with progress.doing("...")` until its block ends. Thread-safe: trials land in worker
threads, evaluations run in their own.
"""

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from dagster_rl.core.experiment import step_key


@dataclass
class _Step:
    planned: int
    generated: int = 0
    judged: int = 0
    phase: str = "generating"
    started: float = field(default_factory=time.monotonic)


class Progress:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._steps: dict[int, _Step] = {}
        self._doing: dict[int, tuple[str, float]] = {}  # id -> (what, since)

    def begin(self, step: int, planned: int) -> None:
        with self._lock:
            self._steps[step] = _Step(planned)

    def generated(self, step: int, n: int = 1) -> None:
        with self._lock:
            if step in self._steps:
                self._steps[step].generated += n

    def judged(self, step: int, n: int = 1) -> None:
        with self._lock:
            if step in self._steps:
                self._steps[step].judged += n

    def phase(self, step: int, phase: str) -> None:
        with self._lock:
            if step in self._steps:
                self._steps[step].phase = phase

    def end(self, step: int) -> None:
        with self._lock:
            self._steps.pop(step, None)

    @contextmanager
    def doing(self, what: str) -> Iterator[None]:
        """A long phase, e.g. `demo/sft: warming up`, listed by `lines()` until the block ends."""
        with self._lock:
            key = max(self._doing, default=0) + 1
            self._doing[key] = (what, time.monotonic())
        try:
            yield
        finally:
            with self._lock:
                self._doing.pop(key, None)

    def lines(self) -> list[str]:
        """One line per step in progress, e.g. `step 0003: 12/24 trials generated, 10/24 judged; generating, 35 s into the step`,
        then one per long phase, e.g. `demo/sft: warming up, 60 s so far`."""
        now = time.monotonic()
        with self._lock:
            return [
                f"step {step_key(k)}: {s.generated}/{s.planned} trials generated, {s.judged}/{s.planned} judged; "
                f"{_phase(s)}, {now - s.started:.0f} s into the step"
                for k, s in sorted(self._steps.items())
            ] + [f"{what}, {now - since:.0f} s so far" for what, since in self._doing.values()]


def _phase(s: _Step) -> str:
    """What the step waits for: `generating` turns `judging` once every trial is generated."""
    return "judging" if s.phase == "generating" and s.generated >= s.planned and s.judged < s.planned else s.phase
