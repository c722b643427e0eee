"""The progress of a running step, as the run's log shows it (finding 7 of issue 20: a judge that
never answered showed as "generating")."""

from dagster_rl.progress import Progress


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
