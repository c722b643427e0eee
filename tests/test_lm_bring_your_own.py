"""What a user brings, through the real driver: a reward-function file beside the experiment is the
reward byte for byte; a raising one fails the step naming it, with nothing of its rewards stored, and
a re-run after the fix computes the step; a data file and a reasoning-gym task train. Tiny models."""

import json

from dagster_rl.core.records import Rewards
from dagster_rl.tasks.lm.rewards import LMReward
from tests.harness import LM_CHAIN, failure_message
from tests.reward_fixtures import BROKEN_USER_FILE, USER_FILE


def byo(**overrides) -> dict:
    """A tiny language-model experiment: 2 prompts x 4 samples of the copy task, no warm-up."""
    return {
        "name": "byo",
        "n_steps": 2,
        "prompts_per_step": 2,
        "n_samples": 4,
        "min_trials_per_step": 4,
        "task": {"kind": "verifiable_prompts", "source": {"kind": "synthetic", "ops": ["copy"], "n_eval": 2}},
        "policy": {"base_model": "builtin:tiny-qwen2", "lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}},
        "sampling": {"temperature": 1.0, "max_new_tokens": 4},
        "rubric": {"kind": "functions", "accuracy": 0.0, "functions": [{"function": "my_rewards.py:distinct_chars"}]},
        "grpo": {"learning_rate": 0.01, "kl_beta": 0.0},
        **overrides,
    }


def stored_rewards(lab, step: str) -> Rewards[LMReward]:
    return lab.store().get_model("rewards", lab.latest("byo", "rewards", step)["artifact_key"], Rewards[LMReward])


def test_a_reward_function_beside_the_experiment_is_the_reward_byte_for_byte(lab):
    run = lab("byo", byo(), files={"my_rewards.py": USER_FILE})
    assert run.run("byo", "0000", "0001").success
    for step in ("0000", "0001"):
        rollouts = {r.trial_id: r for r in run.rollouts("byo", step).trajectories}
        rewards = stored_rewards(run, step).rewards
        assert len(rewards) == 8
        for r in rewards:  # what the function returns for the completion, as it returns it
            assert r.reward == len(set(rollouts[r.trial_id].completion_text)) / 64
            assert r.functions == {"distinct_chars": r.reward}
        metadata = run.latest("byo", "weights", step)
        assert metadata["reward_distinct_chars"] == metadata["mean_reward"]  # the function's mean, plotted per step
    assert [e.asset_materialization.partition for e in run.events("byo", "evaluation")] == ["0000", "0001"]


def test_a_raising_reward_function_fails_the_step_naming_it_and_the_fixed_file_computes_it(lab):
    run = lab("raising", byo(), files={"my_rewards.py": BROKEN_USER_FILE})
    result = run.run("byo", "0000", "0000", raise_on_error=False)
    assert not result.success
    message = failure_message(result)
    assert "step 0000 of byo has 0 usable trials of 8 planned, fewer than min_trials_per_step=4" in message
    assert (
        "RewardFunctionError: reward function my_rewards.py:distinct_chars raised on trial s0-p0-n0: "
        "ZeroDivisionError: division by zero (my_rewards.py, line 2, in distinct_chars)"
    ) in message
    assert run.events("byo", "rewards") == [] and run.events("byo", "weights") == []
    stored = [p / "data.json" for p in (run.home / "artifacts" / "rewards").iterdir() if (p / "manifest.json").exists()]
    # what is stored is the step's partial (which trials failed, for a re-run): no reward in it, never a 0
    assert stored and all(json.loads(p.read_text())["rewards"] == [] for p in stored)

    (run.home / "experiments" / "my_rewards.py").write_text(USER_FILE)  # the fix
    assert run.run("byo", "0000", "0000").success
    rewards = stored_rewards(run, "0000").rewards
    rollouts = {r.trial_id: r for r in run.rollouts("byo", "0000").trajectories}
    assert all(r.reward == len(set(rollouts[r.trial_id].completion_text)) / 64 for r in rewards) and len(rewards) == 8
    assert run.latest("byo", "rollouts", "0000")["cache"] == "hit"  # the rollouts were kept; only the rewards are new
    assert run.latest("byo", "rewards", "0000")["cache"] == "miss"


def test_a_data_file_and_a_reasoning_gym_task_train_through_the_driver(lab, tmp_path):
    rows = [{"q": f"copy {d} :", "a": d, "parity": d % 2} for d in range(10)]
    data = "".join(json.dumps(r) + "\n" for r in rows)
    source = {
        "kind": "datasets",
        "path": "copy.jsonl",
        "columns": {"prompt": "q", "answer": "a", "parity": "parity"},
        "n_eval": 2,
    }
    gym = {
        "kind": "reasoning_gym",
        "dataset": "chain_sum",
        "config": {"min_terms": 2, "max_terms": 2, "max_digits": 1},
        "size": 16,
        "n_eval": 4,
        "extract": "last_number",
    }
    files = {"copy.jsonl": data, "my_rewards.py": USER_FILE}
    functions = {"kind": "functions", "functions": [{"function": "tests.reward_fixtures:echo_columns", "weight": 0.0}]}
    run = lab(
        "sources",
        byo(task={"kind": "verifiable_prompts", "source": source}, rubric=functions),
        byo(name="gym", task={"kind": "verifiable_prompts", "source": gym}, rubric={"accuracy": 1.0}),
        files=files,
    )
    assert run.run("byo", "0000", "0000").success
    rewards = stored_rewards(run, "0000").rewards
    assert {r.functions["echo_columns"] for r in rewards} == {2.0}  # `answer` and `parity`, by name
    assert run.run("gym", "0000", "0001").success
    for asset in LM_CHAIN:
        assert [e.asset_materialization.partition for e in run.events("gym", asset)] == ["0000", "0001"], asset
    evaluation = run.latest("gym", "evaluation", "0001")
    assert 0.0 <= evaluation["accuracy"] <= 1.0 and evaluation["n_prompts"] == 4
