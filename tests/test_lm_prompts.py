"""Prompt sets, answer extraction and the rubric."""

import json

import pytest

from dagster_rl.tasks.lm.data.prompts import (
    GSM8KPrompts,
    PromptError,
    SyntheticPrompts,
    extract_answer,
    extract_reference,
    has_answer_mark,
    load_gsm8k_jsonl,
    load_prompt_set,
    prompts_for_step,
    synthetic_items,
)
from dagster_rl.tasks.lm.rewards import LMRubric, score_text


def test_answer_extraction():
    assert extract_reference("She pays 3 * 4 = 12.\n#### 1,234") == "1234"
    assert extract_reference("... #### -7.50") == "-7.5"
    assert extract_answer("so 3 + 4 = 7, and then 1,250 apples.") == "1250"
    assert extract_answer("the answer is 42.0") == "42"
    assert extract_answer("no digits here") is None
    with pytest.raises(PromptError, match="####"):
        extract_reference("no marker 12")


@pytest.mark.parametrize(
    ("completion", "answer", "marked"),
    [
        ("She has 3 + 4 = 7 pens.\n#### 7", "7", True),
        ("#### 1,234\nthen 5 more", "1234", True),  # the mark wins over a later number
        ("3 + 4 = 7.\n#### 7\n#### 9", "9", True),  # the last mark
        ("x\n#### $18.\n", "18", True),  # a currency sign, a trailing period
        ("####7 apples", "7", True),  # no space, a unit after it
        ("#### -3.50", "-3.5", True),
        ("the total is 12 #### 12", "12", True),  # the mark mid-line counts, as in GSM8K's own regex
        ("#### twelve, so 3 then 12", "12", False),  # a mark without a number: the last number
        ("so 5-3=2", "2", False),  # '-' between numbers is not a sign
        ("I owe -7 dollars", "-7", False),
        ("counts 1,2,3", "3", False),  # not thousands: three numbers
        ("10,000 and 1,23", "23", False),
        ("pay $1,000.50", "1000.5", False),
        ("the answer is 42.0.", "42", False),
        ("no digits at all", None, False),
        ("####", None, False),
    ],
)
def test_gsm8k_answer_extraction_on_tricky_strings(completion, answer, marked):
    assert extract_answer(completion) == answer
    assert has_answer_mark(completion) is marked


def test_gsm8k_format_reward_needs_the_mark():
    rubric = LMRubric(accuracy=1.0, format=0.1, format_rule="gsm8k")
    assert score_text("3 + 4 = 7.\n#### 7", "7", rubric) == ("7", {"accuracy": 1.0, "format": 0.1})
    assert score_text("3 + 4 = 7.", "7", rubric) == ("7", {"accuracy": 1.0, "format": 0.0})  # right, not in form
    assert score_text("3 + 4 = 8.\n#### 8", "7", rubric) == ("8", {"accuracy": 0.0, "format": 0.1})


def test_gsm8k_loader_and_heldout_split(tmp_path):
    path = tmp_path / "train.jsonl"
    rows = [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(20)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    items = load_gsm8k_jsonl(path)
    assert [it.reference for it in items] == [str(i + 1) for i in range(20)]
    assert items[3].solution == "3 + 1 = 4\n#### 4"  # the worked answer: a warm-up's demonstration
    ps = load_prompt_set(GSM8KPrompts(path=str(path), n_eval=5))
    assert len(ps.train) == 15 and len(ps.eval) == 5
    assert not {it.id for it in ps.train} & {it.id for it in ps.eval}
    # reordering the file changes neither ids nor the split
    path.write_text("\n".join(json.dumps(r) for r in reversed(rows)) + "\n")
    assert {it.id for it in load_prompt_set(GSM8KPrompts(path=str(path), n_eval=5)).eval} == {it.id for it in ps.eval}
    path.write_text('{"question": "q"}\n')
    with pytest.raises(PromptError, match=r"train.jsonl:1: .*'question' and 'answer'"):
        load_gsm8k_jsonl(path)


def test_step_prompts_are_deterministic_and_never_held_out():
    ps = load_prompt_set(SyntheticPrompts(ops=("copy", "add", "last"), n_eval=50))
    held = {it.id for it in ps.eval}
    a = prompts_for_step(ps.train, seed=3, step=5, n=16)
    assert a == prompts_for_step(ps.train, seed=3, step=5, n=16)
    assert a != prompts_for_step(ps.train, seed=3, step=6, n=16)
    assert len({it.id for it in a}) == 16
    drawn = {it.id for step in range(200) for it in prompts_for_step(ps.train, 3, step, 16)}
    assert not drawn & held
    assert len(synthetic_items(("copy", "add", "last"))) == 10 + 55 + 1000


def test_rubric_accuracy_and_format():
    rubric = LMRubric(accuracy=1.0, format=0.5)
    assert score_text("7", "7", rubric) == ("7", {"accuracy": 1.0, "format": 0.5})
    assert score_text("3 then 7 .", "7", rubric) == ("7", {"accuracy": 1.0, "format": 0.5})
    assert score_text("7 is it", "7", rubric) == ("7", {"accuracy": 1.0, "format": 0.0})
    assert score_text("8", "7", rubric) == ("8", {"accuracy": 0.0, "format": 0.5})
    assert score_text("what", "7", rubric) == (None, {"accuracy": 0.0, "format": 0.0})
