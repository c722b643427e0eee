"""A GSM8K-format experiment end to end through the driver: built-in word problems, chat-template
prompts, the warm-up, GSM8K answer extraction and the `#### <n>` format reward."""

from statistics import fmean

from dagster_rl.lm.prompts import extract_answer, has_answer_mark
from dagster_rl.lm.records import LMRollout
from dagster_rl.lm.rewards import LMReward
from dagster_rl.lm.tiny import IM_START
from dagster_rl.records import Rewards, Rollouts
from tests.conftest import shipped_settings


def test_tiny_gsm8k_warms_up_and_steps_through_the_driver(lab):
    settings = shipped_settings("tiny_gsm8k", n_steps=2, prompts_per_step=4, n_samples=4, min_trials_per_step=8)
    run = lab("gsm8k", settings)
    assert run.run("tiny_gsm8k", "0000", "0000").success

    sft = run.latest("tiny_gsm8k", "sft", None)
    # measured: the base 0.02, the shipped warm-up (400 steps on 512 worked answers) 0.50
    assert sft["base_accuracy"] <= 0.05 and sft["accuracy"] >= 0.35, sft
    assert sft["n_prompts"] == 100 and sft["demos"] == 512

    store = run.store()
    rollouts = store.get_model("rollouts", run.latest("tiny_gsm8k", "rollouts", "0000")["artifact_key"], Rollouts[LMRollout])
    rewards = store.get_model("rewards", run.latest("tiny_gsm8k", "rewards", "0000")["artifact_key"], Rewards[LMReward])
    assert len(rollouts.trajectories) == 16
    from transformers import AutoTokenizer

    from dagster_rl.lm.tiny import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("builtin:tiny-qwen2-gsm8k"))
    for r in rollouts.trajectories:
        prompt = tok.decode(r.prompt_token_ids)
        assert prompt.startswith(f"{IM_START}user\n") and prompt.endswith(f"{IM_START}assistant\n")  # the chat template
    by_trial = {r.trial_id: r for r in rollouts.trajectories}
    for reward in rewards.rewards:
        text = by_trial[reward.trial_id].completion_text
        assert reward.answer == extract_answer(text)
        assert reward.components["format"] == (0.1 if has_answer_mark(text) else 0.0)
        assert reward.correct == (reward.answer == reward.reference)
    # the warm-up answers in form: most completions end with a `#### <n>` line, and some are right
    assert sum(r.components["format"] > 0 for r in rewards.rewards) >= 12
    assert any(r.correct for r in rewards.rewards)


def test_tiny_gsm8k_heldout_accuracy_rises_above_the_warm_started_base(lab):
    """The shipped experiment through the driver, its first 20 steps: greedy accuracy on 100 held-out
    problems no step trains on rises at least 10 points above the warm-up's (the whole 60-step curve
    is in the README, from bench/learning_curves.py)."""
    run = lab("gsm8k_curve", shipped_settings("tiny_gsm8k"))
    assert run.run("tiny_gsm8k", "0000", "0019").success
    sft = run.latest("tiny_gsm8k", "sft", None)
    accuracy = [run.latest("tiny_gsm8k", "evaluation", f"{s:04d}")["accuracy"] for s in range(20)]
    # measured: base 0.02, warm-up 0.50; steps 15..19: 0.62 0.66 0.66 0.65 0.67
    assert sft["base_accuracy"] <= 0.05 and sft["accuracy"] >= 0.3  # the warm-up can do the task a little
    assert fmean(accuracy[-5:]) >= sft["accuracy"] + 0.10, accuracy
