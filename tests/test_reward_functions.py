"""Reward functions as the rubric (`rubric: {kind: functions, ...}`), judged as the driver judges: the
reward is what the function returns, byte for byte; None adds nothing; every way a function can fail
is a failed judgement naming the function, the trial and the error, never a 0. No model, no Dagster:
rollouts are written by hand (the driver test is `test_lm_bring_your_own.py`)."""

import hashlib
from pathlib import Path

import pytest

from dagster_rl.base.errors import ExperimentError
from dagster_rl.base.retries import Limits
from dagster_rl.core.experiment_files import load_experiments, parse_experiment
from dagster_rl.core.records import TrialFailed
from dagster_rl.core.steps import judge_all
from dagster_rl.judges.rubric_judge import RubricJudge
from dagster_rl.tasks.lm.loop import function_means
from dagster_rl.tasks.lm.records import LMRollout
from dagster_rl.tasks.lm.rewards import pinned, score_rollout, scorer_of
from tests.reward_fixtures import BROKEN_USER_FILE, USER_FILE
from tests.settings import write_experiments

FAILING = """\
import time

def raises(prompts, completions, completion_ids, **kwargs):
    raise ValueError("my checker broke")

def two_values(prompts, completions, completion_ids, **kwargs):
    return [1.0, 2.0]

def not_a_list(prompts, completions, completion_ids, **kwargs):
    return 1.0

def nan(prompts, completions, completion_ids, **kwargs):
    return [float("nan")]

def infinite(prompts, completions, completion_ids, **kwargs):
    return [float("-inf")]

def text(prompts, completions, completion_ids, **kwargs):
    return ["good"]

def hangs(prompts, completions, completion_ids, **kwargs):
    while True:
        time.sleep(0.01)
"""


def experiment(folder: Path | None, functions: list[dict], **rubric) -> dict:
    return {
        "name": "byo",
        "n_steps": 1,
        "prompts_per_step": 2,
        "n_samples": 2,
        "task": {"kind": "verifiable_prompts", "source": {"kind": "synthetic", "ops": ["copy"], "n_eval": 2}},
        "policy": {"base_model": "builtin:tiny-qwen2"},
        "rubric": {"kind": "functions", "accuracy": 0.0, "functions": functions, **rubric},
    }


def rollout(trial: str, text: str, ids: list[int], prompt_id: str = "copy-3", reference: str = "3") -> LMRollout:
    return LMRollout(
        trial_id=trial,
        step=0,
        prompt=0,
        sample=0,
        prompt_id=prompt_id,
        reference=reference,
        seed=0,
        prompt_token_ids=[1, 2],
        completion_token_ids=ids,
        completion_text=text,
        sampling_logprobs=[0.0] * len(ids),
        finish_reason="stop",
        temperature=1.0,
        top_p=1.0,
        behavior_version=0,
    )


def test_the_reward_is_what_the_function_returns_byte_for_byte(tmp_path):
    (tmp_path / "my_rewards.py").write_text(USER_FILE)
    exp = parse_experiment(experiment(tmp_path, [{"function": "my_rewards.py:distinct_chars"}]), tmp_path)
    reward = score_rollout(exp, rollout("s0-p0-n0", "the answer is 3", [5, 6, 7]))
    assert reward.reward == 11 / 64 and reward.functions == {"distinct_chars": 11 / 64}  # 11 distinct characters
    assert reward.components == {"accuracy": 0.0, "format": 0.0, "distinct_chars": 11 / 64}


def test_weights_and_the_built_in_terms_add_and_none_adds_nothing():
    exp = parse_experiment(
        experiment(
            None,
            [
                {"function": "tests.reward_fixtures:length", "weight": 0.5},
                {"function": "tests.reward_fixtures:mentions_answer", "weight": 2.0, "name": "mentions"},
            ],
            accuracy=1.0,
            format=0.25,
        )
    )
    right = score_rollout(exp, rollout("s0-p0-n0", "it is 3", [9, 9, 9, 9]))
    assert right.functions == {"length": -0.5, "mentions": 1.0}
    assert right.components == {"accuracy": 1.0, "format": 0.25, "length": -0.25, "mentions": 2.0}
    assert right.reward == 1.0 + 0.25 - 0.25 + 2.0 and right.correct
    wrong = score_rollout(exp, rollout("s0-p0-n1", "no idea", [9, 9]))
    assert wrong.functions == {"length": -0.25, "mentions": None}  # None: no opinion, no term (TRL's nansum)
    assert wrong.components == {"accuracy": 0.0, "format": 0.0, "length": -0.125} and wrong.reward == -0.125
    assert function_means([right, wrong]) == {"reward_length": -0.375, "reward_mentions": 1.0}  # over opinions only


def test_a_function_gets_the_rows_columns_by_name():
    exp = parse_experiment(experiment(None, [{"function": "tests.reward_fixtures:echo_columns"}]))
    assert score_rollout(exp, rollout("s0-p0-n0", "3", [1])).functions == {"echo_columns": 1.0}  # `answer`


@pytest.mark.parametrize(
    "function, said",
    [
        ("raises", "raised on trial s0-p0-n0: ValueError: my checker broke (failing.py, line 4, in raises)"),
        ("two_values", "returned 2 values for 1 completion on trial s0-p0-n0: one float or None per completion"),
        ("not_a_list", "returned 1.0 (a float) on trial s0-p0-n0: it must return a list, one float or None per completion"),
        ("nan", "returned nan on trial s0-p0-n0: a reward is a finite number, or None for no opinion"),
        ("infinite", "returned -inf on trial s0-p0-n0: a reward is a finite number, or None for no opinion"),
        ("text", "returned 'good' (a str) on trial s0-p0-n0: a reward is a number, or None"),
        ("hangs", "did not return within 1 s on trial s0-p0-n0 (its timeout_s: 1); its worker process was killed"),
    ],
)
def test_a_failing_function_fails_the_trials_judgement_naming_function_trial_and_error(tmp_path, function, said):
    (tmp_path / "failing.py").write_text(FAILING)
    healthy = {"function": "tests.reward_fixtures:length"}
    exp = parse_experiment(experiment(tmp_path, [healthy, {"function": f"failing.py:{function}", "timeout_s": 1}]), tmp_path)
    judge = RubricJudge(score_rollout, Limits(max_retries=0, max_concurrency=2))
    outcomes = judge_all(exp, [rollout("s0-p0-n0", "3", [1])], judge)
    assert len(outcomes) == 1 and isinstance(outcomes[0], TrialFailed)
    assert outcomes[0].error == (
        "judging failed after its retries: judging s0-p0-n0 failed after 1 attempt(s): RewardFunctionError: "
        f"reward function failing.py:{function} {said}"
    )


def test_a_step_scores_with_the_sources_it_keyed_on_and_an_edit_is_a_new_key(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_FILE)
    exp = parse_experiment(experiment(tmp_path, [{"function": "my_rewards.py:distinct_chars"}]), tmp_path)
    step = pinned(exp)
    before = step._scorer.key_inputs()
    assert before == {
        "functions": [
            {"function": "my_rewards.py:distinct_chars", "source_sha256": hashlib.sha256(USER_FILE.encode()).hexdigest()}
        ]
    }
    path.write_text(BROKEN_USER_FILE)
    assert scorer_of(exp).key_inputs() != before  # a new step keys the new bytes
    assert scorer_of(step).key_inputs() == before  # the step's own scorer keeps its own
    with pytest.raises(Exception, match="the file changed since this step computed its keys"):
        score_rollout(step, rollout("s0-p0-n0", "3", [1]))  # and never runs other bytes under them


@pytest.mark.parametrize(
    "functions, said",
    [
        ([], "field 'rubric.functions': Value error, name at least one reward function"),
        ([{"function": "my_rewards.py"}], "does not name a function: write `file.py:function`"),
        ([{"function": "absent.py:f"}], "'absent.py:f': no file absent.py in the experiments folder"),
        ([{"function": "../my_rewards.py:f"}], "is neither a file name in the experiments folder"),
        (
            [{"function": "my_rewards.py:distinct_chars"}, {"function": "tests.reward_fixtures:distinct_chars"}],
            "reward functions named ['distinct_chars']: each needs a name of its own",
        ),
        ([{"function": "my_rewards.py:distinct_chars", "name": "accuracy"}], "reward functions named ['accuracy']"),
        ([{"function": "my_rewards.py:distinct_chars", "timeout_s": 0}], "field 'rubric.functions.0.timeout_s'"),
    ],
)
def test_a_functions_rubric_that_cannot_run_is_refused_when_the_file_loads(tmp_path, functions, said):
    (tmp_path / "my_rewards.py").write_text(USER_FILE)
    write_experiments(tmp_path, experiment(tmp_path, functions))
    with pytest.raises(ExperimentError) as refused:
        load_experiments(tmp_path)
    assert str(refused.value).startswith(f"{tmp_path / 'byo.yaml'}: invalid experiment: ") and said in str(refused.value)


def test_a_file_reference_needs_the_experiments_folder():
    with pytest.raises(ValueError, match="names a file in the experiments folder, and this experiment was not read from one"):
        parse_experiment(experiment(None, [{"function": "my_rewards.py:distinct_chars"}]))


def test_an_experiment_read_from_a_folder_knows_it(tmp_path):
    (tmp_path / "my_rewards.py").write_text(USER_FILE)
    write_experiments(tmp_path, experiment(tmp_path, [{"function": "my_rewards.py:distinct_chars"}]))
    exp = load_experiments(tmp_path)["byo"]
    assert exp.folder == tmp_path and exp.rubric.functions[0].folder == tmp_path
    assert exp.min_reward == float("-inf") and exp.max_reward == float("inf")  # bounded only by being finite
    assert "timeout_s" not in str(exp.training_inputs())  # a time limit is in no key
