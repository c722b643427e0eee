"""Loading models from several threads at once: a tied-embedding model loads whole, tied, every time.

transformers 5 patches process-wide functions while it builds a model (`PreTrainedModel.tie_weights`
among them); two threads that build at once left `lm_head.weight` untied on the meta device, and
`tie_weights` a no-op for the rest of the process (dagster_rl.tasks.lm.model.build).
"""

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.modeling_utils import PreTrainedModel

from dagster_rl.base.errors import DagsterRLError
from dagster_rl.tasks.lm.model.build import check_whole
from dagster_rl.tasks.lm.model.policy import load_policy
from dagster_rl.tasks.lm.model.tokenizers import tiny_tokenizer
from dagster_rl.tasks.lm.settings import ATTENTION_AND_MLP, LoRASettings, PolicySettings

THREADS = 6


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    """A tiny Llama whose output embedding is its input embedding (as SmolLM2's and Qwen2.5-0.5B's are)."""
    tok = tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
    folder = tmp_path_factory.mktemp("tied") / "model"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_a_tied_model_loads_whole_from_several_threads_at_once(tied_dir):
    settings = PolicySettings(
        base_model=str(tied_dir), lora=LoRASettings(rank=4, alpha=8, target_modules=ATTENTION_AND_MLP, init_seed=3)
    )
    start = threading.Barrier(THREADS)
    loaded, errors = [], []

    def load():
        start.wait()
        try:
            loaded.append(load_policy(settings, device=torch.device("cpu")))
        except Exception as e:  # reported below, with the others
            errors.append(e)

    for _ in range(2):  # rounds: the race is a matter of timing
        threads = [threading.Thread(target=load) for _ in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, f"{len(errors)} of {2 * THREADS} loads failed: {errors[0]!r}"
    # transformers' temporary no-op is not left in place for the rest of the process
    assert PreTrainedModel.tie_weights.__name__ == "tie_weights"
    alone = load_policy(settings, device=torch.device("cpu"))
    embedding = alone.model.get_base_model().get_input_embeddings().weight
    adapter = dict(alone.trainable())
    for policy in loaded:
        base = policy.model.get_base_model()
        head, emb = base.get_output_embeddings().weight, base.get_input_embeddings().weight
        assert head.device.type == "cpu" and head is emb, "lm_head.weight must be the input embedding, loaded"
        assert torch.equal(emb, embedding)
        # LoRA A is drawn from its seed alone, whatever another thread built meanwhile
        assert all(torch.equal(p, adapter[n]) for n, p in policy.trainable())


def test_a_model_with_a_weight_on_the_meta_device_is_refused(tied_dir):
    model = AutoModelForCausalLM.from_pretrained(tied_dir)
    check_whole(model, "whole")
    model.lm_head.weight = torch.nn.Parameter(torch.empty_like(model.lm_head.weight, device="meta"))
    with pytest.raises(DagsterRLError, match="meta device"):
        check_whole(model, "broken")
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.new_zeros(model.lm_head.weight.shape, device="cpu"))
    with pytest.raises(DagsterRLError, match="two tensors"):
        check_whole(model, "untied")
