"""How far the running steps are: trials generated and judged of planned, for the run's log.

A loop reports into the `Progress` of its `Backends` as trials land; the driver logs `lines()`
while a step runs (at least every 30 s), so a stalled rollout server or judge shows as a stall
(the same counts, a growing time), not as silence. A step whose trials are all generated while
judgements are still out says `judging` (a task may judge each trial as it lands, in the generating
phase): a judge that never answers shows as one. Thread-safe: trials land in worker threads.
"""

import threading
import time
from dataclasses import dataclass, field

from dagster_rl.experiment import step_key


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

    def lines(self) -> list[str]:
        """One line per step in progress, e.g. `step 0003: 12/24 trials generated, 10/24 judged; generating, 35 s into the step`."""
        now = time.monotonic()
        with self._lock:
            return [
                f"step {step_key(k)}: {s.generated}/{s.planned} trials generated, {s.judged}/{s.planned} judged; "
                f"{_phase(s)}, {now - s.started:.0f} s into the step"
                for k, s in sorted(self._steps.items())
            ]


def _phase(s: _Step) -> str:
    """What the step waits for: `generating` turns `judging` once every trial is generated."""
    return "judging" if s.phase == "generating" and s.generated >= s.planned and s.judged < s.planned else s.phase
