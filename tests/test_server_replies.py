"""Issue 20, finding 1: a rollout server's replies are checked before anything is stored.

Each completion must be one the request could have produced (`vllm_client.check_completion`): 1 to
max_tokens tokens, ids in the model's vocabulary, finite log-probabilities <= 0, and a
finish_reason that agrees with the tokens. A reply that breaks a rule fails its trial's attempt,
naming the rule and the server; the attempt is retried, then the trial is skipped; nothing of it is
stored, so a re-run against a correct server computes the step as a clean run does.

The driver tests put a proxy that corrupts the answers (`tests/bad_rollout_server.py`) in front of
a real `dagster-rl serve`: the backend loads its adapters and checks its logprobs mode on the real
server, and only the completions are wrong.
"""

import json
import math
import shutil
from pathlib import Path

import pytest

from dagster_rl.core.records import Rollouts
from dagster_rl.inference.vllm_client import ServerReplyError, ServerSampling, parse_completion
from dagster_rl.tasks.lm.records import LMRollout
from resources import RolloutEnvironment
from tests.bad_rollout_server import CorruptingProxy, logprobs_of
from tests.harness import failure_message
from tests.settings import served

VOCAB = 68  # builtin:tiny-qwen2's
EOS = 1
SERVER = "rollout server http://127.0.0.1:1/v1 (model m)"


def answer(ids: list[int], logprobs: list[float], finish: str) -> bytes:
    """A vLLM /v1/completions answer, as bytes (Python's json writes NaN and Infinity bare, as a server may)."""
    choice = {
        "index": 0,
        "text": "",
        "finish_reason": finish,
        "logprobs": {
            "tokens": [f"token_id:{t}" for t in ids],
            "token_logprobs": logprobs,
            "top_logprobs": None,
            "text_offset": [],
        },
    }
    return json.dumps({"choices": [choice]}).encode()


def parse(raw: bytes, max_tokens: int = 3, stop: tuple[int, ...] = (EOS,)):
    return parse_completion(json.loads(raw), raw, ServerSampling(1.0, 1.0, max_tokens, stop), VOCAB, SERVER)


@pytest.mark.parametrize(
    "ids, logprobs, finish",
    [
        ([5, 6, 7], [-1.0, -0.5, -2.0], "length"),  # max_tokens, no stop token
        ([5, EOS], [-1.0, -0.1], "stop"),  # stopped at the stop token
        ([EOS], [-0.3], "stop"),  # stopped at once: the stop token is the one token
        (
            [5, 6, EOS],
            [-1.0, -0.5, -9999.0],
            "stop",
        ),  # the stop token as the max_tokens-th: 'stop', as vLLM says; -9999 is vLLM's -inf
        ([0, 67, 3], [0.0, -1.0, -1.0], "length"),  # the vocabulary's ends; a log-prob of 0
    ],
)
def test_a_reply_a_correct_server_could_send_is_read(ids, logprobs, finish):
    c = parse(answer(ids, logprobs, finish))
    assert (c.token_ids, c.logprobs, c.finish_reason) == (ids, logprobs, finish)


@pytest.mark.parametrize(
    "ids, logprobs, finish, rule, detail",
    [
        ([5, 6, 7, 8, 9], [-1.0] * 5, "length", "1 <= tokens <= max_tokens", "5 tokens, max_tokens 3"),
        ([], [], "length", "1 <= tokens <= max_tokens", "0 tokens"),
        ([5, 999999, 7], [-1.0] * 3, "length", "token ids in the vocabulary", "token 999999 at position 1 is not in [0, 68)"),
        ([5, -5, 7], [-1.0] * 3, "length", "token ids in the vocabulary", "token -5 at position 1 is not in [0, 68)"),
        ([5, 68, 7], [-1.0] * 3, "length", "token ids in the vocabulary", "token 68 at position 1"),
        ([5, 6, 7], [-1.0, 3.0, -1.0], "length", "log-probabilities finite and <= 0", "3.0 at position 1 (token 6)"),
        ([5, 6, 7], [-1.0, math.nan, -1.0], "length", "log-probabilities finite and <= 0", "nan at position 1"),
        ([5, 6, 7], [-1.0, -math.inf, -1.0], "length", "log-probabilities finite and <= 0", "-inf at position 1"),
        ([5, EOS, 7], [-1.0] * 3, "length", "nothing after a stop token", "stop token 1 at position 1 of 3 tokens"),
        ([5, 6], [-1.0] * 2, "stop", "finish_reason 'stop' <=> the last token is a stop token", "last token 6, stop tokens [1]"),
        ([5, 6], [-1.0] * 2, "length", "finish_reason 'length' <=> exactly max_tokens tokens", "2 tokens, max_tokens 3"),
        (
            [5, 6, EOS],
            [-1.0] * 3,
            "length",
            "finish_reason 'length' <=> exactly max_tokens tokens",
            "it ends at the stop token 1",
        ),
        ([5, 6, 7], [-1.0] * 3, "abort", "finish_reason 'stop' or 'length'", "'abort'"),
        ([5, 6, 7], [-1.0] * 3, None, "finish_reason 'stop' or 'length'", "'None'"),
    ],
)
def test_a_reply_that_breaks_a_rule_is_refused_naming_the_rule_and_the_server(ids, logprobs, finish, rule, detail):
    with pytest.raises(ServerReplyError) as refused:
        parse(answer(ids, logprobs, finish))
    message = str(refused.value)
    assert message.startswith(f"{SERVER} sent a completion that breaks the rule '{rule}"), message
    assert detail in message, message


def test_a_reply_with_more_choices_than_asked_breaks_a_rule():
    """Issue 24: a reply with two choices, when a request asks for one, was read as its first."""
    one = json.loads(answer([5, EOS], [-1.0, -0.1], "stop"))
    two = json.dumps({"choices": [one["choices"][0], {**one["choices"][0], "index": 1}]}).encode()
    with pytest.raises(ServerReplyError) as refused:
        parse(two)
    assert str(refused.value) == f"{SERVER} sent a completion that breaks the rule 'one choice per request (n = 1)': 2 choices"


def test_replies_that_are_not_completions_name_the_server():
    for raw, says in (
        (b'{"choices": []}', "without logprobs"),
        (b'{"choices": [{"finish_reason": "stop", "logprobs": {"tokens": "abc", "token_logprobs": []}}]}', "without logprobs"),
        (answer([5], [-1.0], "length").replace(b'"token_id:5"', b'"five"'), "not 'token_id:<id>'"),
        (answer([5], [-1.0], "length").replace(b"-1.0", b'"x"'), "with log-probabilities"),
    ):
        with pytest.raises(ServerReplyError, match=says) as refused:
            parse(raw, max_tokens=1)
        assert str(refused.value).startswith(SERVER)


# ---- through the driver: a server that answers wrongly -------------------------------------------


def small(**overrides) -> dict:
    """tiny_grpo on the served LoRA, 16 trials a step, completions of up to 3 tokens."""
    return served(
        prompts_per_step=4,
        n_samples=4,
        min_trials_per_step=8,
        sampling={"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 3},
        **overrides,
    )


def env(base_url: str, **kw) -> RolloutEnvironment:
    return RolloutEnvironment(base_url=base_url, max_concurrency=8, **kw)


def huge_id(body, ans):
    logprobs_of(ans)["tokens"][0] = "token_id:999999"
    return ans


def nan_logprob(body, ans):
    logprobs_of(ans)["token_logprobs"][0] = math.nan
    return ans


def extra_tokens_positive_logprob(body, ans):
    """The issue's silent corruption: two tokens past max_tokens, one with log-probability +3."""
    lp = logprobs_of(ans)
    lp["tokens"] += ["token_id:5", "token_id:6"]
    lp["token_logprobs"] += [3.0, -0.5]
    ans["choices"][0]["finish_reason"] = "length"
    return ans


@pytest.mark.parametrize(
    "corrupt, rule",
    [
        (huge_id, "breaks the rule 'token ids in the vocabulary': token 999999 at position 0 is not in [0, 68)"),
        (nan_logprob, "breaks the rule 'log-probabilities finite and <= 0': nan at position 0"),
        (extra_tokens_positive_logprob, "breaks the rule '1 <= tokens <= max_tokens'"),
    ],
)
def test_a_server_that_answers_wrongly_fails_the_step_naming_the_rule_and_nothing_is_cached(lab, tiny_serve, corrupt, rule):
    with CorruptingProxy(tiny_serve.base_url, corrupt) as bad:
        run = lab("bad", small(), rollout=env(bad.base_url, max_retries=1))
        result = run.run("tiny_grpo", "0000", "0000", raise_on_error=False)
        seen = dict(bad.seen)
    assert not result.success
    message = failure_message(result)
    assert "has 0 usable trials of 16 planned" in message, message
    assert f"rollout server {bad.base_url} (model tiny_grpo-v0) sent a completion that {rule}" in message, message
    assert "Out of range float values" not in message
    assert len(seen) == 16 and set(seen.values()) == {2}, seen  # every trial: its attempt and its one retry
    assert run.metadata("tiny_grpo", "rollouts") == {}  # nothing materialized
    kept = [
        run.store().get_model("rollouts", p.name, Rollouts[LMRollout]) for p in (run.home / "artifacts" / "rollouts").iterdir()
    ]
    assert [(r.trajectories, len(r.skipped)) for r in kept] == [([], 16)]  # the one partial: no trajectory of a bad reply

    # the same store against a correct server: nothing bad was kept, the step is computed as a clean run computes it
    fixed = run.reopen(rollout=env(tiny_serve.base_url))
    assert fixed.run("tiny_grpo", "0000", "0000").success
    clean = lab("clean", small(), rollout=env(tiny_serve.base_url))
    assert clean.run("tiny_grpo", "0000", "0000").success
    ours, theirs = fixed.rollouts("tiny_grpo", "0000"), clean.rollouts("tiny_grpo", "0000")
    assert len(ours.trajectories) == 16 and not ours.skipped
    assert [t.completion_token_ids for t in ours.trajectories] == [t.completion_token_ids for t in theirs.trajectories]
    for a, b in zip(ours.trajectories, theirs.trajectories, strict=True):
        assert a.sampling_logprobs == pytest.approx(b.sampling_logprobs, abs=1e-5)  # the server batches its own way
        assert 1 <= len(a.completion_token_ids) <= 3 and all(0 <= t < VOCAB for t in a.completion_token_ids)
    assert fixed.latest("tiny_grpo", "weights", "0000")["n_trials"] == 16


def test_bad_replies_of_some_trials_are_retried_then_skipped_and_never_stored(lab, tiny_serve):
    """Trials whose seed is 0 mod 3 always get the issue's silent corruption (extra tokens, a log-prob
    of +3): they are skipped, the step goes on without them. Those 1 mod 3 get it on their first
    attempt only: the retry is correct, and they are stored as a correct server answered them."""

    def some(body, ans):
        seed = body["seed"]
        if seed % 3 == 0 or (seed % 3 == 1 and seen_before.setdefault(seed, 0) == 0):
            seen_before[seed] = seen_before.get(seed, 0) + 1
            return extra_tokens_positive_logprob(body, ans)
        return None

    seen_before: dict[int, int] = {}
    with CorruptingProxy(tiny_serve.base_url, some) as bad:
        run = lab("some", small(), rollout=env(bad.base_url, max_retries=2))
        assert run.run("tiny_grpo", "0000", "0000").success
        seen, corrupted = dict(bad.seen), dict(bad.corrupted)
    always = {s for s in seen if s % 3 == 0}
    once = {s for s in seen if s % 3 == 1}
    assert always and once
    assert all(seen[s] == 3 for s in always) and all(seen[s] == 2 for s in once)  # retried: 3 attempts, or 2
    stored = run.rollouts("tiny_grpo", "0000")
    assert {t.seed % 2**63 for t in stored.trajectories}.isdisjoint(always)
    assert len(stored.skipped) == len(always) and len(stored.trajectories) == 16 - len(always)
    for t in stored.trajectories:  # nothing of a bad reply: every completion as a correct server sends it
        assert 1 <= len(t.completion_token_ids) <= 3 and all(lp <= 0 for lp in t.sampling_logprobs)
    meta = run.latest("tiny_grpo", "weights", "0000")
    assert meta["skipped_trials"] == len(always) and meta["n_trials"] == 16 - len(always)
    assert sum(corrupted.values()) == 3 * len(always) + len(once)

    # a re-run against a correct server attempts only the skipped trials; the step is then complete
    fixed = run.reopen(rollout=env(tiny_serve.base_url))
    assert fixed.run("tiny_grpo", "0000", "0000").success
    assert fixed.latest("tiny_grpo", "weights", "0000")["n_trials"] == 16
    assert not fixed.rollouts("tiny_grpo", "0000").skipped


# ---- the adapter folder the server is told to load ---------------------------------------------


def test_the_adapter_folder_holds_the_bytes_the_run_read_or_is_refused_or_rewritten(tmp_path):
    """Without adapter_dir the server loads the weights' artifact folder: it is re-read without
    following links and must hold the bytes the run read through the store. Under adapter_dir the
    copy is checked the same way, and rewritten when it differs or is a link (the link's target is
    never touched); a link in place of adapter_dir's experiment folder is refused."""
    from dagster_rl.core.task import Endpoint
    from dagster_rl.store.artifact_store import ArtifactStore
    from dagster_rl.tasks.lm.experiment import LMExperiment
    from dagster_rl.tasks.lm.loop import LMLoop
    from dagster_rl.tasks.lm.model.policy import ADAPTER, ADAPTER_CONFIG
    from dagster_rl.tasks.lm.rollout.openai_client import RolloutServerError, ServerRollouts

    exp = LMExperiment.model_validate(small())
    store = ArtifactStore(f"file://{tmp_path}/artifacts")
    behavior = LMLoop().initial_weights(exp, store)
    folder = tmp_path / "artifacts" / "weights" / behavior.ref.key
    direct = ServerRollouts(Endpoint("http://127.0.0.1:1/v1"))
    assert direct.adapter_folder(exp, behavior) == str(folder)
    original = (folder / ADAPTER).read_bytes()
    (folder / ADAPTER).write_bytes(original[:-8] + b"\0" * 8)  # changed after the run read it
    with pytest.raises(
        RolloutServerError, match=f"the adapter folder {folder} no longer holds the weights v0 .*its {ADAPTER} holds other bytes"
    ):
        direct.adapter_folder(exp, behavior)
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(original)
    (folder / ADAPTER).unlink()
    (folder / ADAPTER).symlink_to(outside)  # the same bytes, through a link
    with pytest.raises(RolloutServerError, match="is a symbolic link .* links are never followed"):
        direct.adapter_folder(exp, behavior)

    shared = tmp_path / "shared"
    copying = ServerRollouts(Endpoint("http://127.0.0.1:1/v1", adapter_dir=str(shared)))
    copy = Path(copying.adapter_folder(exp, behavior))
    assert copy.parent == shared / exp.name and {p.name: p.read_bytes() for p in copy.iterdir()} == {
        ADAPTER: behavior.payload[ADAPTER],
        ADAPTER_CONFIG: behavior.payload[ADAPTER_CONFIG],
    }
    (copy / ADAPTER).write_bytes(b"tampered")  # a copy changed behind the run's back is not trusted
    assert copying.adapter_folder(exp, behavior) == str(copy) and (copy / ADAPTER).read_bytes() == behavior.payload[ADAPTER]
    decoy = tmp_path / "decoy"
    decoy.mkdir()
    (decoy / ADAPTER).write_bytes(b"decoy")
    shutil.rmtree(copy)
    copy.symlink_to(decoy)  # a link in place of the copy: moved aside, the copy written anew
    assert copying.adapter_folder(exp, behavior) == str(copy) and not copy.is_symlink()
    assert (copy / ADAPTER).read_bytes() == behavior.payload[ADAPTER] and (decoy / ADAPTER).read_bytes() == b"decoy"
    shutil.rmtree(shared / exp.name)
    (shared / exp.name).symlink_to(decoy)  # a link in place of the experiment's folder: refused, nothing written through it
    with pytest.raises(RolloutServerError, match=f"adapter_dir {shared}: .*is a symbolic link"):
        copying.adapter_folder(exp, behavior)
    assert [p.name for p in decoy.iterdir()] == [ADAPTER]
    # what a server the rollout environment starts is told to allow (DAGSTER_RL_ADAPTER_ROOTS)
    assert direct.adapter_root(behavior) == str(tmp_path / "artifacts" / "weights")
    assert copying.adapter_root(behavior) == str(shared)
