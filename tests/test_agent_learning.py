"""The language-model agent end to end through the driver: the shipped `tiny_agent` warms up on its
environment's demonstrations, then GRPO over whole trajectories makes it open the document the clue
names first, on held-out worlds: success rises and mean turns fall after the warm-up."""

from statistics import fmean

import pytest

from dagster_rl.core.experiment import step_key
from dagster_rl.core.records import Rewards, Rollouts
from dagster_rl.tasks.agent.records import AgentReward, AgentTrajectory
from dagster_rl.tasks.lm.model.tokenizers import IM_START
from tests.lm_fixtures import ON_POLICY_ROUNDING
from tests.settings import shipped_settings

AGENT_LAST, AGENT_RISE, AGENT_FALL = 4, 0.4, 0.5  # see test_held_out_success_rises_and_turns_fall_after_the_warm_up
STEPS = [step_key(i) for i in range(shipped_settings("tiny_agent")["n_steps"])]


@pytest.fixture(scope="module")
def curve(tmp_path_factory):
    """The shipped experiment, its warm-up and all its steps, through the driver."""
    from tests.harness import new_dagster_home, open_lab
    from tests.settings import write_experiments

    home = new_dagster_home(tmp_path_factory.mktemp("agent") / "home")
    lab = open_lab(home, write_experiments(home / "experiments", shipped_settings("tiny_agent")))
    assert lab.run("tiny_agent", STEPS[0], STEPS[-1]).success
    yield lab
    lab.close()


def test_trajectories_are_token_sequences_with_their_turns(curve):
    """Step 0's rollouts: one trajectory per trial, the chat template's turns, the mask on the model's
    ids, the sampler's log-prob per sampled id, a tool call per turn; judged by success and turns."""
    from transformers import AutoTokenizer

    from dagster_rl.tasks.lm.model.tiny import resolve_model

    exp = curve.experiments["tiny_agent"]
    store = curve.store()
    rollouts = store.get_model(
        "rollouts", curve.latest("tiny_agent", "rollouts", STEPS[0])["artifact_key"], Rollouts[AgentTrajectory]
    )
    rewards = store.get_model("rewards", curve.latest("tiny_agent", "rewards", STEPS[0])["artifact_key"], Rewards[AgentReward])
    assert len(rollouts.trajectories) == exp.n_trials_planned and rollouts.behavior_policy["partition"] == "sft"
    tok = AutoTokenizer.from_pretrained(resolve_model(exp.policy.base_model))
    for t in rollouts.trajectories:
        assert tok.decode(t.prompt_token_ids).startswith(f"{IM_START}user\nfind ") and len(t.sampling_logprobs) == sum(
            t.completion_mask
        )
        assert 1 <= len(t.turns) <= exp.task.episode.max_turns and t.turns[0].action_start == 0
        for turn, following in zip(t.turns, t.turns[1:], strict=False):  # between two actions: the observation, mask 0
            between = t.completion_token_ids[turn.action_end : turn.observation_end]
            assert (
                tok.decode(between).endswith(f"{turn.observation}<|im_end|>\n{IM_START}assistant\n")
                and following.action_start == turn.observation_end
            )
            assert t.completion_mask[turn.action_start : turn.action_end] == [1] * (turn.action_end - turn.action_start)
            assert set(t.completion_mask[turn.action_end : turn.observation_end]) == {0}
    tools = {turn.tool for t in rollouts.trajectories for turn in t.turns}
    assert {"next", "open", "answer"} <= tools  # the warm-up browses, opens the clue's document now and then, answers
    by_trial = {t.trial_id: t for t in rollouts.trajectories}
    for r in rewards.rewards:
        t = by_trial[r.trial_id]
        assert r.correct == (t.verdict["answer"] == t.verdict["digest"]) and r.turns == len(t.turns)
        assert r.reward == pytest.approx(
            (1.0 + (exp.task.episode.max_turns - r.turns + 1) / exp.task.episode.max_turns) if r.correct else 0.0
        )
    # every turn of every step sampled by the policy the trainer scores, to float32 rounding (the tiny models'
    # ON_POLICY_ROUNDING, 1e-4; the check's own bound is 1e-3): at most 1.8e-5 measured over the 12 steps
    devs = {}
    for step in STEPS:
        md = curve.latest("tiny_agent", "weights", step)
        devs[step] = md["logp_max_dev"]
        assert md["policy_lag"] == 0.0 and md["logp_max_dev"] < ON_POLICY_ROUNDING, (step, md["logp_max_dev"])
    print(f"\nlogp_max_dev per step (hf, in process): {', '.join(f'{d:.1e}' for d in devs.values())}")
    assert all(e.passed for e in curve.check_evaluations("tiny_agent", "on_policy"))


@pytest.mark.numerics
def test_held_out_success_rises_and_turns_fall_after_the_warm_up(curve, record_property):
    """Greedy episodes on 64 held-out worlds no step trains on: over the last 4 of the shipped 12 steps,
    success is at least 0.4 above the warm-up's and mean turns at least 0.5 below, on every CPU kernel
    setting.

    Measured with bench/agent_curves.py (docs/agents.md) over seeds 0-2 on the three kernel settings:
    all 9 runs learn, rises of 0.438-0.730 and falls of 0.738-0.875 turns; the shipped seed (2) is the
    lowest of the three seeds (0.461 native AVX-512, 0.465 avx2, 0.438 default; falls 0.738-0.746;
    0.516-0.535 before turns continued their KV cache). The margins sit below the weakest of the 9
    runs (the rise's by 0.038: 10 of the 256 episodes of 4 evaluations) and far above what the
    warm-up's own greedy policy reaches (0.23-0.31, what browsing within 3 turns gives)."""
    sft = curve.latest("tiny_agent", "sft", None)
    success = [curve.latest("tiny_agent", "evaluation", s)["success"] for s in STEPS]
    turns = [curve.latest("tiny_agent", "evaluation", s)["mean_turns"] for s in STEPS]
    last_success, last_turns = fmean(success[-AGENT_LAST:]), fmean(turns[-AGENT_LAST:])
    record_property("warmup", f"{sft['success']:.3f} success, {sft['mean_turns']:.3f} turns")
    record_property(f"last{AGENT_LAST}", f"{last_success:.3f} success, {last_turns:.3f} turns")
    assert sft["base_success"] == 0.0 and sft["success"] < 0.5, (
        sft
    )  # the warm-up browses: it succeeds when the digest is near the top
    assert last_success >= sft["success"] + AGENT_RISE, (sft["success"], success)
    assert last_turns <= sft["mean_turns"] - AGENT_FALL, (sft["mean_turns"], turns)


def test_status_shows_success_and_mean_turns_per_step(curve, monkeypatch, capsys):
    from assets.cli import main

    monkeypatch.setenv("DAGSTER_HOME", str(curve.home))
    monkeypatch.setenv("DAGSTER_RL_EXPERIMENTS", str(curve.home / "experiments"))
    main(["status", "tiny_agent"])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"experiment tiny_agent: {len(STEPS)} of {len(STEPS)} steps materialized"
    assert out[1].split() == [
        "step",
        "state",
        "cache",
        "trials",
        "mean_reward",
        "success",
        "heldout_success",
        "mean_turns",
        "weights_v",
        "attempt",
    ]
    rows = {line.split()[0]: line.split() for line in out[2:]}
    sft = curve.latest("tiny_agent", "sft", None)
    assert rows["sft"] == ["sft", "materialized", sft["cache"], f"{sft['success']:.3g}", f"{sft['mean_turns']:.3g}", "0"]
    for step in STEPS:
        weights, evaluation = curve.latest("tiny_agent", "weights", step), curve.latest("tiny_agent", "evaluation", step)
        assert rows[step][5:8] == [
            f"{weights['success_rate']:.2f}",
            f"{evaluation['success']:.3g}",
            f"{weights['mean_turns']:.3g}",
        ], rows[step]


def test_lineage_shows_a_trajectorys_turns(curve, monkeypatch, capsys):
    """`dagster-rl lineage <exp> <step> --trial <id>`: the chain, then the trial's reward and each of
    its turns (the action as the environment read it, its sampled tokens and their log-probability,
    the observation), as the step's stored rollouts and rewards hold them."""
    from assets.cli import main

    monkeypatch.setenv("DAGSTER_HOME", str(curve.home))
    monkeypatch.setenv("DAGSTER_RL_EXPERIMENTS", str(curve.home / "experiments"))
    store, step = curve.store(), STEPS[2]
    rollouts = store.get_model(
        "rollouts", curve.latest("tiny_agent", "rollouts", step)["artifact_key"], Rollouts[AgentTrajectory]
    )
    rewards = store.get_model("rewards", curve.latest("tiny_agent", "rewards", step)["artifact_key"], Rewards[AgentReward])
    t = max(rollouts.trajectories, key=lambda t: (len(t.turns), t.trial_id))  # a trial of several turns
    r = next(r for r in rewards.rewards if r.trial_id == t.trial_id)
    main(["lineage", "tiny_agent", "2", "--trial", t.trial_id])
    out = capsys.readouterr().out
    lines = out[out.index(f"trial {t.trial_id} ") :].splitlines()
    assert lines[0] == (
        f"trial {t.trial_id} (step {step}, seed {t.seed}): reward {r.reward:.3f}, {'correct' if r.correct else 'wrong'}"
    )
    used = 0
    for i, turn in enumerate(t.turns):
        n = turn.action_end - turn.action_start
        logp = sum(t.sampling_logprobs[used : used + n])
        used += n
        seen = "" if turn.observation == "" else f" -> {turn.observation!r}"
        assert lines[1 + i] == f"  turn {i + 1}: {turn.action!r} ({n} tokens, log-prob {logp:.2f}, {turn.finish_reason}){seen}"
    assert lines[1 + len(t.turns)] == f"  ended: {t.end_reason}" and len(t.turns) >= 2
    with pytest.raises(SystemExit, match="no trial 's9-p0-n0' in this lineage's rollouts"):
        main(["lineage", "tiny_agent", "2", "--trial", "s9-p0-n0"])
