"""Asynchronous RL at lag 3 through the driver, resumed to the byte: a run stopped with the rollouts
of several future steps in flight resumes and stores the weights an uninterrupted run stores, with
each off-policy correction setting (`grpo.decoupled`, `grpo.mismatch`).

tiny_grpo without its warm-up, 4 prompts x 4 samples a step, 6 steps. The references are computed
once for the module, the stopped runs in a second Dagster home: about 15-25 s per setting on the 2
busy cores, and the real kill's test about 60 s (two `dagster-rl train` processes)."""

import json
import signal
from pathlib import Path

import pytest

from dagster_rl.core.experiment import step_key
from tests.settings import tiny_grpo

LAG, STEPS, CRASH_AFTER = 3, 6, 2
SETTINGS = {  # what each setting adds to tiny_grpo's grpo section
    "plain": {},
    "decoupled": {"decoupled": {"cap": 5.0}},
    "tis_token": {"mismatch": {"level": "token", "action": "truncate", "cap": 2.0}},
    "mis_sequence": {"mismatch": {"level": "sequence", "action": "mask", "cap": 3.0}},
}
LAST = step_key(STEPS - 1)


def lagged(name: str, **overrides) -> dict:
    """tiny_grpo without its warm-up, 4 prompts x 4 samples a step, at lag 3, with the setting's corrections."""
    grpo = {**tiny_grpo()["grpo"], **SETTINGS[name]}
    small = {"prompts_per_step": 4, "n_samples": 4, "min_trials_per_step": 8, "warmup": None}
    return tiny_grpo(name=f"lag3_{name}", max_policy_lag=LAG, grpo=grpo, **small, **overrides)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One Dagster home with every setting's experiment; each runs 0000..0005 uninterrupted when a test first asks."""
    from tests.harness import new_dagster_home, open_lab
    from tests.settings import write_experiments

    home = new_dagster_home(tmp_path_factory.mktemp("lag3_ref") / "home")
    lab = open_lab(home, write_experiments(home / "experiments", *(lagged(n) for n in SETTINGS)))
    done: set[str] = set()

    def reference(name: str):
        if name not in done:
            assert lab.run(f"lag3_{name}", "0000", LAST).success
            done.add(name)
        return lab

    yield reference
    lab.close()


@pytest.fixture(scope="module")
def crashes(tmp_path_factory):
    """A second home: every setting's experiment with the driver crashing after step 0002."""
    from tests.harness import new_dagster_home, open_lab
    from tests.settings import write_experiments

    home = new_dagster_home(tmp_path_factory.mktemp("lag3_crash") / "home")
    crashing = [lagged(n, faults={"crash_driver_at_step": CRASH_AFTER}) for n in SETTINGS]
    lab = open_lab(home, write_experiments(home / "experiments", *crashing))
    yield lab
    lab.close()


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_a_run_at_lag_3_crashed_mid_range_resumes_to_the_bytes_of_an_uninterrupted_one(
    references, crashes, setting, monkeypatch, capsys
):
    name = f"lag3_{setting}"
    ref = references(setting)
    behavior = [ref.latest(name, "rollouts", step_key(s))["behavior_policy"]["partition"] for s in range(STEPS)]
    assert behavior == ["initial"] * 4 + ["0000", "0001"]  # step n: the weights of step n - 4
    md = [ref.latest(name, "weights", step_key(s)) for s in range(STEPS)]
    assert [m["policy_lag"] for m in md] == [0.0, 1.0, 2.0, 3.0, 3.0, 3.0]
    assert [m["behavior_step"] for m in md] == [-1.0, -1.0, -1.0, -1.0, 0.0, 1.0]
    assert all(m["grad_norm"] > 0 for m in md)  # every step moves the adapter
    if setting == "plain":
        assert "mismatch_weight" not in md[-1] and "decoupled_weight" not in md[-1]
    if "mismatch" in SETTINGS[setting]:  # every step checked against the recomputed behavior log-probs
        assert all(m["logp_max_dev"] < 1e-4 and m["mismatch_capped_frac"] == 0.0 for m in md), [m["logp_max_dev"] for m in md]
    if "decoupled" in SETTINGS[setting]:  # stale steps: the behavior-to-proximal weight moves off 1
        assert md[0]["decoupled_weight"] == pytest.approx(1.0, abs=1e-4) and md[-1]["decoupled_masked_frac"] >= 0.0
        assert md[-1]["clip_frac"] == 0.0  # one optimizer step: the ratio to the proximal is 1, the clip never binds

    assert not crashes.run(name, "0000", LAST, raise_on_error=False).success
    assert sorted(crashes.metadata(name, "weights")) == [step_key(s) for s in range(CRASH_AFTER + 1)]
    assert crashes.run(name, step_key(CRASH_AFTER + 1), LAST).success  # resumes at the first unfinished step
    # step 3's rollouts were generated ahead (while step 2 trained) and stored: the resumed range finds them
    assert crashes.latest(name, "rollouts", step_key(CRASH_AFTER + 1))["cache"] == "hit"
    for s in range(CRASH_AFTER + 1, STEPS):
        ours, theirs = crashes.latest(name, "weights", step_key(s)), ref.latest(name, "weights", step_key(s))
        assert (ours["artifact_key"], ours["content_hash"]) == (theirs["artifact_key"], theirs["content_hash"]), s
    if setting == "plain":  # what Dagster recorded of the resumed run is what the store holds; the lineage is whole
        from assets.cli import main

        monkeypatch.setenv("DAGSTER_HOME", str(crashes.home))
        monkeypatch.setenv("DAGSTER_RL_EXPERIMENTS", str(crashes.home / "experiments"))
        main(["verify", name])  # exits non-zero on any mismatch
        assert f"artifacts of {name} in " in capsys.readouterr().out  # "verified N artifacts of ...: 0 bad"
        main(["lineage", name, LAST, "--json"])
        chain = json.loads(capsys.readouterr().out)
        assert [c["step"] for c in chain] == list(range(STEPS))[::-1]
        assert [c["behavior_policy"]["partition"] for c in chain] == ["0001", "0000"] + ["initial"] * 4


def _stored_steps(store_root: Path, kind: str) -> list[int]:
    """The steps of the complete artifacts of one kind in a local store (a step's weights: their stats)."""
    from dagster_rl.core.records import STATS

    steps = []
    for art in (store_root / kind).iterdir():
        record = art / (STATS if kind == "weights" else "data.json")
        if (art / "manifest.json").is_file() and record.is_file():
            steps.append(json.loads(record.read_text())["step"])
    return sorted(steps)


def test_a_run_at_lag_3_killed_with_rollouts_of_future_steps_in_flight_resumes_to_the_same_bytes(tmp_path, references):
    """SIGKILL of `dagster-rl train` (the process group) once step 0002's line is out. Every update
    waits 3 s (faults.step_delay_s) and every generation 1 s (faults.generation_delay_s): by then the
    sampler has generated the steps ahead of it (0003-0005, stored) and started 0006 (queued when 0002
    trained), which dies half-done. The resumed range reuses the stored ones, generates 0006 again,
    and ends on the weights of an uninterrupted run."""
    from tests.cli_runs import home_with, train_until
    from tests.harness import open_lab

    name, last = "lag3_plain", "0007"
    settings = lagged("plain", faults={"step_delay_s": 3.0, "generation_delay_s": 1.0})
    home, env = home_with(tmp_path, settings)
    code, lines = train_until(env, tmp_path, [name, f"0000...{last}"], "step 0002  16/16 trials", signal.SIGKILL, group=True)
    assert code == -signal.SIGKILL, lines
    store = home / "artifacts"
    generated = _stored_steps(store, "rollouts")
    print(f"stored when killed: rollouts of steps {generated}, weights of steps {_stored_steps(store, 'weights')}")
    assert generated == [0, 1, 2, 3, 4, 5], generated  # 0006: in flight (in its delay), never stored
    assert _stored_steps(store, "weights")[-1:] in ([2], [3]), "killed at step 0002's end (0003 may have trained)"

    resumed = open_lab(home, home / "experiments")
    try:
        assert resumed.run(name, "0000", last).success
        cache = {s: resumed.latest(name, "rollouts", step_key(s))["cache"] for s in range(3, 8)}
        assert cache == {3: "hit", 4: "hit", 5: "hit", 6: "miss", 7: "miss"}, cache  # generated ahead: reused
        ref = references("plain")
        assert ref.run(name, "0000", last).success  # the uninterrupted run, two steps further
        for s in range(8):
            ours, theirs = resumed.latest(name, "weights", step_key(s)), ref.latest(name, "weights", step_key(s))
            assert ours["content_hash"] == theirs["content_hash"], s
    finally:
        resumed.close()
