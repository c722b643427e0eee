"""The tiny model, the initial policy, and checkpoints that resume training bit for bit."""

import pytest
import torch
from safetensors.torch import load as load_safetensors
from transformers import AutoModelForCausalLM, AutoTokenizer

from dagster_rl.tasks.lm.model.policy import (
    ADAPTER,
    OPTIMIZER,
    checkpoint_bytes,
    load_checkpoint,
    make_optimizer,
    read_state,
    save_checkpoint,
)
from dagster_rl.tasks.lm.model.tiny import save_tiny_model, tiny_model
from dagster_rl.tasks.lm.train.trainer import build_samples, train_step
from tests.lm_fixtures import GRPO, fresh_policy, step_batch


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


def test_the_agent_base_with_output_gain_is_the_agent_model_with_its_final_norm_at_8(tmp_path):
    """`tiny-qwen2-agent-gain8` (tiny_agent's base) is `tiny-qwen2-agent` but for the final norm's
    weight, 8: logits of its lm_head as drawn reach ~20 instead of ~2.5 (what an adapter that leaves
    lm_head alone needs to sample confidently), as a folder a server loads."""
    folder = save_tiny_model(tmp_path / "gain8", builtin="tiny-qwen2-agent-gain8")
    gained = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    plain = tiny_model(builtin="tiny-qwen2-agent").state_dict()
    assert gained.keys() == plain.keys()
    assert [k for k in plain if not torch.equal(plain[k], gained[k])] == ["model.norm.weight"]
    assert torch.equal(gained["model.norm.weight"], torch.full_like(plain["model.norm.weight"], 8.0))
    reach = {
        k: float(m["lm_head.weight"].norm(dim=1).max() * m["model.norm.weight"].abs().max()) * m["lm_head.weight"].shape[1] ** 0.5
        for k, m in (("plain", plain), ("gain8", gained))
    }
    assert reach["plain"] < 3.5 and reach["gain8"] > 20, reach  # the largest logit a unit-RMS hidden state can reach


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


def _experiment(tiny_dir):
    from dagster_rl.tasks.lm.experiment import LMExperiment
    from tests.lm_fixtures import policy_settings
    from tests.settings import shipped_settings

    raw = shipped_settings("tiny_grpo", policy=policy_settings(tiny_dir).model_dump(mode="json"), sampling={"max_new_tokens": 3})
    return LMExperiment.model_validate(raw)


def _count_base_loads(monkeypatch) -> list[str]:
    import dagster_rl.tasks.lm.model.policy as policy_module

    loads, load_base = [], policy_module.load_base
    monkeypatch.setattr(policy_module, "load_base", lambda *a, **kw: loads.append(a[0]) or load_base(*a, **kw))
    return loads


def test_in_process_trainer_keeps_the_base_loaded_and_trains_the_bytes_of_a_cold_start(tiny_dir, monkeypatch):
    from dagster_rl.tasks.lm.backends import LMTrainer

    exp = _experiment(tiny_dir)
    policy = fresh_policy(tiny_dir)
    initial = checkpoint_bytes(policy, None)
    batches = [step_batch(policy, step) for step in range(2)]  # the base's rollouts: stale for step 1, as under lag
    loads = _count_base_loads(monkeypatch)
    warm = LMTrainer()
    v1, m1 = warm.train(exp, initial, *batches[0])
    v2, m2 = warm.train(exp, v1, *batches[1])
    assert len(loads) == 1  # the base read once for both steps
    assert (m1.version, m2.version) == (1, 2) and m2.ratio != 1.0
    cold = LMTrainer()  # a fresh process's trainer: loads the base for step 1
    assert cold.train(exp, v1, *batches[1]) == (v2, m2)  # bytes and metrics
    assert len(loads) == 2


def _weights(files: dict[str, bytes]):
    """Stored weights as a rollout backend receives them (the HF backend reads only the payload)."""
    from dagster_rl.core.task import Weights
    from dagster_rl.store.artifact_store import ArtifactRef
    from dagster_rl.tasks.lm.model.policy import checkpoint_hash, read_state

    ref = ArtifactRef(kind="weights", key="0" * 64, content_hash=checkpoint_hash(files), uri="memory://")
    return Weights("test", ref, files, read_state(files)["version"])


def test_generation_recycles_loaded_policies_into_the_bytes_of_fresh_ones(tiny_dir, monkeypatch):
    from dagster_rl.tasks.lm.backends import HFRollouts
    from dagster_rl.tasks.lm.data.prompts import SyntheticPrompts, load_prompt_set, prompts_for_step
    from dagster_rl.tasks.lm.records import plan_requests

    exp = _experiment(tiny_dir)
    policy = fresh_policy(tiny_dir)
    optimizer = make_optimizer(policy, GRPO)
    checkpoints = [checkpoint_bytes(policy, None)]
    for step in range(2):
        _train(policy, optimizer, step)
        checkpoints.append(checkpoint_bytes(policy, optimizer))
    prompts = load_prompt_set(SyntheticPrompts(ops=("copy", "add")))
    requests = plan_requests(prompts_for_step(prompts.train, 0, 5, 4), 0, 5, 4)
    loads = _count_base_loads(monkeypatch)
    behaviors = [_weights(files) for files in checkpoints]
    cached = HFRollouts()  # keeps 2 policies: v2 reloads into v0's, then v0 into v1's
    outcomes = [cached.generate(exp, requests, behaviors[v], prompts.template) for v in (0, 1, 2, 0, 2)]
    assert len(loads) == 2
    for v, got in zip((0, 1, 2, 0, 2), outcomes, strict=True):
        assert got == HFRollouts().generate(exp, requests, behaviors[v], prompts.template), v
        assert {r.behavior_version for r in got} == {v}
    assert outcomes[0] != outcomes[1] != outcomes[2]


@pytest.mark.numerics
def test_sampling_folds_the_adapter_into_copies_and_puts_the_base_back_bit_for_bit(tiny_dir):
    policy = fresh_policy(tiny_dir)
    optimizer = make_optimizer(policy, GRPO)
    _train(policy, optimizer, step=0)  # LoRA B != 0: the fold changes the weights
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    params = dict(policy.model.named_parameters())
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    policy.mode(training=False)
    with torch.no_grad():
        unfolded = policy.model(input_ids=ids).logits
        with policy.merged() as model:
            folded = model(input_ids=ids).logits
            assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters() if "base_layer" in n)
    assert not torch.equal(folded, unfolded)  # another computation ...
    torch.testing.assert_close(folded, unfolded, rtol=0, atol=1e-5)  # ... of the same logits
    after = dict(policy.model.named_parameters())
    assert after.keys() == before.keys() and all(after[n] is params[n] and torch.equal(after[n], before[n]) for n in before)
    with torch.no_grad():
        assert torch.equal(policy.model(input_ids=ids).logits, unfolded)
    policy.mode(training=True)  # a training model is never folded (dropout, if any, acts on the adapter)
    with policy.merged() as model:
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    from dagster_rl.tasks.lm.model.policy import load_policy
    from tests.lm_fixtures import policy_settings

    bf16 = load_policy(policy_settings(tiny_dir).model_copy(update={"dtype": "bfloat16"}), checkpoint_bytes(policy, None))
    weights = {n: p for n, p in bf16.model.named_parameters()}
    with bf16.merged() as model:  # bfloat16 would round the delta away: the adapter stays apart
        assert all(p is weights[n] for n, p in model.named_parameters())


def test_a_lora_rank_above_the_models_hidden_size_is_refused_when_it_loads(tiny_dir):
    """Finding 5 of issue 20: sizes multiply (rank x hidden); the file's bound (16,384) cannot know the model."""
    import pytest

    from dagster_rl.base.errors import DagsterRLError
    from dagster_rl.tasks.lm.model.policy import load_policy
    from dagster_rl.tasks.lm.settings import LoRASettings, PolicySettings

    settings = PolicySettings(base_model=str(tiny_dir), lora=LoRASettings(rank=65, alpha=65.0))
    with pytest.raises(DagsterRLError, match="policy.lora.rank 65 is more than the base model's hidden size 64: .* at most 64"):
        load_policy(settings)
    assert load_policy(settings.model_copy(update={"lora": LoRASettings(rank=64, alpha=64.0)})).version == 0
