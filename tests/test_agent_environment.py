"""A user's text environment, registered from this test alone, trains a step of the language-model
agent through the real driver; an environment that fails makes failed trials, never cached ones.

It is what an environment's author writes after reading `dagster_rl/tasks/agent/environment.py`: a
settings class (its section of the experiment file, with `name`), a class with `reset`, `step`,
`verdict` and `close`, and one `register_environment(...)` call. Nothing else changes.
"""

import os
import random
import tempfile
import uuid
from pathlib import Path
from typing import Literal

from pydantic import Field

from dagster_rl.core.records import Rewards, Rollouts
from dagster_rl.tasks.agent.environment import EnvironmentSettings, EnvironmentSpec, Outcome, World, register_environment
from dagster_rl.tasks.agent.records import AgentReward, AgentTrajectory
from resources import RolloutEnvironment
from tests.harness import CHAIN
from tests.lm_fixtures import ON_POLICY_ROUNDING

WORDS = ("apple", "river", "stone", "cloud")
# worlds whose environment raises when made, one id a line (the test writes it, then removes it): a file, since each
# trial's environment runs in a process of its own (forked by a host that inherits this session's variable)
BROKEN = Path(tempfile.gettempdir()) / f"dagster-rl-echo-broken-{os.environ.setdefault('DAGSTER_RL_ECHO_RUN', uuid.uuid4().hex)}"


class EchoSettings(EnvironmentSettings):
    name: Literal["echo"] = "echo"
    words: int = Field(2, ge=1, le=len(WORDS), description="how many words the world asks for, one a turn")


class Echo:
    """Asks for a word a turn, from the world's seed; an episode succeeds when the agent says them all."""

    def __init__(self, settings: EchoSettings, world: World, seed: int, sandbox: Path):
        if BROKEN.exists() and world.id in BROKEN.read_text().split():
            raise ConnectionError(f"the echo service of world {world.id} is down")
        self.wanted = random.Random(world.seed).choices(WORDS, k=settings.words)
        self.said: list[str] = []
        (sandbox / "heard.txt").write_text("")  # its state lives in the trial's sandbox

    def reset(self) -> str:
        return f"say {self.wanted[0]}"

    def step(self, action: str) -> Outcome:
        self.said.append(action.strip())
        if self.said[-1] != self.wanted[len(self.said) - 1]:
            return Outcome("", done=True, end_reason="wrong_word", tool="say", argument=action)
        if len(self.said) == len(self.wanted):
            return Outcome("", done=True, end_reason="said_all", tool="say", argument=action)
        return Outcome(f"say {self.wanted[len(self.said)]}", tool="say", argument=action)

    def verdict(self) -> dict:
        return {"success": self.said == self.wanted, "said": len(self.said)}

    def close(self) -> None:
        pass


register_environment(EnvironmentSpec(name="echo", settings=EchoSettings, make=Echo, code_version="echo-1"))

ECHO = {
    "name": "echo_agent",
    "n_steps": 2,
    "prompts_per_step": 3,
    "n_samples": 4,
    "min_trials_per_step": 4,
    "task": {
        "kind": "text_agent",
        "environment": {"name": "echo", "words": 2},
        "episode": {"max_turns": 2, "max_turn_tokens": 4},
        "n_eval": 4,
    },
    "policy": {
        "base_model": "builtin:tiny-qwen2-agent",
        "lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "lm_head"], "init_seed": 1},
    },
    "sampling": {"temperature": 2.0},
    "grpo": {"learning_rate": 0.01, "micro_batch_tokens": 4096},
}


def test_an_environment_registered_by_a_test_trains_through_the_driver(lab):
    echo = lab("echo", ECHO)
    assert echo.run("echo_agent", "0000", "0001").success
    for asset in (*CHAIN, "evaluation"):
        assert [e.asset_materialization.partition for e in echo.events("echo_agent", asset)] == ["0000", "0001"], asset
    md = echo.latest("echo_agent", "weights", "0001")
    assert md["weights_version"] == 2 and md["n_trials"] == 12 and md["skipped_trials"] == 0
    assert 1.0 <= md["mean_turns"] <= 2.0 and md["logp_max_dev"] < 1e-3  # on-policy at every turn
    store = echo.store()
    rollouts = store.get_model(
        "rollouts", echo.latest("echo_agent", "rollouts", "0000")["artifact_key"], Rollouts[AgentTrajectory]
    )
    rewards = store.get_model("rewards", echo.latest("echo_agent", "rewards", "0000")["artifact_key"], Rewards[AgentReward])
    assert {t.world_id for t in rollouts.trajectories} == {"t0.0", "t0.1", "t0.2"}
    for t in rollouts.trajectories:
        assert t.first_observation.startswith("say ") and t.end_reason in ("wrong_word", "said_all", "turn_budget")
        assert all(turn.tool == "say" for turn in t.turns) and len(t.sampling_logprobs) == sum(t.completion_mask)
    assert [r.trial_id for r in rewards.rewards] == sorted(t.trial_id for t in rollouts.trajectories)
    evaluation = echo.latest("echo_agent", "evaluation", "0001")
    assert evaluation["n_worlds"] == 4 and 0.0 <= evaluation["success"] <= 1.0


def test_a_failing_environment_makes_failed_trials_that_a_rerun_plays_again(lab):
    """The environment's own exception is a failed trial (after the rollout environment's retries),
    skipped by its step and never cached as a result: a re-run with the environment healthy plays
    those trials, and only those, and samples what the clean run sampled (the same ids; log-probs
    within float rounding, the recovered trials' batch being another)."""
    clean = lab("echo_clean", {**ECHO, "n_steps": 1})
    assert clean.run("echo_agent", "0000", "0000").success
    BROKEN.write_text("t0.1\n")
    try:
        broken = lab("echo_broken", {**ECHO, "n_steps": 1}, rollout=RolloutEnvironment(max_retries=1))
        assert broken.run("echo_agent", "0000", "0000").success
    finally:
        BROKEN.unlink()
    zero = broken.latest("echo_agent", "rollouts", "0000")
    assert zero["skipped_trials"] == 4 and zero["n_trials"] == 8, zero
    assert zero["content_hash"] != clean.latest("echo_agent", "rollouts", "0000")["content_hash"]

    healthy = broken.reopen()
    assert healthy.run("echo_agent", "0000", "0000").success
    zero = healthy.latest("echo_agent", "rollouts", "0000")
    assert zero["trials_executed"] == 4 and zero["recovered_trials"] == 4 and zero["n_trials"] == 12
    ours, ref = (
        lab_.store().get_model(
            "rollouts", lab_.latest("echo_agent", "rollouts", "0000")["artifact_key"], Rollouts[AgentTrajectory]
        )
        for lab_ in (healthy, clean)
    )
    assert [t.trial_id for t in ours.trajectories] == [t.trial_id for t in ref.trajectories]
    for a, b in zip(ours.trajectories, ref.trajectories, strict=True):
        assert a.completion_token_ids == b.completion_token_ids and a.turns == b.turns, a.trial_id
        assert max(abs(x - y) for x, y in zip(a.sampling_logprobs, b.sampling_logprobs, strict=True)) < ON_POLICY_ROUNDING


def test_a_run_cut_after_a_step_resumes_to_the_same_bytes(lab):
    """Steps 0000 and 0001 in one run, or in two runs (the first stopped after step 0000, as a killed
    range resumes): every artifact of both steps is the same bytes, and the second run computes only
    step 0001."""
    whole = lab("echo_whole", ECHO)
    assert whole.run("echo_agent", "0000", "0001").success
    cut = lab("echo_cut", ECHO)
    assert cut.run("echo_agent", "0000", "0000").success
    resumed = cut.reopen()
    assert resumed.run("echo_agent", "0000", "0001").success
    assert resumed.latest("echo_agent", "weights", "0000")["cache"] == "hit"
    for asset in (*CHAIN, "evaluation"):
        for step in ("0000", "0001"):
            a, b = whole.latest("echo_agent", asset, step), resumed.latest("echo_agent", asset, step)
            assert a["content_hash"] == b["content_hash"], (asset, step)
