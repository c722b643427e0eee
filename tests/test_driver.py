"""The driver multi-asset on a real SQLite Dagster instance: order, learning, caching, faults."""

import json

import pytest
from dagster import AssetKey, FloatMetadataValue, IntMetadataValue

from dagster_rl.base import counters
from dagster_rl.core.experiment import step_key
from dagster_rl.core.records import STATS, Rollouts
from dagster_rl.tasks.secret_search.loop import _rollouts_key, ensure_worlds, initial_weights
from dagster_rl.tasks.secret_search.records import Trajectory
from resources import JudgeEnvironment, RolloutEnvironment
from tests.harness import CHAIN, failure_message
from tests.settings import demo_settings

STEPS = [step_key(i) for i in range(8)]


def step_rollouts_key(exp, store, step: int, behavior=None) -> str:
    """The key under which a clean computation stores the rollouts of `step` (from `behavior`, default the initial weights)."""
    return _rollouts_key(exp, step, behavior or initial_weights(exp, store), ensure_worlds(exp, store))


def final_weights_bytes(lab, name: str, step: str) -> bytes:
    key = lab.latest(name, "weights", step)["artifact_key"]
    return lab.store().get("weights", key, "data.json")


def test_eight_steps_in_order_in_one_run_and_reward_rises(uninterrupted):
    lab, result = uninterrupted, uninterrupted.result
    assert result.success
    assert len(lab.instance.get_run_records()) == 1
    for asset in CHAIN:
        events = lab.events("demo", asset)
        assert [e.asset_materialization.partition for e in events] == STEPS
        assert {e.run_id for e in events} == {result.run_id}
    ids = {a: [e.storage_id for e in lab.events("demo", a)] for a in CHAIN}
    for k in range(8):  # each step's three materializations land before the next step's
        assert ids["rollouts"][k] < ids["rewards"][k] < ids["weights"][k]
        if k < 7:
            assert ids["weights"][k] < ids["rollouts"][k + 1]

    rewards = [lab.latest("demo", "weights", s)["mean_reward"] for s in STEPS]
    # measured: 1.23, 1.57 over the first two steps; 2.37, 2.57 over the last two
    assert (rewards[6] + rewards[7]) / 2 > (rewards[0] + rewards[1]) / 2 + 0.5, rewards
    last = lab.latest("demo", "weights", "0007")
    assert last["weights_version"] == 8
    assert last["n_trials"] == last["n_trials_planned"] == 24
    assert last["cache"] == "miss" and last["attempt"] == 0
    assert lab.counted["trials_executed"] == 8 * 24 and lab.counted["judge_calls"] == 8 * 24


def test_every_step_records_the_policy_that_generated_its_rollouts(uninterrupted):
    lab = uninterrupted
    assert lab.latest("demo", "rollouts", "0000")["behavior_policy"]["partition"] == "initial"
    for k in range(1, 8):
        behavior = lab.latest("demo", "rollouts", STEPS[k])["behavior_policy"]
        prev = lab.latest("demo", "weights", STEPS[k - 1])
        assert behavior["partition"] == STEPS[k - 1]
        assert behavior["content_hash"] == prev["content_hash"]
        assert behavior["version"] == prev["weights_version"]
    started = {lab.latest("demo", a, s)["started_at"] for a in CHAIN for s in STEPS}
    assert len(started) == 1


def test_numeric_metadata_draws_as_plots(uninterrupted):
    md = uninterrupted.events("demo", "weights")[-1].asset_materialization.metadata
    for name in ("mean_reward", "mean_turns", "success_rate", "step_s", "grad_norm"):
        assert isinstance(md[name], FloatMetadataValue), name
    for name in ("n_trials", "n_trials_planned", "weights_version", "attempt", "trials_executed", "judge_calls"):
        assert isinstance(md[name], IntMetadataValue), name


def test_second_run_of_a_finished_range_recomputes_nothing(uninterrupted):
    lab = uninterrupted
    before = counters.snapshot()
    assert lab.run("demo", "0000", "0007").success
    assert counters.read("trials_executed") == before.get("trials_executed", 0)
    assert counters.read("judge_calls") == before.get("judge_calls", 0)
    assert counters.read("train_calls") == before.get("train_calls", 0)
    for asset in CHAIN:
        for step in STEPS:
            first, second = lab.metadata("demo", asset)[step][-2:]
            assert second["cache"] == "hit"
            assert second["trials_executed"] == 0 and second["judge_calls"] == 0
            assert second["content_hash"] == first["content_hash"]


def test_flaky_trials_and_judge_are_retried_and_change_nothing(lab, uninterrupted):
    flaky = lab("flaky", demo_settings(faults={"flaky_trial_rate": 0.25, "judge_flake_rate": 0.3}))
    before = counters.snapshot()
    assert flaky.run("demo", "0000", "0007").success
    executed = counters.read("trials_executed") - before.get("trials_executed", 0)
    judged = counters.read("judge_calls") - before.get("judge_calls", 0)
    # faults fire on first attempts only: ~25% of trials and ~30% of judgements ran twice
    assert 8 * 24 * 1.1 < executed < 8 * 24 * 1.5, executed
    assert 8 * 24 * 1.1 < judged < 8 * 24 * 1.6, judged
    for step in STEPS:
        assert flaky.latest("demo", "weights", step)["n_trials"] == 24
    assert final_weights_bytes(flaky, "demo", "0007") == final_weights_bytes(uninterrupted, "demo", "0007")


def test_a_trial_that_fails_after_its_retries_is_skipped(lab):
    no_retries = {
        "rollout": RolloutEnvironment(max_retries=0),
        "judge": lambda store: JudgeEnvironment(artifact_store=store, max_retries=0),
    }
    settings = demo_settings(
        faults={"flaky_trial_rate": 0.25, "judge_flake_rate": 0.2}, min_trials_per_step=6, checks={"min_usable_fraction": 0.2}
    )
    flaky = lab("skips", settings, **no_retries)
    assert flaky.run("demo", "0000", "0001").success
    md = flaky.latest("demo", "weights", "0000")
    assert 0 < md["n_trials"] < 24 and md["skipped_trials"] == 24 - md["n_trials"]
    assert md["n_trials_planned"] == 24


def test_too_few_usable_trials_fails_the_step_and_caches_no_result(lab):
    no_retries = {"rollout": RolloutEnvironment(max_retries=0)}
    settings = demo_settings(faults={"flaky_trial_rate": 0.6}, min_trials_per_step=20)
    bad = lab("few", settings, **no_retries)
    result = bad.run("demo", "0000", "0003", raise_on_error=False)
    assert not result.success
    message = str(failure_message(result))
    assert "step 0000 of demo has" in message and "min_trials_per_step=20" in message
    assert "a re-run attempts only the failed ones" in message
    assert bad.metadata("demo", "weights") == {}
    store, exp = bad.store(), bad.experiments["demo"]
    clean = step_rollouts_key(exp, store, 0)
    assert not store.exists("rollouts", clean), "a step with failed trials is never stored under the clean key"
    kept = store.get_model("rollouts", store.partial("rollouts", clean), Rollouts[Trajectory])
    assert 0 < len(kept.trajectories) < 20 and len(kept.trajectories) + len(kept.skipped) == 24


def test_crash_after_step_3_resumes_at_step_4_with_identical_weights(lab, uninterrupted):
    crashy = lab("crash", demo_settings(faults={"crash_driver_at_step": 3}))
    first = crashy.run("demo", "0000", "0007", raise_on_error=False)
    assert not first.success
    assert "driver crash after step 0003" in failure_message(first)
    assert "dagster/retry_on_asset_or_op_failure" not in crashy.instance.get_run_by_id(first.run_id).tags
    assert sorted(crashy.metadata("demo", "weights")) == STEPS[:4]

    before = counters.snapshot()
    assert crashy.run("demo", "0000", "0007").success
    for k, step in enumerate(STEPS):
        md = crashy.latest("demo", "weights", step)
        assert md["cache"] == ("hit" if k <= 3 else "miss"), step
        assert md["trials_executed"] == (0 if k <= 3 else 24), step
    assert counters.read("trials_executed") - before.get("trials_executed", 0) == 4 * 24
    assert final_weights_bytes(crashy, "demo", "0007") == final_weights_bytes(uninterrupted, "demo", "0007")


def test_a_step_whose_predecessor_is_missing_fails_naming_the_step_to_run(lab):
    fresh = lab("gap", demo_settings())
    result = fresh.run("demo", "0004", "0005", raise_on_error=False)
    assert not result.success
    message = failure_message(result)
    assert "Run step 0000 first" in message
    # retrying the same run cannot help: the driver tells the daemon not to
    assert fresh.instance.get_run_by_id(result.run_id).tags["dagster/retry_on_asset_or_op_failure"] == "false"
    assert fresh.run("demo", "0000", "0001").success
    message = failure_message(fresh.run("demo", "0004", "0005", raise_on_error=False))
    assert "steps 0002, 0003 are missing" in message and "Run step 0002 first" in message
    assert fresh.run("demo", "0002", "0004").success  # a range may start where the last one ended
    assert fresh.latest("demo", "rollouts", "0002")["behavior_policy"]["partition"] == "0001"


def test_a_failing_blocking_check_stops_the_range_at_that_step(lab):
    settings = demo_settings(faults={"flaky_trial_rate": 0.5}, min_trials_per_step=1, checks={"min_usable_fraction": 0.75})
    strict = lab("checks", settings, rollout=RolloutEnvironment(max_retries=0))
    result = strict.run("demo", "0000", "0003", raise_on_error=False)
    assert not result.success
    message = failure_message(result)
    assert "step 0000 of demo: blocking check(s) failed, the range stops here: enough_usable_trials:" in message
    assert sorted(strict.metadata("demo", "weights")) == ["0000"]  # materialized, checked, nothing after it
    assert strict.latest("demo", "weights", "0000")["checks_failed"] == "enough_usable_trials"
    evaluations = {
        n: strict.check_evaluations("demo", n) for n in ("weights_finite", "rewards_in_bounds", "enough_usable_trials")
    }
    assert {n: len(e) for n, e in evaluations.items()} == dict.fromkeys(evaluations, 1)
    evaluations = {n: e[0] for n, e in evaluations.items()}
    assert evaluations["weights_finite"].passed and evaluations["rewards_in_bounds"].passed
    assert not evaluations["enough_usable_trials"].passed and evaluations["enough_usable_trials"].partition == "0000"
    # each check's number under a name of its own: a fraction is never beside counts under one name
    numbers = {n: {k: v.value for k, v in e.metadata.items() if k != "message"} for n, e in evaluations.items()}
    usable = pytest.approx(strict.latest("demo", "weights", "0000")["n_trials"] / 24, rel=1e-7)
    assert numbers == {
        "weights_finite": {"bad_weights": 0},
        "rewards_in_bounds": {"rewards_out_of_bounds": 0},
        "enough_usable_trials": {"usable_fraction": usable},
    }
    # as the UI's Partitions tab shows them: the steps the stopped run never reached read "execution failed"
    stopped = ["0001", "0002", "0003"]
    assert strict.check_partition_statuses("demo", "enough_usable_trials") == {"FAILED": ["0000"], "EXECUTION_FAILED": stopped}
    assert strict.check_partition_statuses("demo", "weights_finite") == {"SUCCEEDED": ["0000"], "EXECUTION_FAILED": stopped}
    # the next step refuses to start from weights that failed a blocking check
    later = failure_message(strict.run("demo", "0001", "0001", raise_on_error=False))
    assert "failed blocking check(s) enough_usable_trials" in later


def test_checks_pass_on_every_step_of_a_clean_run(uninterrupted):
    for name in ("weights_finite", "rewards_in_bounds", "enough_usable_trials"):
        evaluations = uninterrupted.check_evaluations("demo", name)
        assert all(e.passed for e in evaluations), name
        assert set(STEPS) <= {e.partition for e in evaluations}, name
        # the UI's Partitions tab of the check: each evaluation targets its partition's materialization,
        # so every step reads "succeeded" (an evaluation without a target read "Missing" on every step)
        assert uninterrupted.check_partition_statuses("demo", name) == {"SUCCEEDED": STEPS}, name
        assert uninterrupted.latest("demo", "weights", STEPS[-1])["checks_failed"] == "none"  # never a blank row
        targets: dict[str, int] = {}
        for e in evaluations:  # newest first: each partition's latest evaluation targets its latest materialization
            targets.setdefault(e.partition, e.target_materialization_data.storage_id)
        latest = {s: uninterrupted.events_by_partition("demo", "weights")[s][-1].storage_id for s in STEPS}
        assert {s: targets[s] for s in STEPS} == latest, name


def test_a_rubric_only_fork_reuses_step_0_rollouts_and_regenerates_after(lab, uninterrupted):
    fork = {"name": "demo_tidy", "fork_of": "demo", "rubric": {"name": "tidy", "tidiness": 1.0}}
    shared_store = uninterrupted.defs.resources["artifact_store"]
    forked = lab("fork", demo_settings(), fork, artifact_store=shared_store)
    before = counters.snapshot()
    assert forked.run("demo_tidy", "0000", "0002").success
    zero = forked.latest("demo_tidy", "rollouts", "0000")
    assert zero["cache"] == "hit" and zero["trials_executed"] == 0
    assert zero["content_hash"] == uninterrupted.latest("demo", "rollouts", "0000")["content_hash"]
    assert forked.latest("demo_tidy", "rewards", "0000")["cache"] == "miss"  # re-judged with the new rubric
    assert forked.latest("demo_tidy", "rewards", "0000")["judge_calls"] == 24
    assert forked.latest("demo_tidy", "weights", "0000")["cache"] == "miss"
    for step in ("0001", "0002"):  # new weights, so new rollouts
        assert forked.latest("demo_tidy", "rollouts", step)["cache"] == "miss"
        assert forked.latest("demo_tidy", "rollouts", step)["trials_executed"] == 24
    assert counters.read("trials_executed") - before.get("trials_executed", 0) == 2 * 24
    assert forked.latest("demo_tidy", "rewards", "0000")["rubric"]["tidiness"] == 1.0
    fork_of = {
        e: forked.defs.resolve_assets_def(AssetKey([e, "weights"])).metadata_by_key[AssetKey([e, "weights"])]["fork_of"]
        for e in ("demo", "demo_tidy")
    }
    assert fork_of == {"demo": "none", "demo_tidy": "demo"}  # what the asset's page shows: never a blank row


def test_a_fork_reuses_its_parents_steps_and_resumes_from_them_a_same_settings_copy_does_not(lab, uninterrupted):
    """Trained weights record their experiment's cache family (the root of its forks), which is in
    their key: a fork that changes nothing a step computes reuses every step of its parent, and a
    later range of the fork starts from weights its parent computed; an experiment with the same
    settings under another name, no fork, trains its own (it shares what precedes any weights)."""
    shared_store = uninterrupted.defs.resources["artifact_store"]
    fork = {"name": "demo_long", "fork_of": "demo", "n_steps": 32}  # more steps: nothing a step computes changes
    family = lab("family", demo_settings(), fork, demo_settings(name="demo_copy"), artifact_store=shared_store)
    before = counters.snapshot()
    assert family.run("demo_long", "0000", "0002").success
    assert family.run("demo_long", "0003", "0003").success  # starts from its 0002: weights its parent trained
    for step in STEPS[:4]:
        for asset in CHAIN:
            md = family.latest("demo_long", asset, step)
            assert md["cache"] == "hit" and md["content_hash"] == uninterrupted.latest("demo", asset, step)["content_hash"], (
                step,
                asset,
            )
    assert counters.read("trials_executed") - before.get("trials_executed", 0) == 0
    stats = json.loads(family.store().get("weights", family.latest("demo_long", "weights", "0003")["artifact_key"], STATS))
    assert (stats["step"], stats["experiment"]) == (3, "demo")

    assert family.run("demo_copy", "0000", "0000").success
    copy = {a: family.latest("demo_copy", a, "0000") for a in CHAIN}
    assert copy["rollouts"]["cache"] == copy["rewards"]["cache"] == "hit"
    assert copy["weights"]["cache"] == "miss"
    assert copy["weights"]["content_hash"] != uninterrupted.latest("demo", "weights", "0000")["content_hash"]
