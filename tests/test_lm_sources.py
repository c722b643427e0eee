"""The prompt sources a user brings: a local JSONL, Parquet or CSV file read by Hugging Face `datasets`
with a column mapping, and reasoning-gym's procedural tasks (drawn from the experiment's seed,
held-out disjoint from training, scored by the dataset's own `score_answer`); and math-verify as an
answer rule. No model: completions are written by hand, scored as the judge scores them."""

import json
import os
from pathlib import Path

import pandas as pd
import pytest

from dagster_rl.base.errors import ExperimentError
from dagster_rl.core.experiment_files import load_experiments, parse_experiment
from dagster_rl.tasks.lm.data.gym import gym_version
from dagster_rl.tasks.lm.data.prompts import PromptError, load_prompt_set
from dagster_rl.tasks.lm.rewards import scorer_of
from tests.settings import write_experiments

ROWS = [{"q": f"What is {a} + {b}?", "final": a + b, "level": a % 3, "note": f"n{a}"} for a in range(6) for b in range(5)]


def experiment(source: dict, rubric: dict | None = None, seed: int = 0) -> dict:
    return {
        "name": "byo",
        "seed": seed,
        "n_steps": 1,
        "prompts_per_step": 2,
        "n_samples": 2,
        "task": {"kind": "verifiable_prompts", "source": source},
        "policy": {"base_model": "builtin:tiny-qwen2"},
        **({"rubric": rubric} if rubric else {}),
    }


def write_rows(folder: Path, suffix: str) -> Path:
    path = folder / f"problems{suffix}"
    frame = pd.DataFrame(ROWS)
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    elif suffix == ".parquet":
        frame.to_parquet(path)
    else:
        frame.to_csv(path, index=False)
    return path


MAPPING = {"prompt": "q", "answer": "final", "difficulty": "level"}


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet", ".csv"])
def test_a_data_file_loads_through_datasets_with_its_column_mapping(tmp_path, suffix):
    write_rows(tmp_path, suffix)
    exp = parse_experiment(
        experiment({"kind": "datasets", "path": f"problems{suffix}", "columns": MAPPING, "n_eval": 5}), tmp_path
    )
    ps = load_prompt_set(exp.task.source, exp.seed)
    assert (len(ps.train), len(ps.eval)) == (25, 5)
    item = next(it for it in [*ps.train, *ps.eval] if it.question == "What is 4 + 3?")
    assert (item.reference, item.solution) == ("7", "7")
    assert item.columns == {"answer": 7, "difficulty": 1}  # as the file holds them, passed to reward functions by name
    assert {it.id for it in ps.eval} & {it.id for it in ps.train} == set()


def test_the_three_formats_give_the_same_prompt_set(tmp_path):
    sets = []
    for suffix in (".jsonl", ".parquet", ".csv"):
        write_rows(tmp_path, suffix)
        source = {"kind": "datasets", "path": f"problems{suffix}", "columns": MAPPING, "n_eval": 5}
        exp = parse_experiment(experiment(source), tmp_path)
        sets.append(load_prompt_set(exp.task.source, 0))
    assert sets[0] == sets[1] == sets[2]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet", ".csv"])
def test_a_file_whose_columns_do_not_match_is_refused_naming_file_column_and_its_columns(tmp_path, suffix):
    path = write_rows(tmp_path, suffix)
    exp = parse_experiment(experiment({"kind": "datasets", "path": str(path), "columns": {"prompt": "question"}}), tmp_path)
    with pytest.raises(PromptError) as refused:
        load_prompt_set(exp.task.source, 0)
    assert str(refused.value) == (
        f"{path}: no column 'question' (task.source.columns.prompt); the file's columns are q, final, level, note"
    )


@pytest.mark.parametrize(
    "path, said",
    [
        ("../outside.jsonl", "path '../outside.jsonl' leads out of the experiments folder"),
        ("data/../../outside.jsonl", "leads out of the experiments folder"),
        ("link.jsonl", "is a link to"),
        ("problems.txt", "the suffix says the format: one of .jsonl, .json, .parquet, .csv"),
    ],
)
def test_a_data_path_stays_in_the_experiments_folder(tmp_path, path, said):
    folder = tmp_path / "experiments"
    folder.mkdir()
    (tmp_path / "outside.jsonl").write_text("{}\n")
    os.symlink(tmp_path / "outside.jsonl", folder / "link.jsonl")
    write_experiments(folder, experiment({"kind": "datasets", "path": path}))
    with pytest.raises(ExperimentError, match="field 'task.source'") as refused:
        load_experiments(folder)
    assert said in str(refused.value)


def test_a_data_path_is_read_in_the_experiments_folder_or_absolute(tmp_path):
    folder = tmp_path / "experiments"
    (folder / "data").mkdir(parents=True)
    write_rows(folder / "data", ".jsonl")
    elsewhere = write_rows(tmp_path, ".csv")
    write_experiments(folder, experiment({"kind": "datasets", "path": "data/problems.jsonl", "columns": MAPPING, "n_eval": 5}))
    relative = load_experiments(folder)["byo"]
    assert relative.task.source.location == folder / "data" / "problems.jsonl"
    absolute = parse_experiment(experiment({"kind": "datasets", "path": str(elsewhere), "columns": MAPPING, "n_eval": 5}))
    assert load_prompt_set(absolute.task.source, 0) == load_prompt_set(relative.task.source, 0)  # the same rows
    with pytest.raises(ValueError, match="relative to the experiments folder, and this experiment was not read from one"):
        parse_experiment(experiment({"kind": "datasets", "path": "data/problems.jsonl"}))


GYM = {
    "kind": "reasoning_gym",
    "dataset": "chain_sum",
    "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
    "size": 40,
    "n_eval": 20,
    "extract": "last_number",
}


def test_reasoning_gym_draws_from_the_experiment_seed_with_held_out_disjoint():
    one = load_prompt_set(parse_experiment(experiment(GYM)).task.source, 1)
    again = load_prompt_set(parse_experiment(experiment(GYM)).task.source, 1)
    other = load_prompt_set(parse_experiment(experiment(GYM)).task.source, 2)
    assert one == again and one != other
    # seeds 1 and 2 draw unrelated questions (reasoning-gym's own seeds s and s + 1 draw one sequence shifted by one)
    assert len({it.question for it in one.eval} & {it.question for it in other.eval}) < 5
    assert (len(one.train), len(one.eval)) == (40, 20)
    questions = [it.question for it in [*one.train, *one.eval]]
    assert len(set(questions)) == 60  # distinct: no held-out question is trained on
    assert all(q.startswith("State the final answer to the following arithmetic problem:") for q in questions)


def test_reasoning_gym_scores_with_the_datasets_own_score_answer_times_the_accuracy_weight():
    exp = parse_experiment(experiment(GYM, rubric={"accuracy": 2.0}))
    item = load_prompt_set(exp.task.source, exp.seed).eval[0]
    scorer = scorer_of(exp)
    right = scorer.score("t", item, item.reference, f"The answer is {item.reference}.", [1])
    wrong = scorer.score("t", item, item.reference, f"The answer is {int(item.reference) + 1}.", [1])
    nothing = scorer.score("t", item, item.reference, "I do not know.", [1])
    assert (right.score, right.components["accuracy"], right.correct) == (1.0, 2.0, True)
    assert (wrong.score, nothing.score, nothing.answer) == (0.0, 0.0, None)
    assert scorer.key_inputs() == {
        "verifier": {"reasoning_gym": gym_version(), "dataset": "chain_sum", "config": GYM["config"], "extract": "last_number"}
    }


def test_reasoning_gym_answer_tags_and_partial_credit():
    exp = parse_experiment(experiment({**GYM, "extract": "answer_tag"}))
    item = load_prompt_set(exp.task.source, 0).eval[0]
    scorer = scorer_of(exp)
    assert scorer.score("t", item, item.reference, f"so <answer>{item.reference}</answer>", [1]).score == 1.0
    assert scorer.score("t", item, item.reference, f"it is {item.reference}", [1]).score == 0.0  # no tag: nothing scored
    partial = scorer.score("t", item, item.reference, f"<answer>x{item.reference}</answer>", [1])
    assert 0.0 < partial.score < 1.0 and not partial.correct  # the dataset's partial credit, as it gives it


def test_a_reasoning_gym_mix_is_a_composite():
    mix = {
        "kind": "reasoning_gym",
        "dataset": "composite",
        "config": {
            "datasets": [
                {"name": "chain_sum", "weight": 1, "config": {"max_terms": 2, "max_digits": 1}},
                {"name": "gcd", "weight": 1, "config": {"max_value": 20}},
            ]
        },
        "size": 30,
        "n_eval": 10,
        "extract": "last_number",
    }
    exp = parse_experiment(experiment(mix))
    ps = load_prompt_set(exp.task.source, 0)
    sources = {it.columns["metadata"]["source_dataset"] for it in ps.train}
    assert sources == {"chain_sum", "gcd"}
    item = ps.eval[0]
    assert scorer_of(exp).score("t", item, item.reference, item.reference, [1]).score == 1.0


@pytest.mark.parametrize(
    "source, rubric, said",
    [
        ({**GYM, "dataset": "no_such_task"}, None, "reasoning-gym refuses dataset 'no_such_task'"),
        ({**GYM, "config": {"bogus": 1}}, None, "unexpected keyword argument 'bogus'"),
        ({**GYM, "question_format": "Q"}, None, "question_format must hold {question}"),
        (GYM, {"answer_rule": "math_verify"}, "its answers are scored by the dataset's own score_answer"),
    ],
)
def test_a_reasoning_gym_source_that_cannot_run_is_refused_when_the_file_loads(source, rubric, said):
    with pytest.raises(ValueError) as refused:
        parse_experiment(experiment(source, rubric))
    assert said in str(refused.value)


def test_too_few_distinct_questions_is_said_with_the_counts():
    tiny = {**GYM, "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}, "size": 1000}
    with pytest.raises(PromptError, match=r"gave \d+ distinct questions in 4080 draws, fewer than n_eval \+ size = 20 \+ 1000"):
        load_prompt_set(parse_experiment(experiment(tiny)).task.source, 0)


@pytest.mark.parametrize(
    "completion, reference, right",
    [
        ("The answer is $\\boxed{\\frac{1}{2}}$.", "0.5", True),
        ("so x = 2/4", "\\frac{1}{2}", True),
        ("It is 0.25", "\\frac{1}{2}", False),
        ("#### 42", "42", True),
        ("no number here", "42", False),
    ],
)
def test_math_verify_is_an_answer_rule(tmp_path, completion, reference, right):
    path = tmp_path / "math.jsonl"
    path.write_text(
        json.dumps({"prompt": "Compute it.", "answer": reference}) + "\n" + json.dumps({"prompt": "b", "answer": "1"}) + "\n"
    )
    exp = parse_experiment(experiment({"kind": "datasets", "path": str(path), "n_eval": 1}, {"answer_rule": "math_verify"}))
    item = next(
        it
        for it in load_prompt_set(exp.task.source, 0).train + load_prompt_set(exp.task.source, 0).eval
        if it.question == "Compute it."
    )
    scored = scorer_of(exp).score("t", item, item.reference, completion, [1])
    assert scored.correct is right and scored.components["accuracy"] == float(right)
    assert scorer_of(exp).key_inputs()["verifier"]["math_verify"]  # its version, in the keys


def test_the_number_rule_reads_a_data_files_answer_as_a_number(tmp_path):
    path = tmp_path / "gsm.jsonl"
    path.write_text(
        json.dumps({"prompt": "How many?", "answer": "3 + 4 = 7.\n#### 7"})
        + "\n"
        + json.dumps({"prompt": "b", "answer": "1"})
        + "\n"
    )
    exp = parse_experiment(experiment({"kind": "datasets", "path": str(path), "n_eval": 1}))
    ps = load_prompt_set(exp.task.source, 0)
    item = next(it for it in ps.train + ps.eval if it.question == "How many?")
    assert scorer_of(exp).score("t", item, item.reference, "That makes 7.", [1]).correct
    assert not scorer_of(exp).score("t", item, item.reference, "That makes 8.", [1]).correct


def test_the_shipped_reasoning_gym_experiment_draws_and_scores_its_questions():
    """experiments/smollm2_reasoning_gym.yaml (its learning is measured in docs/bring-your-own-task.md):
    its 80 training and 100 held-out questions, each scored 1 for its own answer by the worker."""
    from tests import REPO

    exp = load_experiments(REPO / "experiments")["smollm2_reasoning_gym"]
    ps = load_prompt_set(exp.task.source, exp.seed)
    assert (len(ps.train), len(ps.eval)) == (80, 100)
    scorer = scorer_of(exp)
    item = ps.eval[0]
    assert scorer.score("t", item, item.reference, f"{item.question} = {item.reference}", [1]).reward == 1.5
