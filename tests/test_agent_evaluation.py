"""An agent's held-out evaluation never scores a failure as the policy's: an episode whose
environment failed is played again from its first turn, and one that fails every attempt fails the
evaluation, naming the trial and its error, and nothing is stored (a re-run evaluates again).

CI once stored an evaluation of two episodes that failed (`failed_episodes 2`, success 0), which a
resumed run then could not match: the failure was cached as the policy's score."""

import pytest

from dagster_rl.base.hashing import cache_key
from dagster_rl.store.artifact_store import ArtifactStore
from dagster_rl.tasks.agent.environment import World
from dagster_rl.tasks.agent.evaluation import AgentEvaluation, EvaluationFailed, evaluate
from dagster_rl.tasks.agent.experiment import AgentExperiment
from dagster_rl.tasks.lm.model.policy import load_policy
from tests.agent_fixtures import BRITTLE, agent_settings
from tests.settings import shipped_settings

MAX_TURNS = 3


def experiment(marks: str) -> AgentExperiment:
    raw = shipped_settings(
        "tiny_agent",
        name="agent_evaluation",
        task={"environment": {"name": BRITTLE.name, "marks": marks}, "episode": {"max_turns": MAX_TURNS, "max_turn_tokens": 4}},
        policy=agent_settings().model_dump(mode="json"),
    )
    raw.pop("warmup")
    return AgentExperiment.model_validate(raw)


def test_a_heldout_episode_that_failed_is_played_again_and_one_that_always_fails_fails_the_evaluation(tmp_path):
    marks = tmp_path / "broke"
    marks.mkdir()
    exp = experiment(str(marks))
    policy = load_policy(exp.policy)
    once = evaluate(policy, exp, [World("t0.1", 1), World("t0.2", 2)], tmp_path / "sandboxes", None)
    assert (marks / "t0.1").exists(), "t0.1 broke on its first attempt"
    assert (once.n, once.mean_turns, once.end_reasons) == (2, MAX_TURNS, {"turn_budget": 2})  # played whole the second time

    store = ArtifactStore(f"file://{tmp_path}/artifacts")
    key = cache_key("evaluation", "test", worlds=["t0.0", "t0.1"])

    def compute() -> AgentEvaluation:
        return evaluate(policy, exp, [World("t0.0", 0), World("t0.1", 1)], tmp_path / "sandboxes", None, max_retries=1)

    with pytest.raises(EvaluationFailed) as failed:
        store.get_or_put("evaluations", key, AgentEvaluation, compute)
    message = str(failed.value)
    assert message.startswith("1 of 2 held-out episodes failed on each of 2 attempts, so the evaluation is not stored"), message
    assert "t0.0: the environment failed: " in message and "OSError: brittle broke in world t0.0" in message, message
    assert not store.exists("evaluations", key), "a failed evaluation was stored"
