"""Prompt sets, answer extraction and the rubric."""

import json

import pytest

from dagster_rl.lm.rewards import LMRubric, score_text
from dagster_rl.lm.prompts import (
    GSM8KPrompts,
    SyntheticPrompts,
    PromptError,
    extract_answer,
    extract_reference,
    load_gsm8k_jsonl,
    load_prompt_set,
    prompts_for_step,
    synthetic_items,
)


def test_answer_extraction():
    assert extract_reference("She pays 3 * 4 = 12.\n#### 1,234") == "1234"
    assert extract_reference("... #### -7.50") == "-7.5"
    assert extract_answer("so 3 + 4 = 7, and then 1,250 apples.") == "1250"
    assert extract_answer("the answer is 42.0") == "42"
    assert extract_answer("no digits here") is None
    with pytest.raises(PromptError, match="####"):
        extract_reference("no marker 12")


def test_gsm8k_loader_and_heldout_split(tmp_path):
    path = tmp_path / "train.jsonl"
    rows = [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(20)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    items = load_gsm8k_jsonl(path)
    assert [it.reference for it in items] == [str(i + 1) for i in range(20)]
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
