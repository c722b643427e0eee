"""Agents run the code they write: the `python_tool` environment, and programs through the whole loop.

- `python_tool` reads a tool call (`python: <code>`, or a fenced block), runs it in the trial's
  sandbox and answers what it printed; a program that fails or times out is an observation (the
  episode goes on); an answer ends the episode and is right or wrong;
- through the real driver, a run cut after a step resumes to the same bytes as a run never cut,
  replaying the stored trajectories without running their programs again; the programs' output
  and how they ended are in the trajectory (mask 0, like every observation), their times beside it,
  and `dagster-rl lineage --trial` shows them.

`counter` (registered here) runs a program at every turn, whatever the action: the tiny model's
actions are noise, and the loop's handling of programs is what is tested.
"""

import random
from typing import Literal

import pytest

from dagster_rl.base import counters
from dagster_rl.core.records import CALL_TIMES, Rollouts, call_times_key
from dagster_rl.sandbox.bubblewrap import default_sandboxes
from dagster_rl.sandbox.calls import Program, SandboxUnavailable
from dagster_rl.sandbox.limits import SandboxLimits
from dagster_rl.tasks.agent.environment import EnvironmentSettings, EnvironmentSpec, Outcome, World, register_environment
from dagster_rl.tasks.agent.python_tool import PythonTool, PythonToolSettings, Question, demonstrate, program_of, tool_code
from dagster_rl.tasks.agent.records import AgentTrajectory
from dagster_rl.tasks.agent.trial_sandbox import TrialSandbox
from tests.harness import CHAIN
from tests.machine import missing

LIMITS = SandboxLimits(cpu_s=1, wall_s=5)


@pytest.fixture(scope="module")
def sandboxes():
    s = default_sandboxes()
    try:
        s.check()
    except SandboxUnavailable as e:
        missing(str(e))
    return s


class CounterSettings(EnvironmentSettings):
    name: Literal["counter"] = "counter"


class Counter:
    """Runs `print(<letters of the action> * 2)` in the sandbox at every turn; the episode ends at the turn budget."""

    def __init__(self, settings, world, seed, sandbox: TrialSandbox):
        self.sandbox = sandbox

    def reset(self) -> str:
        return "say something"

    def step(self, action: str) -> Outcome:
        call = self.sandbox.run(Program(python=f"print({len(action)} * 2)"), LIMITS)
        return Outcome(call.text(LIMITS), tool="python", argument=str(len(action)))

    def verdict(self) -> dict:
        return {"success": True}

    def close(self) -> None:
        pass


register_environment(
    EnvironmentSpec(name="counter", settings=CounterSettings, make=Counter, code_version="counter-1", runs_programs=True)
)


def test_a_tool_call_runs_in_the_sandbox_and_its_output_is_the_observation(sandboxes, tmp_path):
    settings = PythonToolSettings(sandbox=LIMITS)
    world = World("e0", 7)
    question = Question(settings, world)
    sandbox = TrialSandbox(tmp_path, sandboxes, "e0")
    env = PythonTool(settings, world, 0, sandbox)
    try:
        assert env.reset().endswith(f"Question: {question.text}") and "python: <code>" in env.reset()
        first = env.step(f"python: {question.code}")  # an expression alone is printed
        assert (first.observation, first.done, first.tool) == (str(question.answer), False, "python")
        looping = env.step("```python\nwhile True:\n    pass\n```")  # the policy's program: an observation
        assert (looping.observation, looping.done) == ("[Timeout after 1 s]", False)
        failing = env.step("python: 1 / 0")
        assert failing.observation.endswith("ZeroDivisionError: division by zero\n[exit status 1]") and not failing.done
        silent = env.step("python: x = 1")
        assert silent.observation == "(no output)"
        answered = env.step(f"answer: {question.answer:,}")  # thousands separators are read
        assert answered.done and answered.end_reason == "answered"
        assert env.verdict() == {
            "success": True,
            "answer": f"{question.answer:,}",
            "truth": str(question.answer),
            "question": "products",
            "tool_calls": 4,
            "called_tool": True,
        }
        assert [c.outcome for _, c in sandbox.taken()] == ["exit", "timeout", "exit", "exit"]
    finally:
        sandbox.close()


def test_what_is_not_a_tool_call_or_an_answer_ends_the_episode(tmp_path):
    settings = PythonToolSettings()
    for action in ("The answer is 42.", "answer:", "python:", "print(3)"):
        env = PythonTool(settings, World("e1", 8), 0, TrialSandbox(tmp_path, None, "e1"))
        outcome = env.step(action)
        assert outcome.done and outcome.end_reason == "bad_action", action
    wrong = PythonTool(settings, World("e1", 8), 0, TrialSandbox(tmp_path, None, "e1"))
    wrong.step("answer: 12 apples")
    assert wrong.verdict()["success"] is False


def test_questions_one_line_answers_and_the_demonstrations(sandboxes, tmp_path):
    settings = PythonToolSettings(kinds=["products", "sums", "power_digits"], sandbox=LIMITS)
    seen = set()
    sandbox = TrialSandbox(tmp_path, sandboxes, "q")
    try:
        for i in range(12):
            q = Question(settings, World(f"e{i}", i))
            seen.add(q.shape)
            assert sandbox.run(program_of(q.code), LIMITS).stdout == f"{q.answer}\n", q.text
    finally:
        sandbox.close()
    assert seen == {"products", "sums", "power_digits"}
    rng = random.Random(0)
    demos = [demonstrate(settings.model_copy(update={"demo_tool_rate": 0.5}), World("d0", 3), rng) for _ in range(40)]
    assert {len(d) for d in demos} == {1, 2} and all(d[-1].startswith("answer: ") for d in demos)
    assert (
        tool_code("```py\nprint(1)\n```") == "print(1)" and tool_code("Python:  2+2 ") == "2+2" and tool_code("answer: 4") is None
    )


COUNTER = {
    "name": "counter_agent",
    "n_steps": 2,
    "prompts_per_step": 2,
    "n_samples": 2,
    "min_trials_per_step": 4,
    "task": {
        "kind": "text_agent",
        "environment": {"name": "counter"},
        "episode": {"max_turns": 2, "max_turn_tokens": 3},
        "n_eval": 2,
    },
    "policy": {
        "base_model": "builtin:tiny-qwen2-agent",
        "lora": {"rank": 2, "alpha": 4, "target_modules": ["q_proj", "v_proj"], "init_seed": 1},
    },
    "sampling": {"temperature": 2.0},
    "grpo": {"learning_rate": 0.01, "micro_batch_tokens": 4096},
}


def programs_kept() -> int:
    """Programs run by trials that ended (a trial that failed, and was played again, ran its programs again)."""
    return counters.read("programs_run") - counters.read("programs_of_failed_trials")


def test_a_run_cut_after_a_step_resumes_to_the_same_bytes_without_running_a_program_again(lab, sandboxes):
    whole = lab("counter_whole", COUNTER)
    before = programs_kept()
    assert whole.run("counter_agent", "0000", "0001").success
    ran = programs_kept() - before
    assert ran == 2 * 4 * 2 + 3 * 2 * 2  # 2 steps of 4 trials of 2 turns; the evaluations of the base and of each step

    crashy = lab("counter_cut", {**COUNTER, "faults": {"crash_driver_at_step": 0}})
    assert not crashy.run("counter_agent", "0000", "0001", raise_on_error=False).success
    before = programs_kept()
    resumed = crashy.reopen()
    assert resumed.run("counter_agent", "0000", "0001").success
    assert programs_kept() - before == 4 * 2 + 2 * 2, "step 0 was replayed from the store, not run again"
    for asset in (*CHAIN, "evaluation"):
        for step in ("0000", "0001"):
            a, b = whole.latest("counter_agent", asset, step), resumed.latest("counter_agent", asset, step)
            assert a["content_hash"] == b["content_hash"], (asset, step)

    md = whole.latest("counter_agent", "weights", "0001")
    assert md["tool_call_share"] == 1.0 and md["tool_calls_per_trial"] == 2.0 and md["sandbox_s"] > 0
    assert whole.latest("counter_agent", "evaluation", "0001")["tool_call_share"] == 1.0
    store = whole.store()
    rollouts = store.get_model(
        "rollouts", whole.latest("counter_agent", "rollouts", "0001")["artifact_key"], Rollouts[AgentTrajectory]
    )
    t = rollouts.trajectories[0]
    for turn in t.turns:
        (call,) = turn.calls
        assert call.program == f"print({len(turn.action)} * 2)" and call.outcome == "exit" and call.exit_status == 0
        assert call.stdout == f"{2 * len(turn.action)}\n"
    first = t.turns[0]
    observed = t.completion_token_ids[first.action_end : first.observation_end]
    assert t.completion_mask[first.action_end : first.observation_end] == [0] * len(observed)  # tool output: mask 0
    assert store.exists(CALL_TIMES, call_times_key(t))  # the programs' times, beside the trajectory


def test_lineage_shows_a_trials_programs(lab, sandboxes, tmp_path, capsys):
    from assets.cli_verify import print_trial
    from dagster_rl.core.lineage import trace, trial_of

    made = lab("counter_lineage", {**COUNTER, "n_steps": 1})
    assert made.run("counter_agent", "0000", "0000").success
    store = made.store()
    chain = trace(store, made.latest("counter_agent", "weights", "0000")["artifact_key"])
    print_trial(trial_of(store, chain, "s0-p0-n0"))
    lines = capsys.readouterr().out.splitlines()
    programs = [line for line in lines if line.startswith("    program 1: ")]
    assert len(programs) == 2, lines
    assert all(" exit status 0, " in line and " s; stdout '" in line for line in programs), programs


def test_a_run_whose_sandbox_cannot_be_made_fails_before_its_first_step_saying_what_to_do(lab):
    """No sandbox, no step: the run stops before step 0 stores anything (never running a program unsandboxed)."""
    from resources import SandboxEnvironment
    from tests.harness import failure_message

    made = lab("counter_nosandbox", {**COUNTER, "n_steps": 1}, sandbox=SandboxEnvironment(python="/nonexistent/python3"))
    before = counters.read("programs_run")
    result = made.run("counter_agent", "0000", "0000", raise_on_error=False)
    assert not result.success and counters.read("programs_run") == before
    assert "the sandbox's interpreter /nonexistent/python3 does not exist: install it, or set the sandbox's python" in (
        failure_message(result)
    )
    assert made.metadata("counter_agent", "rollouts") == {}
