"""Judging as each trajectory lands (`dagster_rl.core.steps.judge_as_they_land`), which every loop
shares, and the clock that says how much of the judging hid behind generation. In memory, no model."""

import threading
from types import SimpleNamespace

import pytest

from dagster_rl.base.retries import Limits
from dagster_rl.core.records import TrialFailed
from dagster_rl.core.steps import JudgeClock, Judged, judge_as_they_land
from dagster_rl.judges.rubric_judge import RubricJudge


def test_the_clock_counts_judging_wall_time_once_and_the_part_inside_generation():
    clock = JudgeClock(judging=[(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)], generating=[(0.0, 2.5)])
    assert clock.judge_s == pytest.approx(3.0)  # 0-2 (two judgements at once count once) and 3-4
    assert clock.hidden_s == pytest.approx(2.0)
    assert JudgeClock().judge_s == JudgeClock().hidden_s == 0.0


def test_a_trajectory_is_judged_while_the_others_generate_and_a_failed_judgement_is_a_failed_trial():
    exp = SimpleNamespace(seed=0, faults=SimpleNamespace(judge_flake_rate=0.0))
    judging_began, calls = threading.Event(), []

    def score(_exp, trajectory):
        calls.append(trajectory.trial_id)
        judging_began.set()
        if trajectory.trial_id == "t2":
            raise ValueError("the judge broke")
        return SimpleNamespace(trial_id=trajectory.trial_id, reward=1.0)

    judge = RubricJudge(score, Limits(max_retries=0, max_concurrency=2))
    trajectories = [SimpleNamespace(trial_id=f"t{i}") for i in range(4)]
    seen_while_generating = []

    def generate(on_done):
        for i, t in enumerate(trajectories):
            on_done(t)
            if i == 0:  # the first judgement begins before the next trajectory lands
                seen_while_generating.append(judging_began.wait(10))
        return trajectories

    judged = Judged()
    assert judge_as_they_land(exp, judge, judged, generate) == trajectories
    assert seen_while_generating == [True]
    outcomes = {o.trial_id: o for o in judged.judge(exp, trajectories, judge)}  # made while generating: nothing judged again
    assert sorted(calls) == ["t0", "t1", "t2", "t3"]
    assert isinstance(outcomes["t2"], TrialFailed) and "the judge broke" in outcomes["t2"].error
    assert [outcomes[t].reward for t in ("t0", "t1", "t3")] == [1.0, 1.0, 1.0]
    assert 0.0 < judged.clock.hidden_s <= judged.clock.judge_s
