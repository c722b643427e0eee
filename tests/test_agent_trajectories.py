"""A multi-turn trajectory is one token sequence with a mask, trained on its sampled tokens only.

- token in, token out: an episode keeps the ids the model sampled as they were sampled, never the
  text re-encoded, and frames each observation with the chat template's turn markers (mask 0);
- single-turn completions are the all-ones mask: packing and the GRPO step compute exactly the same
  numbers as without a mask;
- with observations masked out, the trainer's log-probs of the sampled tokens are the ones of the
  whole sequence's forward at those positions, and the sampler's log-probs of every turn agree with
  them (the on_policy check covers every turn);
- the trainer's batch file carries trajectories and completions alike (what torchrun workers read);
- `instructions` put the tools' description ahead of the first observation (off: today's text and keys), and
  SmolLM2's ChatML template (a default system turn, eos == pad) frames a trajectory as it writes the conversation.
"""

import copy
import dataclasses
import tempfile
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from dagster_rl.core.experiment_files import parse_experiment
from dagster_rl.tasks.agent.chat import ChatTurns
from dagster_rl.tasks.agent.environment import World
from dagster_rl.tasks.agent.episode import Episode
from dagster_rl.tasks.agent.grading import AgentGrading
from dagster_rl.tasks.agent.judge import AgentRubric, judge
from dagster_rl.tasks.agent.records import AgentTrajectory
from dagster_rl.tasks.agent.rollout_hf import run_episodes
from dagster_rl.tasks.agent.text_world import INSTRUCTIONS, SPEC, Contents, SecretSearchTextSettings
from dagster_rl.tasks.agent.tiny import agent_tokenizer
from dagster_rl.tasks.agent.trial_sandbox import TrialSandbox
from dagster_rl.tasks.lm.model.logprobs import pack, packed_logprobs
from dagster_rl.tasks.lm.model.policy import ADAPTER, checkpoint_bytes, make_optimizer
from dagster_rl.tasks.lm.settings import SamplingSettings
from dagster_rl.tasks.lm.train.entrypoint import TrainBatch
from dagster_rl.tasks.lm.train.grpo_loss import grpo_batch_loss, grpo_sample_loss
from dagster_rl.tasks.lm.train.trainer import TrainSample, _pack, build_samples, train_step
from tests.agent_fixtures import ChatterSettings, busy_policy, request, stage_of
from tests.lm_fixtures import GRPO, ON_POLICY_ROUNDING, fresh_policy, step_batch
from tests.settings import shipped_settings

WORLD = SecretSearchTextSettings(n_docs=4, titles=4, digest_chars=6)


@pytest.fixture(scope="module")
def agent_policy():
    return busy_policy()


def test_an_episode_keeps_the_sampled_ids_and_frames_observations_in_turn_markers(tmp_path):
    tok = agent_tokenizer()
    chat = ChatTurns.of(tok)
    r = request(0)
    contents = Contents(WORLD, World(r.world_id, r.world_seed))
    episode = Episode(r, stage_of(WORLD, chat, tmp_path))
    assert (
        tok.decode(episode.prompt_ids)
        == f"<|im_start|>user\nfind {contents.clue}\ndocs: {' '.join(contents.titles)}<|im_end|>\n<|im_start|>assistant\n"
    )
    # "open <clue>" sampled letter by letter: the same text as the tokenizer's one "open" token, other ids
    spelled = (
        [tok.convert_tokens_to_ids(c) for c in "open"]
        + tok(f" {contents.clue}", add_special_tokens=False)["input_ids"]
        + [tok.eos_token_id]
    )
    canonical = tok(f"open {contents.clue}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert spelled != canonical and tok.decode(spelled, skip_special_tokens=True) == tok.decode(
        canonical, skip_special_tokens=True
    )
    episode.advance(spelled, [-0.5] * len(spelled), "stop")
    answer = tok(f"answer {contents.digest}", add_special_tokens=False)["input_ids"]  # cut by the token budget: no eos
    episode.advance(answer, [-0.25] * len(answer), "length")
    t = episode.trajectory(1.0, 1.0, 0)
    episode.close()
    assert not any(f for owner in tmp_path.iterdir() for f in owner.iterdir()), "the trial's folder outlived its episode"

    assert t.completion_token_ids[: len(spelled)] == spelled  # as sampled, not re-encoded
    observation = t.completion_token_ids[t.turns[0].action_end : t.turns[0].observation_end]
    assert tok.decode(observation) == f"\n<|im_start|>user\ndigest {contents.digest}<|im_end|>\n<|im_start|>assistant\n"
    assert t.completion_mask == [1] * len(spelled) + [0] * len(observation) + [1] * len(answer)
    assert t.sampling_logprobs == [-0.5] * len(spelled) + [-0.25] * len(answer)
    assert [(x.tool, x.argument, x.finish_reason) for x in t.turns] == [
        ("open", contents.clue, "stop"),
        ("answer", contents.digest, "length"),
    ]
    assert t.end_reason == "answered" and t.success and t.verdict["first_open_right"]
    assert t.token_ids == [*t.prompt_token_ids, *t.completion_token_ids] and len(t.mask) == len(t.token_ids)
    reward = judge(t, AgentRubric(correctness=1.0, efficiency=1.0), max_turns=3)
    assert reward.correct and reward.turns == 2 and reward.reward == pytest.approx(1.0 + 2 / 3)
    # the LLM judge reads the episode as text and grades its efficiency; the environment decides success
    exp = parse_experiment(shipped_settings("tiny_agent", rubric={"correctness": 1.0, "efficiency": 0.5}))
    messages = AgentGrading().messages(exp, t)
    assert "efficiency 0.5" in messages[0]["content"] and messages[1]["content"].endswith(
        f"First observation:\nfind {contents.clue}\ndocs: {' '.join(contents.titles)}\n\n"
        f"Turn 1 action: open {contents.clue}\nTurn 1 observation: digest {contents.digest}\n"
        f"Turn 2 action: answer {contents.digest}\n\nEnded: answered; succeeded: yes"
    )
    graded = AgentGrading().reward(exp, t, 0.4)
    assert graded.components == {"correctness": 1.0, "llm": 0.4} and graded.reward == pytest.approx(1.0 + 0.5 * 0.4)


def test_the_environment_reads_only_its_folder_and_ends_on_a_bad_action(tmp_path):
    chat = ChatTurns.of(agent_tokenizer())
    episodes = [Episode(request(i), stage_of(WORLD, chat, tmp_path)) for i in range(2)]
    assert episodes[0].folder != episodes[1].folder and all(e.folder.parent.parent == tmp_path for e in episodes)
    (tmp_path / "secret.txt").write_text("digest 000000")  # beside the trials' folders: no action reaches it
    for action in ("open ../secret", "open secret", "next please", "delete memo", ""):
        env = SPEC.make(WORLD, World("t0.0", 1), 0, TrialSandbox(Path(tempfile.mkdtemp(dir=tmp_path)), None, "t"))
        outcome = env.step(action)
        assert outcome.done and outcome.end_reason == "bad_action" and outcome.observation == "", action
    for e in episodes:
        e.close()


def test_single_turn_completions_are_the_all_ones_mask_bit_for_bit(tiny_dir):
    """The masked packing and GRPO step are today's numbers when every completion token is sampled."""
    rollouts, rewards = step_batch(fresh_policy(tiny_dir), step=0, prompts=3, samples=3)
    samples, facts = build_samples(rollouts, rewards, GRPO.advantage_eps)
    ones = [dataclasses.replace(s, mask=[1] * len(s.completion_ids)) for s in samples]
    plain = pack([s.prompt_ids for s in samples], [s.completion_ids for s in samples], [1.0] * len(samples), 0, "cpu")
    masked = pack(
        [s.prompt_ids for s in samples],
        [s.completion_ids for s in samples],
        [1.0] * len(samples),
        0,
        "cpu",
        masks=[s.mask for s in ones],
    )
    for field in ("input_ids", "attention_mask", "predicts", "targets", "completion_mask", "temperature"):
        assert torch.equal(getattr(plain, field), getattr(masked, field)), field

    results = []
    for batch in (samples, ones):
        policy = fresh_policy(tiny_dir)
        optimizer = make_optimizer(policy, GRPO)
        grads = {}
        metrics = train_step(policy, optimizer, batch, len(batch), GRPO, facts, on_grads=grads.update)
        results.append((metrics, grads, checkpoint_bytes(policy, optimizer)[ADAPTER]))
    (m0, g0, a0), (m1, g1, a1) = results
    assert m0 == m1
    assert all(torch.equal(g0[k], g1[k]) for k in g0) and a0 == a1


def test_masked_observations_are_context_not_loss(tiny_dir):
    """A completion with tokens masked out: its sampled tokens' log-probs are those of the unmasked
    sequence at the same positions, and its GRPO loss and gradient are the per-sample loss over
    exactly those tokens (the observation tokens get no term)."""
    policy = fresh_policy(tiny_dir)
    prompt, completion = [5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]
    mask = [1, 1, 0, 0, 0, 1, 1, 0]
    sampled = torch.tensor(mask, dtype=torch.bool)
    full = packed_logprobs(policy.model, pack([prompt], [completion], [1.0], 0, "cpu"))[0]
    batch = pack([prompt], [completion], [1.0], 0, "cpu", masks=[mask])
    assert int(batch.predicts.sum()) == sum(mask)  # logits only where a sampled token is predicted
    masked = packed_logprobs(policy.model, batch)[0]
    assert torch.allclose(masked[sampled], full[sampled], atol=1e-6, rtol=0) and bool((masked[~sampled] == 0).all())

    old = full[sampled].detach() - 0.1  # a stale behavior policy: ratio != 1
    ref = full[sampled].detach() + 0.05
    sample = TrainSample("t", prompt, completion, old.tolist(), 1.0, 0.7, mask)
    policy.model.zero_grad()
    with torch.enable_grad():
        new = packed_logprobs(policy.model, pack([prompt], [completion], [1.0], 0, "cpu", masks=[mask]))[0][sampled]
        expected, _ = grpo_sample_loss(new, old, ref, sample.advantage, 0.2, 0.04)
        expected.backward()
    want = {n: p.grad.clone() for n, p in policy.trainable()}
    policy.model.zero_grad()
    b, old_padded, adv = _pack([sample], 0, torch.device("cpu"))
    assert torch.equal(old_padded[0][sampled], old) and bool((old_padded[0][~sampled] == 0).all())
    new_padded = packed_logprobs(policy.model, b)
    ref_padded = torch.zeros_like(new_padded).masked_scatter(b.completion_mask, ref)
    loss, _ = grpo_batch_loss(new_padded, old_padded, ref_padded, b.completion_mask, adv, 0.2, 0.04)
    loss.sum().backward()
    assert float(loss.detach()[0]) == pytest.approx(float(expected.detach()), abs=1e-6)
    for name, p in policy.trainable():
        assert torch.allclose(p.grad, want[name], atol=1e-6, rtol=1e-5), name


@pytest.mark.numerics
def test_every_turns_sampled_log_probs_are_the_trainers(agent_policy, tmp_path):
    """Episodes batched by turn: the trainer's log-prob of every sampled id of every turn (one packed
    forward of the whole trajectory, observations masked) equals the sampler's to float rounding."""
    requests = [request(i) for i in range(6)]
    sampling = SamplingSettings(temperature=1.0, max_new_tokens=6)
    chatter = stage_of(ChatterSettings(), ChatTurns.of(agent_policy.tokenizer), tmp_path)
    outcomes = run_episodes(agent_policy, requests, chatter, sampling)
    trajectories = [o for o in outcomes if isinstance(o, AgentTrajectory)]
    assert len(trajectories) == 6 and not any(f for owner in tmp_path.iterdir() for f in owner.iterdir())
    assert all(len(t.turns) == 3 and t.end_reason == "turn_budget" for t in trajectories)
    assert len({len(t.completion_token_ids) for t in trajectories}) > 1  # turns of other lengths: rows padded apart
    agent_policy.mode(training=False)
    with torch.no_grad():
        batch = pack(
            [t.prompt_token_ids for t in trajectories],
            [t.completion_token_ids for t in trajectories],
            [1.0] * 6,
            0,
            "cpu",
            masks=[t.completion_mask for t in trajectories],
        )
        trained = packed_logprobs(agent_policy.model, batch)
    worst = max(
        float((trained[i][batch.completion_mask[i]] - torch.tensor(t.sampling_logprobs)).abs().max())
        for i, t in enumerate(trajectories)
    )
    assert worst < ON_POLICY_ROUNDING, worst
    again = run_episodes(agent_policy, requests[3:], chatter, sampling)
    assert [t.completion_token_ids for t in again] == [
        t.completion_token_ids for t in trajectories[3:]
    ]  # a retry replays its turns


def test_the_trainers_batch_file_carries_trajectories_and_completions(tiny_dir, tmp_path):
    chat = ChatTurns.of(agent_tokenizer())
    episode = Episode(request(0), stage_of(WORLD, chat, tmp_path, max_turns=1))
    episode.advance([chat.eos_id], [-1.0], "stop")  # an empty action: a bad one, the episode ends
    trajectory = episode.trajectory(1.0, 1.0, 0)
    episode.close()
    assert trajectory.end_reason == "bad_action" and not trajectory.success
    reward = judge(trajectory, AgentRubric(), 1)
    rollouts, rewards = step_batch(fresh_policy(tiny_dir), step=0, prompts=1, samples=2)
    batch = TrainBatch(rollouts=[*rollouts, trajectory], rewards=[*rewards, reward])
    read = TrainBatch.model_validate_json(batch.model_dump_json())
    assert [type(r).__name__ for r in read.rollouts] == ["LMRollout", "LMRollout", "AgentTrajectory"]
    assert [type(r).__name__ for r in read.rewards] == ["LMReward", "LMReward", "AgentReward"]
    assert read == batch and copy.deepcopy(read.rollouts[-1]) == trajectory


def test_instructions_head_the_first_observation_only_when_asked(tmp_path):
    plain = SPEC.make(WORLD, World("e0", 5), 0, TrialSandbox(tmp_path, None, "e0"))
    contents = Contents(WORLD, World("e0", 5))
    assert plain.reset() == f"find {contents.clue}\ndocs: {' '.join(contents.titles)}"
    assert "instructions" not in WORLD.model_dump(mode="json")  # off: every key that holds the settings is as without it
    told = WORLD.model_copy(update={"instructions": True})
    assert told.model_dump(mode="json")["instructions"] is True
    assert SPEC.make(told, World("e0", 5), 0, TrialSandbox(tmp_path, None, "e0")).reset() == f"{INSTRUCTIONS}\n\n{plain.reset()}"


def test_smollm2s_chat_template_frames_a_trajectory_as_it_writes_the_conversation(smollm2_dir, tmp_path):
    """ChatML with a default system turn, and eos == pad == <|im_end|>: the ids of a trajectory grown turn by
    turn are the ids of the conversation as the tokenizer's own template writes it."""
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    chat = ChatTurns.of(tok)
    assert chat.eos_id == tok.pad_token_id == 2 and tok.decode(chat.turn_end) == "<|im_end|>\n"
    told = WORLD.model_copy(update={"instructions": True})
    episode = Episode(request(0), stage_of(told, chat, tmp_path))
    contents = Contents(told, World(request(0).world_id, request(0).world_seed))
    action = [*tok(f"open {contents.clue}", add_special_tokens=False)["input_ids"], chat.eos_id]
    episode.advance(action, [0.0] * len(action), "stop")
    conversation = [
        {"role": "user", "content": episode.first_observation},
        {"role": "assistant", "content": f"open {contents.clue}"},
        {"role": "user", "content": f"digest {contents.digest}"},
    ]
    text = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n") and INSTRUCTIONS in text
    assert episode.ids == tok(text, add_special_tokens=False)["input_ids"]
    episode.close()
