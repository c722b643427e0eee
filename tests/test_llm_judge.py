"""The LLM judge against an OpenAI-compatible stub on 127.0.0.1: every judgement is paid for once."""

import re
from pathlib import Path

import pytest
import yaml

from dagster_rl.base import counters
from dagster_rl.base.errors import SettingError
from dagster_rl.base.retries import AttemptsExhausted, Limits
from dagster_rl.core.records import Rewards
from dagster_rl.core.task import Backends
from dagster_rl.judges.journal import KIND, JudgeJournal, journal_key, trajectory_hash
from dagster_rl.judges.llm_judge import LLMJudge, LLMJudgeError, OpenAIChatClient, parse_score, rubric_hash
from dagster_rl.store.artifact_store import ArtifactStore
from dagster_rl.tasks.secret_search.backends import SandboxRollouts, TabularTrainer
from dagster_rl.tasks.secret_search.experiment import SecretSearchExperiment
from dagster_rl.tasks.secret_search.grading import SecretSearchGrading
from dagster_rl.tasks.secret_search.loop import initial_weights, run_step
from dagster_rl.tasks.secret_search.records import Reward, Trajectory
from tests import REPO
from tests.openai_stub import STUB_MODEL, CrashAfterJudgeCall, OpenAIStub, judge_on, rule_score


def experiment(**overrides) -> SecretSearchExperiment:
    raw = yaml.safe_load((REPO / "experiments" / "demo.yaml").read_text())
    raw.update(name="judged", n_steps=2, prompts_per_step=4, n_samples=4, min_trials_per_step=8)
    for key, value in overrides.items():
        raw[key] = {**raw[key], **value} if isinstance(value, dict) else value
    return SecretSearchExperiment.model_validate(raw)


def trajectory(i: int) -> Trajectory:
    return Trajectory(
        trial_id=f"s0-p{i}-n0",
        step=0,
        prompt=i,
        world_id="w0",
        seed=1000 + i,
        docs_read=list(range(i % 3 + 1)),
        answer=None if i % 4 == 3 else f"digest-{i}",
        turns=i % 3 + 1,
        files_left=["scratch.txt"] if i % 2 else [],
        foreign_notes_seen=0,
        behavior_version=0,
    )


@pytest.fixture
def stub():
    with OpenAIStub() as server:
        yield server


@pytest.fixture
def store(tmp_path) -> ArtifactStore:
    return ArtifactStore(f"file://{tmp_path}/artifacts")


def make_judge(stub: OpenAIStub, store: ArtifactStore, model: str = STUB_MODEL, max_retries: int = 2, **kw) -> LLMJudge:
    # A fresh journal object over the store, as a new process (a retried task) would build.
    return LLMJudge(
        client=OpenAIChatClient(stub.base_url, timeout_s=5.0),
        model=model,
        journal=JudgeJournal(ArtifactStore(store.url)),
        grading=SecretSearchGrading(),
        limits=Limits(max_retries=max_retries, timeout_s=30.0, max_concurrency=4),
        **kw,
    )


def test_a_crash_after_the_call_is_retried_from_the_journal_one_call_per_trajectory(stub, store):
    exp, trajs = experiment(), [trajectory(i) for i in range(6)]
    stub.crash_after_answer(len(trajs))  # every first attempt dies right after the judge answered
    judge = make_judge(stub, store, after_call=stub.after_answer)
    replays = counters.read("judge_journal_replays")

    rewards = [judge.judge(exp, t) for t in trajs]

    assert stub.crashes == len(trajs)
    assert stub.count == len(trajs), "a retried attempt must replay the journal, not call the judge again"
    assert counters.read("judge_journal_replays") - replays == len(trajs)
    weight = exp.rubric.correctness + exp.rubric.efficiency + exp.rubric.tidiness
    for _, call_body, r in zip(trajs, stub.calls, rewards, strict=True):
        assert call_body["model"] == STUB_MODEL
        assert r.components["llm"] == rule_score(call_body)
        assert r.score == pytest.approx(weight * r.components["llm"])
        assert 0.0 <= r.reward <= exp.rubric.max_reward


def test_a_judging_task_retried_after_failing_replays_the_identical_score(stub, store):
    exp, traj = experiment(), trajectory(1)
    stub.crash_after_answer(1)
    with pytest.raises(AttemptsExhausted) as failed:  # the task's only attempt dies after the call
        make_judge(stub, store, max_retries=0, after_call=stub.after_answer).judge(exp, traj)
    assert isinstance(failed.value.errors[-1], CrashAfterJudgeCall)
    assert stub.count == 1

    first = make_judge(stub, store).judge(exp, traj)  # the retried task: a new judge, same store
    again = make_judge(stub, store).judge(exp, traj)
    assert stub.count == 1
    assert first == again
    entry = JudgeJournal(store).lookup(make_judge(stub, store).request(exp, traj), trajectory_hash(traj))
    assert entry is not None and entry.reply == f"SCORE: {rule_score(stub.calls[0])}"
    assert first.components["llm"] == entry.score
    assert entry.request == stub.calls[0] and store.exists(KIND, journal_key(stub.calls[0], trajectory_hash(traj)))


def test_a_new_rubric_or_a_new_model_is_a_new_call(stub, store):
    exp, traj = experiment(), trajectory(2)
    make_judge(stub, store).judge(exp, traj)
    assert stub.count == 1
    make_judge(stub, store).judge(exp, traj)
    assert stub.count == 1

    stricter = experiment(rubric={"name": "stricter", "tidiness": 1.0})
    make_judge(stub, store).judge(stricter, traj)
    assert stub.count == 2
    assert "tidiness 1.0" in stub.calls[-1]["messages"][0]["content"]

    make_judge(stub, store, model="other-judge").judge(exp, traj)
    assert stub.count == 3
    assert stub.calls[-1]["model"] == "other-judge"

    make_judge(stub, store, model="other-judge").judge(exp, traj)
    make_judge(stub, store).judge(stricter, traj)
    assert stub.count == 3

    make_judge(stub, store).judge(exp, trajectory(3))  # another trajectory
    assert stub.count == 4


def test_a_step_under_judge_flakes_pays_one_judge_call_per_trial(stub, tmp_path, store):
    """run_step with the LLM judge and judge_flake_rate 0.3: flakes fire after the call; retries replay."""
    exp = experiment(faults={"judge_flake_rate": 0.3})
    judge = make_judge(stub, store)
    rollout = SandboxRollouts(sandbox_root=tmp_path / "sandboxes")
    replays = counters.read("judge_journal_replays")
    result, _ = run_step(exp, 0, initial_weights(exp, store), store, Backends(rollout, judge, TabularTrainer()))
    assert result.n_trials == exp.n_trials_planned == 16
    assert stub.count == result.n_trials
    assert len({b["messages"][-1]["content"] for b in stub.calls}) == stub.count, "no trajectory judged twice"
    flaked = counters.read("judge_journal_replays") - replays
    assert flaked > 0, "with judge_flake_rate 0.3 some judgements must have been retried"
    assert result.judge_calls == result.n_trials + flaked


def test_http_errors_are_retried_and_unreachable_endpoints_are_named(stub, store):
    exp, traj = experiment(), trajectory(0)
    stub.fail_next(1, status=503)
    make_judge(stub, store, max_retries=1).judge(exp, traj)
    assert stub.count == 1

    stub.fail_next(2, status=500)
    with pytest.raises(AttemptsExhausted) as failed:
        make_judge(stub, store, max_retries=1).judge(exp, trajectory(5))
    assert "HTTP 500" in str(failed.value.errors[-1])

    client = OpenAIChatClient("http://127.0.0.1:9/v1", timeout_s=2.0)  # nothing listens on port 9
    with pytest.raises(LLMJudgeError, match="unreachable"):
        client.complete({"model": STUB_MODEL, "messages": []})


def test_timeouts_and_replies_without_a_score_are_clear_errors():
    with OpenAIStub(delay_s=1.0) as slow:
        with pytest.raises(LLMJudgeError, match="did not answer within 0.2 s"):
            OpenAIChatClient(slow.base_url, timeout_s=0.2).complete(
                {"model": STUB_MODEL, "messages": [{"role": "user", "content": "x"}]}
            )
    assert parse_score("Reasoning... SCORE: 0.75") == 0.75
    assert parse_score('{"score": 1}') == 1.0
    with pytest.raises(LLMJudgeError, match="no score"):
        parse_score("I think it is good")
    with pytest.raises(LLMJudgeError, match="outside"):
        parse_score("SCORE: 7")


def test_the_judge_environment_openai_backend_drives_steps_one_call_per_trial(stub, lab):
    """The Dagster resource: JudgeEnvironment(backend="openai") through the driver, in-process."""
    from tests.settings import demo_settings

    settings = demo_settings(
        name="llm", n_steps=2, prompts_per_step=4, n_samples=4, min_trials_per_step=8, faults={"judge_flake_rate": 0.3}
    )
    run = lab("llm", settings, judge=judge_on(stub, request_timeout_s=5.0))
    run.run("llm", "0000", "0001")
    assert stub.count == 2 * 16, "one judge call per trial; flaked judgements replay the journal"
    for step in ("0000", "0001"):
        meta = run.latest("llm", "rewards", step)
        assert meta["n_trials"] == 16 and meta["judge_calls"] > 16  # some attempts flaked and were replayed
    rewards = run.store().get_model("rewards", run.latest("llm", "rewards", "0000")["artifact_key"], Rewards[Reward])
    assert all(set(r.components) == {"llm"} for r in rewards.rewards)

    rubric_judged = lab("rubric", {**settings, "name": "rubric"})
    rubric_judged.run("rubric", "0000", "0000")
    assert (
        rubric_judged.latest("rubric", "rewards", "0000")["artifact_key"] != run.latest("llm", "rewards", "0000")["artifact_key"]
    ), "the judge's identity is part of the rewards' cache key"


def test_the_code_location_picks_the_llm_judge_from_the_environment(monkeypatch):
    from dagster import EnvVar

    from assets.definitions import judge_environment
    from resources import ArtifactStoreResource

    store = ArtifactStoreResource()
    monkeypatch.delenv("DAGSTER_RL_JUDGE_URL", raising=False)
    assert judge_environment(store).backend == "in_process"
    monkeypatch.setenv("DAGSTER_RL_JUDGE_URL", "http://127.0.0.1:1/v1")
    with pytest.raises(SettingError, match="DAGSTER_RL_JUDGE_MODEL"):
        judge_environment(store)
    monkeypatch.setenv("DAGSTER_RL_JUDGE_MODEL", STUB_MODEL)
    judge = judge_environment(store)
    assert judge.backend == "openai" and judge.base_url == EnvVar("DAGSTER_RL_JUDGE_URL") and judge.api_key == ""


def lm_rule(body: dict) -> float:
    """The stub's grade of a language model's answer: 1 with a `#### <n>` line, 0.25 without."""
    answer = body["messages"][-1]["content"].split("Answer to grade:\n", 1)[1]
    return 1.0 if re.search(r"####\s*\d", answer) else 0.25


def test_the_llm_judge_grades_language_model_completions_through_the_driver(lab):
    """A GSM8K-format language-model experiment judged by JudgeEnvironment(backend="openai"): the
    verifier decides accuracy, the LLM grades the format, one paid call per trial under judge flakes."""
    from dagster_rl.tasks.lm.data.prompts import load_prompt_set
    from dagster_rl.tasks.lm.grading import LMGrading
    from dagster_rl.tasks.lm.rewards import LMReward
    from tests.settings import shipped_settings

    settings = shipped_settings(
        "tiny_gsm8k",
        name="lm_llm",
        n_steps=2,
        prompts_per_step=4,
        n_samples=4,
        min_trials_per_step=8,
        warmup={"demos": 16, "steps": 20},
        sampling={"max_new_tokens": 12},
        task={"eval_max_new_tokens": 12},
        faults={"judge_flake_rate": 0.3},
    )
    replays = counters.read("judge_journal_replays")
    with OpenAIStub(rule=lm_rule) as stub:
        run = lab("lm_llm", settings, judge=judge_on(stub, request_timeout_s=5.0))
        result = run.run("lm_llm", "0000", "0001")
        assert result.success
        assert stub.count == 2 * 16, "one judge call per trial; flaked judgements replay the journal"
        calls = list(stub.calls)
    assert counters.read("judge_journal_replays") > replays  # some attempts flaked after their call and replayed it
    meta = run.latest("lm_llm", "rewards", "0000")
    assert meta["n_trials"] == 16
    exp = run.experiments["lm_llm"]
    questions = {it.question for it in load_prompt_set(exp.task.source).train}
    rewards = run.store().get_model("rewards", meta["artifact_key"], Rewards[LMReward]).rewards
    for body in calls:
        assert "#### <final number>" in body["messages"][0]["content"]  # the rubric's form, in words
        asked = body["messages"][1]["content"].split("\n\n")[0].removeprefix("Question:\n")
        assert asked in questions
    for r in rewards:
        assert set(r.components) == {"accuracy", "llm"}
        assert r.components["accuracy"] == float(r.correct)  # the verifier decides correctness
        assert r.components["llm"] in (1.0, 0.25)
        assert r.reward == pytest.approx(r.components["accuracy"] + exp.rubric.format * r.components["llm"])
        completion = _rollout(run, "0000", r.trial_id).completion_text
        assert r.components["llm"] == (1.0 if re.search(r"####\s*\d", completion) else 0.25)  # the grade of its own text
    graded = _rollout(run, "0000", rewards[0].trial_id)
    entries = [JudgeJournal(run.store()).lookup(body, trajectory_hash(graded)) for body in calls]
    entry = next(e for e in entries if e is not None)
    assert entry.rubric_hash == rubric_hash(exp.rubric, LMGrading.prompt_version) and entry.model == STUB_MODEL
    assert entry is not None and entry.score == rewards[0].components["llm"]

    in_process = lab("lm_rubric", settings)
    assert in_process.run("lm_llm", "0000", "0000").success
    assert (
        in_process.latest("lm_llm", "rollouts", "0000")["content_hash"]
        == run.latest("lm_llm", "rollouts", "0000")["content_hash"]
    )
    assert in_process.latest("lm_llm", "rewards", "0000")["artifact_key"] != meta["artifact_key"], (
        "the judge's identity is part of the rewards' cache key"
    )


def _rollout(run, step: str, trial_id: str):
    return next(t for t in run.rollouts("lm_llm", step).trajectories if t.trial_id == trial_id)


def test_a_judge_that_answers_megabytes_has_a_bounded_journal(stub, store, tmp_path):
    """finding 7 of issue 10: 5 MB replies were journaled in full (115 MB for one step)."""
    from dagster_rl.base.hashing import sha256_hex
    from dagster_rl.judges.journal import MAX_REPLY_CHARS

    exp, trajs = experiment(), [trajectory(i) for i in range(4)]
    stub.reply_text = "SCORE: 0.5\n" + "blah " * 1_000_000
    rewards = [make_judge(stub, store).judge(exp, t) for t in trajs]
    assert all(r.components["llm"] == 0.5 for r in rewards)  # scored from the whole reply
    stored = sum(f.stat().st_size for f in (tmp_path / "artifacts" / KIND).rglob("*") if f.is_file())
    assert stored < 4 * (MAX_REPLY_CHARS + 4096), stored
    entry = JudgeJournal(store).lookup(make_judge(stub, store).request(exp, trajs[0]), trajectory_hash(trajs[0]))
    assert entry.reply == stub.reply_text[:MAX_REPLY_CHARS]
    assert (entry.reply_chars, entry.reply_sha256) == (len(stub.reply_text), sha256_hex(stub.reply_text.encode()))


# ---- issue 20: the judge's replies are checked, and a judge that never answers fails fast --------


@pytest.mark.parametrize(
    "content, says",
    [
        ("SCORE: 1.7", "answered the score 1.7, outside [0, 1]"),
        ('{"score": NaN}', "answered the score nan, outside [0, 1]"),
        ('{"score": Infinity}', "answered the score inf, outside [0, 1]"),
        ("SCORE: 1e999", "answered the score inf, outside [0, 1]"),
        ('{"score": "0.5"}', "answered no score"),
        ("SCORE: 0.2. On reflection, SCORE: 0.9", "answered 2 different scores (0.2, 0.9), not one"),
        (None, "not a chat completion with text"),
        (["SCORE: 0.5"], "not a chat completion with text"),
    ],
)
def test_a_malformed_or_out_of_range_judge_reply_fails_the_judgement_and_is_never_journaled(stub, store, content, says):
    stub.content = content
    judge = make_judge(stub, store, max_retries=1)
    with pytest.raises(AttemptsExhausted) as failed:
        judge.judge(experiment(), trajectory(0))
    assert len(failed.value.errors) == 2 and stub.count == 2  # retried, each attempt asked the judge again: nothing replayed
    error = str(failed.value.errors[-1])
    assert isinstance(failed.value.errors[-1], LLMJudgeError) and says in error, error
    assert f"judge endpoint {stub.base_url}/chat/completions" in error  # which server sent it
    assert not (Path(store.root) / KIND).exists()  # nothing journaled
    stub.content = "SCORE: 0.5"  # the judge answers well again: the judgement is made, and journaled
    assert judge.judge(experiment(), trajectory(0)).components["llm"] == 0.5
    assert len(list((Path(store.root) / KIND).iterdir())) == 1


def test_a_journal_entry_no_judge_could_have_written_is_moved_aside_and_asked_again(stub, store):
    from dagster_rl.judges.journal import JudgeCall

    exp, traj = experiment(), trajectory(1)
    t_hash, r_hash = trajectory_hash(traj), rubric_hash(exp.rubric, SecretSearchGrading.prompt_version)
    request = make_judge(stub, store).request(exp, traj)
    forged = JudgeCall.model_construct(
        trajectory_hash=t_hash,
        rubric_hash=r_hash,
        model=STUB_MODEL,
        request=request,
        reply="SCORE: 5",
        score=5.0,
        recorded_at="x",
    )
    store.put_model(KIND, journal_key(request, t_hash), forged)
    reward = make_judge(stub, store).judge(exp, traj)
    assert stub.count == 1 and reward.components["llm"] == rule_score(stub.calls[0])  # asked again, not replayed
    assert [p.name.split(".")[-1] for p in (Path(store.root) / "quarantine" / KIND).iterdir()] == ["invalid"]


def test_a_judge_that_never_answers_fails_the_step_after_one_judgements_worst_case(store):
    """16 judgements, 4 at a time, 3 attempts of at most 0.3 s each, against a judge that never
    answers: the first 4 wait out their 3 attempts (12 requests); the other 12 are not sent while
    the endpoint is taken as down, and fail at once naming it. Before, each of the 4 waves waited
    out its own attempts (48 requests: a step of the demo took 281 s to fail with the defaults)."""
    from dagster_rl.core.steps import judge_all

    with OpenAIStub(delay_s=30.0) as silent:
        judge = LLMJudge(
            client=OpenAIChatClient(silent.base_url, timeout_s=0.3),
            model=STUB_MODEL,
            journal=JudgeJournal(store),
            grading=SecretSearchGrading(),
            limits=Limits(max_retries=2, timeout_s=60.0, max_concurrency=4),
        )
        outcomes = judge_all(experiment(), [trajectory(i) for i in range(16)], judge)
        received = silent.received
    assert received == 12
    errors = sorted(o.error for o in outcomes)
    assert len(errors) == 16
    waited = [e for e in errors if "did not answer within 0.3 s" in e and "not sent" not in e]
    not_sent = [e for e in errors if "not sent: judge endpoint" in e]
    assert len(waited) == 4 and len(not_sent) == 12, errors
    assert (
        "(3 attempt(s) of at most 0.3 s: the judge environment's max_retries and request_timeout_s) failed after 3 attempt(s)"
        in waited[0]
    )
    assert f"judge endpoint {silent.base_url}/chat/completions answered none of the 3 attempt(s) of judging" in not_sent[0]
    assert "it is taken as down for 0.9 s" in not_sent[0]
