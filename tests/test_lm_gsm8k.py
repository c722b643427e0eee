"""A GSM8K-format experiment end to end through the driver: built-in word problems, chat-template
prompts, the warm-up, GSM8K answer extraction, the `#### <n>` format reward, and the held-out rise."""

from statistics import fmean

import pytest

from dagster_rl.core.experiment import step_key
from dagster_rl.core.records import Rewards
from dagster_rl.tasks.lm.data.prompts import extract_answer, has_answer_mark
from dagster_rl.tasks.lm.model.tokenizers import IM_START
from dagster_rl.tasks.lm.rewards import LMReward
from tests.settings import shipped_settings

GSM8K_RISE, GSM8K_LAST = 0.04, 10  # see test_tiny_gsm8k_heldout_accuracy_rises_above_the_warm_started_base
STEPS = [step_key(i) for i in range(shipped_settings("tiny_gsm8k")["n_steps"])]


@pytest.fixture(scope="module")
def curve(tmp_path_factory):
    """The shipped experiment, its warm-up and all its steps, through the driver."""
    from tests.harness import new_dagster_home, open_lab
    from tests.settings import write_experiments

    home = new_dagster_home(tmp_path_factory.mktemp("gsm8k") / "home")
    lab = open_lab(home, write_experiments(home / "experiments", shipped_settings("tiny_gsm8k")))
    assert lab.run("tiny_gsm8k", STEPS[0], STEPS[-1]).success
    yield lab
    lab.close()


def test_tiny_gsm8k_warms_up_and_steps_through_the_driver(curve):
    exp = curve.experiments["tiny_gsm8k"]
    sft = curve.latest("tiny_gsm8k", "sft", None)
    assert sft["base_accuracy"] <= 0.05 and sft["n_prompts"] == 100 and sft["demos"] == exp.warmup.demos, sft
    # the warm-up stopped at the first check (every check_every steps, on training problems that are not
    # demonstrations) that reached its target, or ran all its steps
    target, every = exp.warmup.target_accuracy, exp.warmup.check_every
    assert sft["sft_steps"] % every == 0 and (sft["check_accuracy"] >= target or sft["sft_steps"] == exp.warmup.steps), sft

    store = curve.store()
    rollouts = curve.rollouts("tiny_gsm8k", STEPS[0])
    rewards = store.get_model("rewards", curve.latest("tiny_gsm8k", "rewards", STEPS[0])["artifact_key"], Rewards[LMReward])
    assert len(rollouts.trajectories) == exp.prompts_per_step * exp.n_samples
    from transformers import AutoTokenizer

    from dagster_rl.tasks.lm.model.tiny import resolve_model

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
    assert sum(r.components["format"] > 0 for r in rewards.rewards) >= len(rewards.rewards) / 2
    assert any(r.correct for r in rewards.rewards)


@pytest.mark.numerics
def test_tiny_gsm8k_heldout_accuracy_rises_above_the_warm_started_base(curve, record_property):
    """Greedy accuracy on 100 held-out problems no step trains on rises above the warm-up's, on every
    CPU kernel setting: the mean over the last 10 of the shipped 60 steps is at least 4 points above
    the warm-up's.

    Measured with bench/learning_curves.py over 9 runs (native AVX-512, ATEN_CPU_CAPABILITY=avx2 and
    =default, experiment seeds 0, 1 and 2): that rise is +0.081 to +0.260; at seed 0, this test's,
    +0.096 native, +0.248 avx2, +0.091 default. 0.04 leaves 4 points below the smallest for another
    CPU's rounding and is still 4 problems of 100 above the warm-up, more than the noise of a mean of
    10 evaluations (over steps 50..59 one step's accuracy moves by 1-5 points, the 10 values' standard
    deviation is 0.7-2.7 points). No rise is asserted earlier: the mean of steps 15..19 was
    +0.002..+0.194 above the warm-up over the same 9 runs, the trajectory's luck, not a property.
    The whole curve's range is in docs/language-models.md."""
    sft = curve.latest("tiny_gsm8k", "sft", None)
    accuracy = [curve.latest("tiny_gsm8k", "evaluation", s)["accuracy"] for s in STEPS]
    last = fmean(accuracy[-GSM8K_LAST:])
    record_property("warmup", sft["accuracy"])
    record_property(f"last{GSM8K_LAST}", round(last, 3))
    record_property("rise", f"{last - sft['accuracy']:+.3f}")
    assert sft["accuracy"] >= 0.2, sft  # the warm-up can do the task a little (measured 0.21-0.44)
    assert last >= sft["accuracy"] + GSM8K_RISE, (sft["accuracy"], accuracy)
