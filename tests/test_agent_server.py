"""The agent's rollout backend `openai_server`: multi-turn episodes played as one completion request
per turn, token ids in and out, against `dagster-rl serve` of the built-in agent model and against a
real vLLM (the CPU build, `make vllm`) serving the same model from a folder, and the shipped
`tiny_agent` trained through the driver on a real vLLM:

- every turn's sampled ids are in the trajectory exactly as the server returned them, between the
  first prompt and the observations' ids (nothing decoded and re-encoded);
- the trainer's log-prob of every sampled id of every turn (one packed forward of the whole
  trajectory, observations masked) is the server's: on-policy at every turn;
- each trajectory goes to `on_done` once, as it ends; a retried trial replays its turns;
- a trial whose environment fails is played again from its first turn, and after its retries is a
  `TrialFailed` (not given to `on_done`), as is one that outlives `task.episode.trial_timeout_s`.

The policy is the agent model with a drawn (non-zero) rank-4 adapter on the attention and MLP
projections (vLLM's LoRA adapts no lm_head or embed_tokens). The environment is the tests' `chatter`,
which only the turn budget ends: every episode takes all its turns. Each test prints what it measured
(`pytest -s`)."""

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from dagster_rl.base.hashing import cache_key, seed_of
from dagster_rl.base.retries import Limits
from dagster_rl.core.records import Rollouts, TrialFailed
from dagster_rl.core.task import Endpoint, RolloutEnv, Weights, task_of
from dagster_rl.sandbox.folders import OWNER
from dagster_rl.store.artifact_store import ArtifactRef, ArtifactStore
from dagster_rl.tasks.agent.chat import ChatTurns
from dagster_rl.tasks.agent.experiment import AgentExperiment, AgentRolloutSettings
from dagster_rl.tasks.agent.loop import AgentLoop, plan_episodes
from dagster_rl.tasks.agent.records import AgentTrajectory
from dagster_rl.tasks.lm.backend_protocols import Checkpoint
from dagster_rl.tasks.lm.experiment import SERVER_REQUEST_VERSION
from dagster_rl.tasks.lm.model.logprobs import pack, packed_logprobs
from dagster_rl.tasks.lm.model.policy import checkpoint_bytes, load_policy
from dagster_rl.tasks.lm.model.tiny import save_tiny_model
from dagster_rl.tasks.lm.settings import ATTENTION_AND_MLP
from dagster_rl.tasks.lm.weights import stored_weights
from tests.agent_fixtures import BRITTLE, CHATTER, agent_settings, busy_policy
from tests.lm_fixtures import ON_POLICY_ROUNDING
from tests.serve_process import ServeProcess
from tests.settings import shipped_settings
from tests.vllm_server import LOADED, require_vllm, started_vllm

MAX_TURNS, TURN_TOKENS = 3, 8


@pytest.fixture(scope="module")
def agent_serve(tmp_path_factory) -> Iterator[ServeProcess]:
    """`dagster-rl serve` of builtin:tiny-qwen2-agent, loading adapters from the tests' temporary folders."""
    with ServeProcess(
        tmp_path_factory.mktemp("serve"), model="builtin:tiny-qwen2-agent", adapter_roots=[str(tmp_path_factory.getbasetemp())]
    ) as s:
        yield s


def experiment(base_model: str, environment: str = CHATTER.name, timeout_s: float = 600.0, **settings: str) -> AgentExperiment:
    """4 worlds x 2 trials of `chatter`, 3 turns of up to 8 tokens, at tiny_agent's sampling (temperature 0.7, top_p 1), through openai_server."""
    episode = {"max_turns": MAX_TURNS, "max_turn_tokens": TURN_TOKENS, "trial_timeout_s": timeout_s}
    raw = shipped_settings(
        "tiny_agent",
        name="agent_server",
        prompts_per_step=4,
        n_samples=2,
        min_trials_per_step=4,
        task={"environment": {"name": environment, **settings}, "episode": episode},
        policy=agent_settings(ATTENTION_AND_MLP, base_model).model_dump(mode="json"),
        rollout={"backend": "openai_server"},
    )
    raw.pop("warmup")
    return AgentExperiment.model_validate(raw)


def busy_weights(exp: AgentExperiment, store: ArtifactStore) -> Weights[Checkpoint]:
    key = cache_key("weights", "busy-agent", policy=exp.policy)
    files, ref, _ = store.get_or_put_files("weights", key, lambda: checkpoint_bytes(busy_policy(settings=exp.policy), None))
    return stored_weights("busy", ref, files)


def play(exp: AgentExperiment, base_url: str, tmp_path: Path, outcomes_only: bool = False):
    """The step's episodes through the task's openai_server backend: (trajectories, their on_done
    order, {(seed, *prompt ids): the server's sampled ids} of every request, the weights)."""
    weights = busy_weights(exp, ArtifactStore(f"file://{tmp_path}/artifacts"))
    env = RolloutEnv(Limits(max_retries=1, max_concurrency=4), tmp_path / "scratch", Endpoint(base_url, request_timeout_s=120))
    backend = task_of(exp.kind).backend("rollout", exp, env)
    replies: dict[tuple[int, ...], list[int]] = {}
    complete = backend.server.client.complete

    def recorded(model, prompt_ids, sampling, seed, logprobs=0, timeout_s=None, *, vocab):
        c = complete(model, prompt_ids, sampling, seed, logprobs, timeout_s, vocab=vocab)
        if logprobs == 0:
            replies[(seed, *prompt_ids)] = c.token_ids
        return c

    backend.server.client.complete = recorded
    done: list[str] = []
    outcomes = backend.generate(exp, plan_episodes(exp, 0), weights, lambda t: done.append(t.trial_id))
    assert not [p for p in (tmp_path / "scratch").rglob("*") if OWNER.match(p.parent.name)]  # every trial folder removed
    if outcomes_only:
        return outcomes, done, replies, weights
    assert all(isinstance(o, AgentTrajectory) for o in outcomes), outcomes
    return outcomes, done, replies, weights


def check_tokens(trajectories: list[AgentTrajectory], replies: dict[tuple[int, ...], list[int]], chat: ChatTurns) -> None:
    """The sequence is the first prompt, then each turn's sampled ids as the server returned them for
    the sequence before it, then the observation's ids: no id decoded and re-encoded."""
    for t in trajectories:
        assert t.prompt_token_ids == chat.prompt(t.first_observation)
        assert len(t.turns) == MAX_TURNS and t.end_reason == "turn_budget"
        ids = t.token_ids
        for k, turn in enumerate(t.turns):
            before = len(t.prompt_token_ids) + turn.action_start
            sampled = t.completion_token_ids[turn.action_start : turn.action_end]
            seed = seed_of(t.seed, "turn", k) % 2**63
            assert replies[(seed, *ids[:before])] == sampled, (t.trial_id, k)
            following = t.completion_token_ids[turn.action_end : turn.observation_end]
            assert following == (chat.after_action(sampled, turn.observation) if k < MAX_TURNS - 1 else [])
        assert len(ids) == len(t.prompt_token_ids) + t.turns[-1].observation_end


def deviations(exp: AgentExperiment, weights: Weights[Checkpoint], trajectories: list[AgentTrajectory]) -> list[float]:
    """max |trainer's log-prob - sampler's| over the sampled ids of turn k, for each k."""
    policy = load_policy(exp.policy, weights.payload)
    policy.mode(training=False)
    with torch.no_grad():
        batch = pack(
            [t.prompt_token_ids for t in trajectories],
            [t.completion_token_ids for t in trajectories],
            [t.temperature for t in trajectories],
            int(policy.tokenizer.pad_token_id),
            "cpu",
            masks=[t.completion_mask for t in trajectories],
        )
        trained = packed_logprobs(policy.model, batch)
    worst = [0.0] * max(len(t.turns) for t in trajectories)
    for i, t in enumerate(trajectories):
        dev = (trained[i][batch.completion_mask[i]] - torch.tensor(t.sampling_logprobs)).abs().tolist()
        at = 0
        for k, turn in enumerate(t.turns):
            n = turn.action_end - turn.action_start
            worst[k] = max(worst[k], *dev[at : at + n])
            at += n
        assert at == len(dev)
    return worst


def test_the_engine_is_in_the_rollouts_key_and_what_a_server_refuses_is_refused_at_load():
    served = experiment("builtin:tiny-qwen2-agent")
    local = served.model_copy(update={"rollout": AgentRolloutSettings(backend="hf")})
    assert served.rollout.cache_inputs() == {"engine": "openai_server", "request": SERVER_REQUEST_VERSION}
    assert local.rollout.cache_inputs() == {}  # the keys of hf runs stay as they were
    behavior = Weights("initial", ArtifactRef(kind="weights", key="k", content_hash="h", uri="file:///w/k"), {}, 0)
    keys = {AgentLoop()._rollouts_key(e, 0, behavior) for e in (served, local)}
    assert len(keys) == 2
    raw = served.model_dump(mode="json")
    raw["policy"]["lora"]["target_modules"] = [*ATTENTION_AND_MLP, "lm_head"]
    with pytest.raises(ValidationError, match="vLLM cannot adapt those modules"):
        AgentExperiment.model_validate(raw)
    raw = served.model_dump(mode="json") | {"sampling": {"temperature": 1.0, "top_p": 0.9}}
    with pytest.raises(ValidationError, match="openai_server needs top_p 1"):
        AgentExperiment.model_validate(raw)


def test_episodes_through_dagster_rl_serve_are_token_in_token_out_and_on_policy_at_every_turn(agent_serve, tmp_path):
    exp = experiment("builtin:tiny-qwen2-agent")
    trajectories, done, replies, weights = play(exp, agent_serve.base_url, tmp_path)
    assert sorted(done) == sorted(t.trial_id for t in trajectories)  # each judged once, as it ended
    chat = ChatTurns.of(load_policy(exp.policy).tokenizer)
    check_tokens(trajectories, replies, chat)
    assert len(replies) == len(trajectories) * MAX_TURNS
    assert {len(t.completion_mask) for t in trajectories} != {len(trajectories[0].completion_mask)}  # turns of other lengths
    worst = deviations(exp, weights, trajectories)
    print(f"\ndagster-rl serve, {len(trajectories)} episodes x {MAX_TURNS} turns: max |dlogp| per turn {worst}")
    assert max(worst) < ON_POLICY_ROUNDING, worst
    again, _, _, _ = play(exp, agent_serve.base_url, tmp_path / "again")
    assert [t.completion_token_ids for t in again] == [t.completion_token_ids for t in trajectories]  # seeded turn by turn


def test_a_failed_trial_is_replayed_from_its_first_turn_then_failed_and_a_slow_one_times_out(agent_serve, tmp_path):
    marks = tmp_path / "broke"
    marks.mkdir()
    exp = experiment("builtin:tiny-qwen2-agent", BRITTLE.name, marks=str(marks))
    outcomes, done, _, _ = play(exp, agent_serve.base_url, tmp_path, outcomes_only=True)
    failed = {o.trial_id for o in outcomes if isinstance(o, TrialFailed)}
    assert failed == {"s0-p0-n0", "s0-p0-n1"}, outcomes  # world t0.0 always breaks: 2 attempts each, then failed
    assert all("OSError: brittle broke in world t0.0" in o.error for o in outcomes if isinstance(o, TrialFailed))
    assert sorted(done) == sorted(o.trial_id for o in outcomes if isinstance(o, AgentTrajectory))  # never the failed
    assert {p.name for p in marks.iterdir()} == {"t0.0", "t0.1"}
    replayed = [o for o in outcomes if isinstance(o, AgentTrajectory) and o.world_id == "t0.1"]
    assert len(replayed) == 2 and all(len(t.turns) == MAX_TURNS for t in replayed)  # broke once, played again whole
    slow, done, _, _ = play(
        experiment("builtin:tiny-qwen2-agent", timeout_s=0.001), agent_serve.base_url, tmp_path / "slow", True
    )
    # past its time limit wherever it was: waiting for the server, or for its environment's process
    timed_out = ("ran longer than its timeout of 0.001 s", "still running at the trial's time limit")
    assert all(isinstance(o, TrialFailed) and any(t in o.error for t in timed_out) for o in slow) and not done, slow


def test_episodes_through_a_real_vllm_are_on_policy_at_every_turn(tmp_path_factory, tmp_path):
    require_vllm()
    model = save_tiny_model(tmp_path_factory.mktemp("vllm-agent") / "tiny-qwen2-agent", builtin="tiny-qwen2-agent")
    exp = experiment(str(model))
    with started_vllm(model) as vllm:
        trajectories, done, replies, weights = play(exp, vllm.base_url, tmp_path)
    assert sorted(done) == sorted(t.trial_id for t in trajectories)
    check_tokens(trajectories, replies, ChatTurns.of(load_policy(exp.policy).tokenizer))
    worst = deviations(exp, weights, trajectories)
    max_abs, _ = exp.on_policy_tolerance
    print(f"\nvLLM, {len(trajectories)} episodes x {MAX_TURNS} turns: max |dlogp| per turn {worst} (on_policy bound {max_abs})")
    assert max(worst) <= max_abs, worst


def test_tiny_agent_through_the_driver_on_a_real_vllm_is_on_policy_at_every_turn(tmp_path_factory):
    """The shipped `tiny_agent` (its warm-up, then 2 GRPO steps of 16 worlds x 8 trials) with rollout
    backend `openai_server` on a real vLLM serving its base model from a folder: every step's episodes
    are played turn by turn by vLLM with the step's adapter (the warm-up's, then the update's), and the
    trainer's log-prob of every sampled id of every turn is vLLM's, within the float32 check's bound."""
    require_vllm()
    from tests.harness import failure_message, new_dagster_home, open_lab
    from tests.settings import write_experiments

    base = shipped_settings("tiny_agent")["policy"]["base_model"].removeprefix("builtin:")
    folder = save_tiny_model(tmp_path_factory.mktemp("vllm-tiny-agent") / base, builtin=base)
    raw = shipped_settings("tiny_agent", n_steps=2, policy={"base_model": str(folder)}, rollout={"backend": "openai_server"})
    home = new_dagster_home(tmp_path_factory.mktemp("vllm-tiny-agent-run") / "home")
    steps = ["0000", "0001"]
    with started_vllm(folder, max_lora_rank=raw["policy"]["lora"]["rank"]) as vllm:
        lab = open_lab(home, write_experiments(home / "experiments", raw), rollout=vllm.shared())
        try:
            result = lab.run("tiny_agent", steps[0], steps[-1], raise_on_error=False)
            assert result.success, failure_message(result)
            exp, store = lab.experiments["tiny_agent"], lab.store()
            rollouts = {
                s: store.get_model("rollouts", lab.latest("tiny_agent", "rollouts", s)["artifact_key"], Rollouts[AgentTrajectory])
                for s in steps
            }
            served = [f"tiny_agent-v{rollouts[s].behavior_policy['version']}" for s in steps]
            log = vllm.log()
            per_turn = {}
            for s in steps:
                behavior = rollouts[s].behavior_policy
                weights = AgentLoop().load_weights(exp, store, str(behavior["partition"]), str(behavior["key"]))
                per_turn[s] = deviations(exp, weights, rollouts[s].trajectories)
            md = {s: lab.latest("tiny_agent", "weights", s) for s in steps}
            checks = lab.check_evaluations("tiny_agent", "on_policy")
        finally:
            lab.close()
    max_abs, _ = exp.on_policy_tolerance
    devs = [md[s]["logp_max_dev"] for s in steps]
    print(f"\ntiny_agent on vLLM: max |dlogp| per turn {per_turn}; logp_max_dev per step {devs}")
    assert [rollouts[s].behavior_policy["partition"] for s in steps] == ["sft", "0000"]
    assert served == ["tiny_agent-v0", "tiny_agent-v1"]
    assert [name for name, _ in LOADED.findall(log)] == served  # each version loaded as a vLLM adapter, once
    for s in steps:
        turns = [len(t.turns) for t in rollouts[s].trajectories]
        assert len(turns) == exp.n_trials_planned and max(turns) >= 2, (s, turns)  # episodes of several turns
        assert md[s]["policy_lag"] == 0.0 and md[s]["logp_max_dev"] <= max_abs, (s, md[s]["logp_max_dev"])
        assert max(per_turn[s]) <= max_abs, (s, per_turn[s])
    assert len(checks) == len(steps) and all(e.passed for e in checks)
