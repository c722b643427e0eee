"""Environments fail alone, like programs: what a careless environment does stays in its own trial.

Each environment here misbehaves in one world (`t0.1`) and is healthy in the others; the step goes on
with the healthy trials, the misbehaving ones fail (never cached) with an error that names the
environment, the trial and what went wrong. The environments are registered at this module's top
level: each trial's environment runs in a process of its own, which imports this module to find them.
"""

import resource
import time
from pathlib import Path
from typing import Literal

from dagster_rl.sandbox.folders import trial_folder
from dagster_rl.tasks.agent.environment import EnvironmentSettings, EnvironmentSpec, Outcome, register_environment
from resources import RolloutEnvironment

BAD_WORLD = "t0.1"


class _Base:
    def __init__(self, settings, world, seed, sandbox):
        self.bad = world.id == BAD_WORLD

    def reset(self) -> str:
        return "say done"

    def step(self, action: str) -> Outcome:
        return Outcome("", done=True, end_reason="said", tool="say", argument=action)

    def verdict(self) -> dict:
        return {"success": True}

    def close(self) -> None:
        pass


class SleepySettings(EnvironmentSettings):
    name: Literal["sleepy"] = "sleepy"


class Sleepy(_Base):
    """Its `step` blocks for 30 s in the bad world."""

    def step(self, action: str) -> Outcome:
        if self.bad:
            time.sleep(30)
        return super().step(action)


class ChattySettings(EnvironmentSettings):
    name: Literal["chatty"] = "chatty"


class Chatty(_Base):
    """Its first observation is 5 MB in the bad world."""

    def reset(self) -> str:
        return "x" * 5_000_000 if self.bad else super().reset()


class SetVerdictSettings(EnvironmentSettings):
    name: Literal["set_verdict"] = "set_verdict"


class SetVerdict(_Base):
    """Its verdict holds a set in the bad world."""

    def verdict(self) -> dict:
        return {"success": True, "seen": {1, 2, 3}} if self.bad else super().verdict()


for name, settings, make in (
    ("sleepy", SleepySettings, Sleepy),
    ("chatty", ChattySettings, Chatty),
    ("set_verdict", SetVerdictSettings, SetVerdict),
):
    register_environment(EnvironmentSpec(name=name, settings=settings, make=make, code_version=f"{name}-1"))


def settings_for(environment: str, **episode) -> dict:
    return {
        "name": f"{environment}_agent",
        "n_steps": 1,
        "prompts_per_step": 3,
        "n_samples": 2,
        "min_trials_per_step": 2,
        "task": {
            "kind": "text_agent",
            "environment": {"name": environment},
            "episode": {"max_turns": 1, "max_turn_tokens": 2, **episode},
            "n_eval": 2,
        },
        "policy": {
            "base_model": "builtin:tiny-qwen2-agent",
            "lora": {"rank": 2, "alpha": 4, "target_modules": ["q_proj"], "init_seed": 1},
        },
        "grpo": {"learning_rate": 0.01, "micro_batch_tokens": 4096},
    }


def run_one_step(lab, environment: str, **episode) -> tuple[dict, list[str], float]:
    """Step 0000 with the environment: its rollouts' metadata, the warnings of its failed trials, and the
    seconds its rollouts took."""
    made = lab(environment, settings_for(environment, **episode), rollout=RolloutEnvironment(max_retries=0))
    result = made.run(f"{environment}_agent", "0000", "0000")
    assert result.success
    logs = made.instance.all_logs(result.run_id)
    warnings = [e.message for e in logs if e.level >= 30 and "failed after its retries" in e.message]
    seconds = made.latest(f"{environment}_agent", "weights", "0000")["generate_s"]
    return made.latest(f"{environment}_agent", "rollouts", "0000"), warnings, seconds


def test_a_step_that_blocks_fails_its_own_trials_at_their_time_limit_and_the_others_go_on(lab):
    """The probe's finding: one world's `step` sleeping 30 s with trial_timeout_s 5 took the step to 203 s and
    failed every trial, the healthy ones included. Now its two trials fail at their limit; the four others pass."""
    md, warnings, seconds = run_one_step(lab, "sleepy", trial_timeout_s=5)
    assert md["skipped_trials"] == 2 and md["n_trials"] == 4, md
    assert 5 <= seconds < 15, f"the step's rollouts took {seconds:.0f} s: the blocked environment held the batch"
    assert len(warnings) == 2 and all(
        "environment sleepy's step() was still running at the trial's time limit (task.episode.trial_timeout_s)" in w
        and "s0-p1-n" in w
        for w in warnings
    ), warnings


def test_a_5_mb_observation_fails_its_trial_naming_the_environment_and_the_size(lab):
    """The probe's finding: a 5 MB first observation took the step's process to 15.7 GB. Now it is cut before
    it is sent, never tokenized whole, and fails its trial naming the environment, the size and the bound."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    md, warnings, _ = run_one_step(lab, "chatty", max_observation_tokens=1000)
    assert md["skipped_trials"] == 2 and md["n_trials"] == 4, md
    assert all(
        "environment chatty's observation at turn 0 holds 5000000 characters, more than "
        "task.episode.max_observation_tokens=1000 tokens" in w
        for w in warnings
    ), warnings
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 1 << 20  # KiB: under 1 GiB more, at its peak


def test_a_verdict_the_judge_cannot_take_is_said_once(lab):
    """The probe's finding: a `verdict()` that returned a set printed 67 lines of validation errors. Now: one
    sentence naming the key and its type, and what a verdict may hold."""
    md, warnings, _ = run_one_step(lab, "set_verdict")
    assert md["skipped_trials"] == 2, md
    for w in warnings:
        assert "verdict() holds values the judge cannot take ('seen': set)" in w and w.count("\n") == 0, w


def test_the_trial_folders_of_a_process_that_was_killed_are_removed_by_the_next(tmp_path):
    """A step's process killed with `kill -9` cannot remove its trials' folders; the next process that makes a
    trial's folder under the same root removes those of owners that are gone (pid 4194303 + a start time: none)."""
    dead = tmp_path / "owner-4194303-12345"
    (dead / "s0-p0-n0-abc").mkdir(parents=True)
    (dead / "s0-p0-n0-abc" / "state.json").write_text("{}")
    mine = trial_folder(tmp_path, "s1-p0-n0")
    assert not dead.exists() and mine.is_dir() and mine.parent.name.startswith("owner-")
    assert Path(mine).parent.parent == tmp_path
