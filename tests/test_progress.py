"""The progress of a running step, as the run's log shows it (finding 7 of issue 20: a judge that
never answered showed as "generating")."""

import re
import time

from dagster_rl.core.progress import Progress


def test_a_step_whose_trials_are_all_generated_says_judging_while_judgements_are_out():
    progress = Progress()
    progress.begin(3, 4)
    progress.generated(3, 2)
    assert "step 0003: 2/4 trials generated, 0/4 judged; generating, " in progress.lines()[0]
    progress.generated(3, 2)
    progress.judged(3, 1)
    assert "step 0003: 4/4 trials generated, 1/4 judged; judging, " in progress.lines()[0]
    progress.phase(3, "training")
    assert "; training, " in progress.lines()[0]
    progress.end(3)
    assert progress.lines() == []


def test_a_long_phase_is_listed_with_its_time_until_it_ends():
    progress = Progress()
    with progress.doing("demo/sft: the warm-up"):
        progress.begin(0, 8)
        lines = progress.lines()
        assert lines[0].startswith("step 0000: 0/8 trials generated") and re.fullmatch(
            r"demo/sft: the warm-up, \d+ s so far", lines[1]
        )
    assert len(progress.lines()) == 1 and progress.lines()[0].startswith("step 0000: ")


def test_the_driver_reports_a_long_phase_while_it_runs():
    """`reporting` logs the running phases every interval: a warm-up that takes longer than the
    interval shows on the console before it ends (tiny_gsm8k's warm-up was silent for 1 min 49 s)."""
    from assets.progress_reporting import reporting

    progress, said = Progress(), []
    with reporting(progress, said.append, every_s=0.05), progress.doing("tiny_gsm8k/sft: the warm-up"):
        deadline = time.monotonic() + 10
        while not said and time.monotonic() < deadline:
            time.sleep(0.01)
    assert said and said[0].startswith("tiny_gsm8k/sft: the warm-up, ")
    said.clear()
    with reporting(progress, said.append, every_s=0.05, idle="demo: steps 0000...0007"):  # between phases
        while not said and time.monotonic() < deadline + 10:
            time.sleep(0.01)
    assert re.fullmatch(r"demo: steps 0000\.\.\.0007, \d+ s so far", said[0]), said


def test_a_step_time_is_the_time_the_loop_took_not_the_time_dagster_took_to_record_it():
    """The terminal's `0.41 s` of a step: what the loop took to produce it. The driver's yields
    (Dagster recording materializations and checks, about 0.4 s a step on SQLite) are not in it:
    a cache hit and a miss showed the same 0.5 s before."""
    from assets.progress_reporting import timed

    clock = [0.0]

    def loop():
        clock[0] += 2.0  # step 0000 computes for 2 s
        yield "0000"
        clock[0] += 0.005  # step 0001 is a cache hit
        yield "0001"

    seen = []
    for item, seconds in timed(loop(), clock=lambda: clock[0]):
        seen.append((item, seconds))
        clock[0] += 0.5  # Dagster records what the driver yielded
    assert [i for i, _ in seen] == ["0000", "0001"] and [round(s, 6) for _, s in seen] == [2.0, 0.005]
