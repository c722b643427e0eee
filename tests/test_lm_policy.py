"""The tiny model, the initial policy, and checkpoints that resume training bit for bit."""

import torch
from safetensors.torch import load as load_safetensors
from transformers import AutoModelForCausalLM, AutoTokenizer

from dagster_rl.lm.policy import ADAPTER, OPTIMIZER, checkpoint_bytes, load_checkpoint, make_optimizer, read_state, save_checkpoint
from dagster_rl.lm.tiny import tiny_model
from dagster_rl.lm.trainer import build_samples, train_step
from tests.lm_fixtures import GRPO, fresh_policy, step_batch, tiny_dir  # noqa: F401


def test_tiny_model_is_a_normal_hf_folder(tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    text = "what is 3 + 4 ? the answer is #### 12"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert len(tok) == 68 and tok.convert_ids_to_tokens(tok.pad_token_id) == "<pad>"
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 64
    same = tiny_model(seed=0).state_dict()
    assert all(torch.equal(v, same[k]) for k, v in model.state_dict().items())


def test_initial_policy_is_the_base(tiny_dir):
    policy = fresh_policy(tiny_dir)
    assert policy.version == 0
    lora_b = [p for n, p in policy.trainable() if "lora_B" in n]
    assert lora_b and all(torch.count_nonzero(p) == 0 for p in lora_b)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        adapted = policy.model(input_ids=ids).logits
        with policy.model.disable_adapter():
            base = policy.model(input_ids=ids).logits
    assert torch.equal(adapted, base)
    # the LoRA init is seeded: a second load draws the same A
    again = dict(fresh_policy(tiny_dir).trainable())
    assert all(torch.equal(p, again[n]) for n, p in policy.trainable())


def _train(policy, optimizer, step):
    rollouts, rewards = step_batch(policy, step)
    samples, facts = build_samples(rollouts, rewards, GRPO.advantage_eps)
    return train_step(policy, optimizer, samples, len(samples), GRPO, facts)


def test_checkpoint_resumes_bit_identically(tiny_dir, tmp_path):
    policy = fresh_policy(tiny_dir)
    optimizer = make_optimizer(policy, GRPO)
    _train(policy, optimizer, step=0)
    saved = save_checkpoint(tmp_path / "v1", checkpoint_bytes(policy, optimizer))
    m_straight = _train(policy, optimizer, step=1)
    straight = checkpoint_bytes(policy, optimizer)

    files = load_checkpoint(saved)
    assert read_state(files)["version"] == 1
    moments = load_safetensors(files[OPTIMIZER])
    assert moments and all(float(v) == 1.0 for k, v in moments.items() if k.endswith("::step"))
    resumed_policy = fresh_policy(tiny_dir, files)
    resumed_opt = make_optimizer(resumed_policy, GRPO, files)
    m_resumed = _train(resumed_policy, resumed_opt, step=1)
    resumed = checkpoint_bytes(resumed_policy, resumed_opt)

    assert m_resumed == m_straight
    assert resumed == straight  # adapter, optimizer, state: byte for byte
    before = load_safetensors(files[ADAPTER])
    after = load_safetensors(straight[ADAPTER])
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the step did move the adapter
