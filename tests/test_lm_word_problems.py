"""GSM8K-format word problems written in code, the tokenizer that reads them, and chat-template prompts."""

import json
import re

import pytest
from transformers import AutoTokenizer

from dagster_rl.tasks.lm.data.prompts import (
    GSM8KPrompts,
    PromptItem,
    encode_prompt,
    extract_answer,
    load_gsm8k_jsonl,
    load_prompt_set,
    render,
)
from dagster_rl.tasks.lm.data.word_problems import resolve_dataset, vocabulary, word_problems, write_jsonl
from dagster_rl.tasks.lm.model.tiny import resolve_model
from dagster_rl.tasks.lm.model.tokenizers import IM_END, IM_START


def test_problems_are_gsm8k_format_multi_step_and_a_pure_function_of_the_seed(tmp_path):
    problems = word_problems(300, seed=0)
    assert problems == word_problems(300, seed=0) and problems != word_problems(300, seed=1)
    assert len({p["question"] for p in problems}) == 300
    for p in problems:
        reasoning, final = p["answer"].rsplit("\n", 1)
        assert re.fullmatch(r"#### \d+", final), p
        # every equation of the reasoning is right, and the last one's result is the final answer
        equations = re.findall(r"(\d+) ([-+*]) (\d+) = (\d+)", reasoning)
        assert equations, p
        for a, op, b, c in equations:
            assert eval(f"{a} {op} {b}") == int(c), p
            assert 1 <= int(c) <= 16, p  # small numbers (operands up to 5 by default), no zeros
        assert equations[-1][3] == final[5:]
        assert extract_answer(p["answer"]) == final[5:]
    assert any(len(re.findall(" = ", p["answer"])) == 2 for p in problems)  # two-step problems are there
    largest = {m: max(int(n) for p in word_problems(300, 0, m) for n in re.findall(r"\d+", p["question"])) for m in (5, 9)}
    assert largest[5] <= 9 < largest[9]  # max_operand sets the difficulty
    path = write_jsonl(tmp_path / "wp.jsonl", 50, seed=3)
    items = load_gsm8k_jsonl(path)
    assert [it.reference for it in items] == [p["answer"].rsplit("#### ", 1)[1] for p in word_problems(50, 3)]
    assert json.loads(path.read_text().splitlines()[0]).keys() == {"question", "answer"}


def test_builtin_data_set_is_written_once_and_loads_as_gsm8k(monkeypatch, tmp_path):
    monkeypatch.setenv("DAGSTER_RL_DATA_CACHE", str(tmp_path / "data"))
    path = resolve_dataset("builtin:word-problems")
    assert path == str(tmp_path / "data" / "word-problems.jsonl")
    stamp = (tmp_path / "data" / "word-problems.jsonl").stat().st_mtime_ns
    assert (
        resolve_dataset("builtin:word-problems") == path
        and (tmp_path / "data" / "word-problems.jsonl").stat().st_mtime_ns == stamp
    )
    ps = load_prompt_set(GSM8KPrompts(path="builtin:word-problems", n_eval=100))
    assert len(ps.train) == 1900 and len(ps.eval) == 100
    assert resolve_dataset("/some/file.jsonl") == "/some/file.jsonl"
    with pytest.raises(ValueError, match="no built-in data set 'nope'"):
        resolve_dataset("builtin:nope")


@pytest.fixture(scope="module")
def gsm8k_tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model("builtin:tiny-qwen2-gsm8k"))


def test_the_gsm8k_tokenizer_has_one_token_per_word_and_reads_back_every_problem(gsm8k_tokenizer):
    tok = gsm8k_tokenizer
    for word in vocabulary():
        assert len(tok(f" {word}")["input_ids"]) == 1, word
    for p in word_problems(200, seed=5):
        for text in (p["question"], p["answer"]):
            assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.eos_token == IM_END and tok.decode(tok("12")["input_ids"]) == "12"
    assert tok.decode(tok("unseen wörds 🙂")["input_ids"]) == "unseen wörds 🙂"  # byte-level: nothing is lost


def test_prompts_use_the_chat_template_when_the_tokenizer_has_one(gsm8k_tokenizer):
    item = PromptItem(id="q", question="Tom has 3 pens. How many pens does Tom have now?", reference="3")
    ids = encode_prompt(gsm8k_tokenizer, item, "Question: {question}\nAnswer:")
    expected = gsm8k_tokenizer.apply_chat_template(
        [{"role": "user", "content": item.question}], add_generation_prompt=True, tokenize=False
    )
    assert gsm8k_tokenizer.decode(ids) == expected == f"{IM_START}user\n{item.question}{IM_END}\n{IM_START}assistant\n"
    assert gsm8k_tokenizer.convert_ids_to_tokens(ids[0]) == IM_START  # a special token, not its characters
    assert "Question:" not in gsm8k_tokenizer.decode(ids)


def test_prompts_use_the_plain_template_without_a_chat_template():
    tok = AutoTokenizer.from_pretrained(resolve_model("builtin:tiny-qwen2"))
    assert not tok.chat_template
    item = PromptItem(id="c", question="copy 7 :", reference="7")
    ids = encode_prompt(tok, item, "what is the answer ? {question}")
    assert ids == tok(render(item, "what is the answer ? {question}"))["input_ids"]
    assert tok.decode(ids) == "what is the answer ? copy 7 :"
