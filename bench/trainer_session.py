"""A launch per step vs a trainer session for the range (`trainer.session: step | range`), through
the Dagster driver with the `torchrun` trainer (1 process, 1 torch thread; generation 1 thread).

Prints, in one run:
- the trainer's overhead per step: the update as the driver waits for it (`train_s`: hand-off,
  torchrun's start and the model's load when there is one, the update, the checkpoint written, read
  back and stored) minus the update itself as the worker timed it (`update_s`, rank 0's Pipes
  report). For the session: its first step (which starts it), the median of the others, and the
  mean over all steps (the start spread over the range);
- the wall time of 8 steps of `tiny_grpo` (no warm-up, its own batch: 8 prompts x 8 samples of 1
  token) both ways;
- pipelined / sequential both ways, at `bench/pipelining.py`'s defaults.

Targets on the 2-core CPU: session overhead per step <= 0.3 s; 8 steps with the session <= 0.35 x
the launches; pipelined / sequential <= 0.75 with the session.

    .venv/bin/python bench/trainer_session.py [--steps 8] [--no-pipelining]
"""

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipelining import arguments, pipelining_table, run


def overhead(steps: list[dict]) -> list[float]:
    return [s["train_s"] - s["update_s"] for s in steps]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--no-pipelining", action="store_true")
    args = parser.parse_args()
    rows = {}
    for session in ("step", "range"):
        with tempfile.TemporaryDirectory() as d:
            rows[session] = run(0, args, Path(d), session)
    print(f"tiny_grpo, {args.steps} steps (8x8 rollouts of 1 token), torchrun trainer (1 process), lag 0")
    print(
        f"{'trainer':<18}{'wall s':>9}{'train s':>10}{'update s':>10}{'overhead/step s: mean':>24}{'first':>8}{'others (median)':>17}"
    )
    for session, label in (("step", "launch per step"), ("range", "session (range)")):
        steps = rows[session]["steps"]
        o = overhead(steps)
        print(
            f"{label:<18}{rows[session]['wall']:>9.2f}{sum(s['train_s'] for s in steps):>10.2f}{sum(s['update_s'] for s in steps):>10.2f}"
            f"{statistics.mean(o):>24.3f}{o[0]:>8.3f}{statistics.median(o[1:]):>17.3f}"
        )
    print(f"8 steps, session / launches: {rows['range']['wall'] / rows['step']['wall']:.2f} (target <= 0.35)")
    print(
        f"session overhead per step after its start: {statistics.median(overhead(rows['range']['steps'])[1:]):.3f} s (target <= 0.3)"
    )
    print("train s, update s: sums over the steps; overhead = train s (driver) - update s (worker), per step")
    if not args.no_pipelining:
        print()
        pipelining_table(arguments([]))


if __name__ == "__main__":
    main()
