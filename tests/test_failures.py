"""A failed trial is never cached as a result; a re-run attempts only the trials that failed.

The runs here use fault injection (`faults.flaky_trial_rate`, `faults.judge_flake_rate`: seeded,
first attempt of a trial or judgement only) with no retries, so some trials fail for good in that
run; the same experiment re-run with retries (a healthy environment) recovers them. Faults are not
in any key, so the healed steps must end with the bytes of a run that never failed.
"""

from dagster_rl.base import counters
from dagster_rl.core.records import Rollouts
from dagster_rl.tasks.secret_search.records import Trajectory
from resources import JudgeEnvironment, RolloutEnvironment
from tests.settings import demo_settings, tiny_grpo
from tests.test_driver import final_weights_bytes, step_rollouts_key

STEPS = ["0000", "0001", "0002", "0003"]
NO_RETRIES = {
    "rollout": RolloutEnvironment(max_retries=0),
    "judge": lambda store: JudgeEnvironment(artifact_store=store, max_retries=0),
}


def test_a_step_with_failed_trials_is_partial_and_a_healthy_rerun_heals_it_to_the_clean_bytes(
    lab, uninterrupted, monkeypatch, capsys
):
    # seeded: step 0000 loses trials s0-p2-n0 and s0-p5-n1 in generation and s0-p3-n0 in judging
    settings = demo_settings(faults={"flaky_trial_rate": 0.15, "judge_flake_rate": 0.1}, min_trials_per_step=6)
    flaky = lab("heal", settings, **NO_RETRIES)
    assert flaky.run("demo", "0000", "0003").success
    first = {s: flaky.latest("demo", "weights", s) for s in STEPS}
    assert all(0 < first[s]["skipped_trials"] == 24 - first[s]["n_trials"] for s in STEPS), first
    store, exp = flaky.store(), flaky.experiments["demo"]
    clean_key = step_rollouts_key(exp, store, 0)
    assert not store.exists("rollouts", clean_key), "a step with failed trials is never stored under the key of a clean step"
    assert not store.exists("rewards", uninterrupted.latest("demo", "rewards", "0000")["artifact_key"])
    partial = store.get_model("rollouts", store.partial("rollouts", clean_key), Rollouts[Trajectory])
    generation_failed = partial.skipped
    assert generation_failed == ["s0-p2-n0", "s0-p5-n1"] and len(partial.trajectories) == 22
    assert first["0000"]["skipped_trials"] == 3
    assert (
        flaky.latest("demo", "rollouts", "0000")["content_hash"]
        != uninterrupted.latest("demo", "rollouts", "0000")["content_hash"]
    )

    healthy = flaky.reopen()  # retries back: the same faults fire on first attempts only
    before = counters.snapshot()
    assert healthy.run("demo", "0000", "0003").success
    zero = healthy.latest("demo", "weights", "0000")
    # step 0000 ran only its failed trials again (each: a first attempt that fails, a retry that succeeds)
    assert zero["trials_executed"] == 2 * len(generation_failed)
    assert zero["n_trials"] == 24 and zero["skipped_trials"] == 0 and zero["recovered_trials"] == 2
    assert zero["supersedes_reason"] == (
        "trials that failed in an earlier attempt of this step now succeeded (21/24 usable before, 24/24 now)"
    )
    assert zero["supersedes"].startswith(f"run {flaky.events('demo', 'weights')[0].run_id[:8]}: 21/24 trials")
    for step in STEPS[1:]:  # new weights upstream: every later step is computed again, and says why
        md = healthy.latest("demo", "weights", step)
        assert md["n_trials"] == 24 and md["trials_executed"] >= 24 and md["cache"] == "miss"
        assert md["supersedes_reason"] == "an earlier step changed, so this step's inputs did"
    assert counters.read("trials_executed") - before.get("trials_executed", 0) > 3 * 24
    # healed, every step holds exactly what a run that never failed holds: clean keys are stable
    for asset in ("rollouts", "rewards", "weights"):
        for step in STEPS:
            ours, clean = healthy.latest("demo", asset, step), uninterrupted.latest("demo", asset, step)
            assert (ours["artifact_key"], ours["content_hash"]) == (clean["artifact_key"], clean["content_hash"]), (asset, step)
    assert final_weights_bytes(healthy, "demo", "0003") == final_weights_bytes(uninterrupted, "demo", "0003")

    from assets.cli import main

    monkeypatch.setenv("DAGSTER_HOME", str(flaky.home))
    monkeypatch.setenv("DAGSTER_RL_EXPERIMENTS", str(flaky.home / "experiments"))
    main(["--artifacts", store.url, "status", "demo"])
    out = capsys.readouterr().out
    assert f"0000: supersedes the materialization of run {flaky.events('demo', 'weights')[0].run_id[:8]}" in out
    assert "trials that failed in an earlier attempt of this step now succeeded (21/24 usable before, 24/24 now)" in out

    again = healthy.reopen()
    assert again.run("demo", "0000", "0003").success  # healed for good: all hits, nothing superseded
    for step in STEPS:
        md = again.latest("demo", "weights", step)
        assert md["cache"] == "hit" and "supersedes" not in md


def test_a_step_stored_with_too_few_usable_trials_is_no_dead_end(lab, uninterrupted):
    """min_trials_per_step 1, rate 0.5: step 0000 keeps 15 of its 24 trials and fails its blocking
    check (75% usable); every later run with the same faults fails the same way, but a healthy run
    re-attempts the 9 failed trials and goes on."""
    settings = demo_settings(faults={"flaky_trial_rate": 0.5}, min_trials_per_step=1, checks={"min_usable_fraction": 0.75})
    stuck = lab("stuck", settings, rollout=RolloutEnvironment(max_retries=0))
    assert not stuck.run("demo", "0000", "0003", raise_on_error=False).success
    zero = stuck.latest("demo", "weights", "0000")
    assert zero["checks_failed"] == "enough_usable_trials" and zero["n_trials"] == 15
    failed = 24 - zero["n_trials"]
    assert not stuck.run("demo", "0000", "0003", raise_on_error=False).success  # the same faults, the same failures

    healed = stuck.reopen()
    assert healed.run("demo", "0000", "0003").success
    zero = healed.latest("demo", "weights", "0000")
    assert zero["n_trials"] == 24 and zero["checks_failed"] == "none" and zero["trials_executed"] == 2 * failed
    assert final_weights_bytes(healed, "demo", "0003") == final_weights_bytes(uninterrupted, "demo", "0003")


FOUR_BY_FOUR = {"n_steps": 4, "prompts_per_step": 4, "n_samples": 4, "min_trials_per_step": 4}  # 16 trials a step


def test_language_model_steps_store_trial_by_trial_too(lab):
    """The LM loop: generation failures are skipped, never cached; a healthy re-run generates only them."""
    clean = lab("lm_clean", tiny_grpo(**FOUR_BY_FOUR))
    assert clean.run("tiny_grpo", "0000", "0001").success
    flaky = lab(
        "lm_flaky", tiny_grpo(**FOUR_BY_FOUR, faults={"flaky_trial_rate": 0.3}), rollout=RolloutEnvironment(max_retries=0)
    )
    assert flaky.run("tiny_grpo", "0000", "0001").success
    zero = flaky.latest("tiny_grpo", "rollouts", "0000")
    failed = zero["skipped_trials"]
    assert 0 < failed < 16 and zero["n_trials"] == 16 - failed
    assert zero["content_hash"] != clean.latest("tiny_grpo", "rollouts", "0000")["content_hash"]

    healthy = flaky.reopen()
    assert healthy.run("tiny_grpo", "0000", "0001").success
    zero = healthy.latest("tiny_grpo", "rollouts", "0000")
    assert zero["trials_executed"] == failed and zero["recovered_trials"] == failed and zero["n_trials"] == 16
    assert f"now succeeded ({16 - failed}/16 usable before, 16/16 now)" in zero["supersedes_reason"]
    for asset in ("rollouts", "rewards", "weights"):
        for step in ("0000", "0001"):
            ours, ref = healthy.latest("tiny_grpo", asset, step), clean.latest("tiny_grpo", asset, step)
            assert ours["content_hash"] == ref["content_hash"], (asset, step)
