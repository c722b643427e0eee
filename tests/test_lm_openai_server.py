"""Rollouts over vLLM's OpenAI-compatible API (`openai_server`) against `dagster-rl serve` on 127.0.0.1:
the API's shapes, token-for-token equality with the `hf` engine through the driver, per-trial
failures, a server the rollout environment starts and stops, and a crash + resume on a server that
stays up."""

import re
import time
from dataclasses import dataclass
from dataclasses import field as default

import pytest
import torch

from dagster_rl.base import counters
from dagster_rl.base.retries import Limits
from dagster_rl.core.records import Rollouts, TrialFailed
from dagster_rl.core.task import Backends, Endpoint
from dagster_rl.inference.http_json import EndpointError, JSONEndpoint
from dagster_rl.inference.vllm_client import ServerSampling
from dagster_rl.store.artifact_store import ArtifactStore
from dagster_rl.tasks.lm.data.prompts import load_prompt_set, prompts_for_step
from dagster_rl.tasks.lm.experiment import LMExperiment
from dagster_rl.tasks.lm.loop import LMLoop
from dagster_rl.tasks.lm.model.logprobs import completion_logprobs
from dagster_rl.tasks.lm.model.policy import ADAPTER, OPTIMIZER, STATE, load_base
from dagster_rl.tasks.lm.records import LMRollout, plan_requests
from dagster_rl.tasks.lm.rollout.openai_client import ServerRollouts
from dagster_rl.tasks.lm.rollout.sampling import generate
from dagster_rl.tasks.lm.settings import SamplingSettings
from resources import RolloutEnvironment
from tests.harness import failure_message
from tests.machine import free_port
from tests.serve_process import post, serve_command
from tests.settings import SERVED_LORA, served, tiny_grpo

TINY = "builtin:tiny-qwen2"


def server_sampling(temperature: float, max_tokens: int, stop: int = 1) -> ServerSampling:
    return ServerSampling(temperature, 1.0, max_tokens, stop_token_ids=(stop,))  # builtin:tiny-qwen2's eos is 1


def test_the_server_speaks_vllms_api_and_samples_as_the_engine(tiny_serve):
    cards = tiny_serve.client.models()
    assert cards[0]["id"] == TINY and cards[0]["root"] == TINY and cards[0]["parent"] is None and cards[0]["object"] == "model"
    prompt = [3, 9, 11, 4]
    status, raw = post(tiny_serve, "/completions", {
        "model": TINY, "prompt": prompt, "max_tokens": 5, "temperature": 0.7, "top_p": 1.0, "seed": 1234,
        "logprobs": 0, "return_tokens_as_token_ids": True,
    })  # fmt: skip
    assert status == 200
    assert raw["object"] == "text_completion" and raw["model"] == TINY and raw["id"].startswith("cmpl-")
    choice = raw["choices"][0]
    assert set(choice) >= {"index", "text", "logprobs", "finish_reason", "stop_reason"}
    lp = choice["logprobs"]
    assert set(lp) == {"text_offset", "token_logprobs", "tokens", "top_logprobs"}
    assert all(re.fullmatch(r"token_id:\d+", t) for t in lp["tokens"])
    assert [list(d) for d in lp["top_logprobs"]] == [[t] for t in lp["tokens"]]  # logprobs 0: the sampled token alone
    assert raw["usage"] == {"prompt_tokens": 4, "completion_tokens": len(lp["tokens"]), "total_tokens": 4 + len(lp["tokens"])}

    # the engine's own sampler and log-probabilities, for the same prompt and seed
    model, tok = load_base(TINY)
    sampling = SamplingSettings(temperature=0.7, top_p=1.0, max_new_tokens=5)
    ours = generate(model.eval(), [prompt], [1234], sampling, tok.eos_token_id, tok.pad_token_id)[0]
    via = tiny_serve.client.complete(TINY, prompt, server_sampling(0.7, 5), seed=1234, vocab=68)
    assert via.token_ids == ours.completion_ids == [int(t.split(":")[1]) for t in lp["tokens"]]
    with torch.inference_mode():
        expected = completion_logprobs(model, prompt, ours.completion_ids, 0.7).tolist()
    assert via.logprobs == pytest.approx(expected, abs=1e-6) and via.finish_reason == ours.finish_reason
    other = tiny_serve.client.complete(TINY, prompt, server_sampling(0.7, 5), seed=99, vocab=68)
    assert other.token_ids != via.token_ids  # the seed decides

    # logprobs k: the sampled token's and the top k of the same distribution, the sampled one first, as vLLM
    top = tiny_serve.client.complete(TINY, prompt, server_sampling(0.7, 5), seed=1234, logprobs=3, vocab=68)
    assert top.token_ids == via.token_ids and top.logprobs == pytest.approx(via.logprobs, abs=1e-6)
    for t, lp, d in zip(top.token_ids, top.logprobs, top.top_logprobs, strict=True):
        ids = list(d)
        rest = [d[i] for i in ids[1:]]
        assert ids[0] == t and d[t] == pytest.approx(lp) and rest == sorted(rest, reverse=True)
        assert len(d) == 4 or (len(d) == 3 and lp >= rest[-1])  # listed once when it is among the top 3
    # no logprobs asked: null, as vLLM answers
    status, plain = post(tiny_serve, "/completions", {"model": TINY, "prompt": prompt, "max_tokens": 2, "seed": 1})
    assert status == 200 and plain["choices"][0]["logprobs"] is None
    # a sampling field the server does not implement: a 400 naming it, never silence; its neutral value is accepted
    for field, value in (("top_k", 20), ("repetition_penalty", 1.05), ("min_tokens", 2), ("stop", ["."]), ("min_p", 0.1)):
        status, body = post(tiny_serve, "/completions", {"model": TINY, "prompt": prompt, field: value})
        assert status == 400 and body["error"]["param"] == field and field in body["error"]["message"], (field, body)
    assert (
        post(tiny_serve, "/completions", {"model": TINY, "prompt": prompt, "top_k": 0, "repetition_penalty": 1.0, "stop": []})[0]
        == 200
    )
    status, body = post(tiny_serve, "/completions", {"model": TINY, "prompt": prompt, "stop_token_ids": [5]})  # eos 1 and 5
    assert status == 400 and body["error"]["param"] == "stop_token_ids"

    # errors have vLLM's shape: {"error": {message, type, param, code}} with the HTTP status
    status, body = post(tiny_serve, "/completions", {"model": "nope", "prompt": prompt})
    assert (
        status == 404
        and body["error"]["type"] == "NotFoundError"
        and body["error"]["param"] == "model"
        and body["error"]["code"] == 404
    )
    assert post(tiny_serve, "/unload_lora_adapter", {"lora_name": "nope"})[0] == 404
    assert (
        post(tiny_serve, "/load_lora_adapter", {"lora_name": "x", "lora_path": "/no/such/folder"})[0] == 403
    )  # outside --adapter-root
    assert (
        post(tiny_serve, "/load_lora_adapter", {"lora_name": "x", "lora_path": f"{tiny_serve.log_path.parent}/no-such-folder"})[0]
        == 404
    )
    assert post(tiny_serve, "/completions", {"model": TINY, "prompt": prompt, "stream": True})[0] == 400


def _exp(**overrides) -> LMExperiment:
    return LMExperiment.model_validate(served(**overrides))


def test_the_backend_returns_the_hf_engines_rollouts_and_fails_trial_by_trial(tiny_serve, tmp_path):
    from dagster_rl.tasks.lm.backends import HFRollouts

    exp = _exp(sampling={"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 3})
    store = ArtifactStore(f"file://{tmp_path}/artifacts")
    behavior = LMLoop().initial_weights(exp, store)
    prompts = load_prompt_set(exp.task.source)
    requests = plan_requests(prompts_for_step(prompts.train, exp.seed, 0, 4), exp.seed, 0, 4)
    backend = ServerRollouts(Endpoint(tiny_serve.base_url), Limits(max_retries=0, timeout_s=30, max_concurrency=4))
    via = backend.generate(exp, requests, behavior, prompts.template)
    ref = HFRollouts().generate(exp, requests, behavior, prompts.template)
    assert [r.trial_id for r in via] == [r.trial_id for r in requests]
    for a, b in zip(via, ref, strict=True):
        assert isinstance(a, LMRollout) and isinstance(b, LMRollout)
        assert a.model_dump(exclude={"sampling_logprobs"}) == b.model_dump(exclude={"sampling_logprobs"})
        # the server batches the requests its own way: log-probs agree to float rounding
        assert a.sampling_logprobs == pytest.approx(b.sampling_logprobs, abs=1e-5)
    assert any(len(r.completion_token_ids) > 1 for r in via)
    # the behavior weights are served as <exp>-v<version>, read from their artifact folder
    cards = {c["id"]: c for c in tiny_serve.client.models()}
    assert cards["tiny_grpo-v0"]["root"] == f"{tmp_path}/artifacts/weights/{behavior.ref.key}"

    # a trial slower than the environment's time limit fails on its own, as a TrialFailed per trial
    slow = ServerRollouts(Endpoint(tiny_serve.base_url), Limits(max_retries=1, timeout_s=0.001, max_concurrency=4))
    failed = slow.generate(exp, requests[:3], behavior, prompts.template)
    assert [type(f) for f in failed] == [TrialFailed] * 3
    assert all("did not answer within 0.001 s" in f.error or "longer than" in f.error for f in failed), failed


def test_tiny_grpo_through_a_managed_server_matches_the_hf_engine_token_for_token(lab, tmp_path):
    steps = ("0000", "0001")
    hf = lab("hf", tiny_grpo(policy={"base_model": TINY, "lora": SERVED_LORA}))
    assert hf.run("tiny_grpo", *steps).success
    port = free_port()
    managed = RolloutEnvironment(base_url=f"http://127.0.0.1:{port}/v1", server_command=serve_command(port), max_concurrency=8)
    via = lab("served", served(), rollout=managed)
    result = via.run("tiny_grpo", *steps)
    assert result.success, failure_message(result)
    with pytest.raises(EndpointError), JSONEndpoint(f"http://127.0.0.1:{port}", timeout_s=2) as http:
        http.call("GET", "/health")  # the environment stopped the server it started at the end of the run

    # Step 0000: both runs sample with the initial weights. Step 0001: each run samples with its own
    # step-0 weights, which agree to float rounding only (the server batches what arrives together,
    # and Adam turns rounding-sized gradient differences into lr-sized moves), so the served step is
    # compared with the hf engine sampling with the served run's own behavior weights.
    for step in ("0000", "0001"):
        ours = via.rollouts("tiny_grpo", step)
        theirs = hf.rollouts("tiny_grpo", step).trajectories if step == "0000" else hf_rollouts_of(via, ours)
        assert len(ours.trajectories) == len(theirs) == 64 and not ours.skipped
        for a, b in zip(ours.trajectories, theirs, strict=True):
            assert (a.trial_id, a.prompt_token_ids, a.completion_token_ids, a.behavior_version) == (
                b.trial_id, b.prompt_token_ids, b.completion_token_ids, b.behavior_version,
            )  # fmt: skip
            assert a.sampling_logprobs == pytest.approx(b.sampling_logprobs, abs=1e-5)
        # the engine is part of the rollouts' key: these are two artifacts, not one cache hit
        assert (
            via.latest("tiny_grpo", "rollouts", step)["artifact_key"] != hf.latest("tiny_grpo", "rollouts", step)["artifact_key"]
        )
        assert via.latest("tiny_grpo", "weights", step)["ratio"] == pytest.approx(1.0, abs=1e-6)
    assert via.latest("tiny_grpo", "weights", "0000")["mean_reward"] == hf.latest("tiny_grpo", "weights", "0000")["mean_reward"]


def hf_rollouts_of(lab, rollouts: Rollouts[LMRollout]) -> list[LMRollout]:
    """The hf engine's rollouts of the same requests, sampled with the same behavior weights."""
    from dagster_rl.tasks.lm.backends import HFRollouts

    exp = lab.experiments["tiny_grpo"]
    prompts = load_prompt_set(exp.task.source)
    requests = plan_requests(
        prompts_for_step(prompts.train, exp.seed, rollouts.step, exp.prompts_per_step), exp.seed, rollouts.step, exp.n_samples
    )
    behavior = LMLoop().load_weights(
        exp, lab.store(), str(rollouts.behavior_policy["partition"]), str(rollouts.behavior_policy["key"])
    )
    return sorted(HFRollouts().generate(exp, requests, behavior, prompts.template), key=lambda r: r.trial_id)


def test_a_crash_mid_range_resumes_with_the_behavior_version_on_the_server_that_stayed_up(lab, tiny_serve):
    def env():
        return RolloutEnvironment(base_url=tiny_serve.base_url, max_concurrency=8)

    steps = ("0000", "0001", "0002")
    before = counters.read("trials_executed")
    # prompts of three lengths and completions of up to 4 tokens: batches of other shapes round otherwise
    mixed = {
        "task": {"source": {"kind": "synthetic", "ops": ["copy", "add", "last"], "n_eval": 100}},
        "sampling": {"max_new_tokens": 4},
    }
    clean = lab("clean", served(faults={"flaky_trial_rate": 0.3}, **mixed), rollout=env())
    assert clean.run("tiny_grpo", steps[0], steps[-1]).success
    assert 3 * 64 * 1.15 < counters.read("trials_executed") - before < 3 * 64 * 1.5  # flaky trials retried one by one
    assert all(clean.latest("tiny_grpo", "weights", s)["n_trials"] == 64 for s in steps)

    crashy = lab("crashy", served(faults={"crash_driver_at_step": 0}, **mixed), rollout=env())
    log_before_crash = len(tiny_serve.log())
    assert not crashy.run("tiny_grpo", steps[0], steps[-1], raise_on_error=False).success
    assert sorted(crashy.metadata("tiny_grpo", "weights")) == ["0000"]
    log_before_resume = len(tiny_serve.log())
    assert crashy.run("tiny_grpo", "0001", "0002").success  # resume, on the server that stayed up

    # every adapter the crashed and the resumed run loaded is the behavior policy's own version, from
    # this run's store; the resumed run never went back to v0. (Step 0001's rollouts may have been
    # generated by the crashed run, which generates a step ahead, and are then a cache hit.)
    pattern = r"Loaded new LoRA adapter: name '([^']+)', path '([^']+)'"
    loads = re.findall(pattern, tiny_serve.log()[log_before_crash:])
    resumed = re.findall(pattern, tiny_serve.log()[log_before_resume:])
    weights_dir = f"{crashy.home}/artifacts/weights/"
    key = {s: crashy.latest("tiny_grpo", "weights", s)["artifact_key"] for s in steps}
    assert ("tiny_grpo-v1", weights_dir + key["0000"]) in loads
    # v2 was loaded by the clean run from its own store: same name, other path, so it was replaced
    assert ("tiny_grpo-v2", weights_dir + key["0001"]) in resumed
    assert {name for name, _ in resumed} <= {"tiny_grpo-v1", "tiny_grpo-v2"}
    assert all(path.startswith(weights_dir) for _, path in loads)
    assert [crashy.latest("tiny_grpo", "rollouts", s)["behavior_policy"]["version"] for s in ("0001", "0002")] == [1, 2]
    assert [crashy.latest("tiny_grpo", "weights", s)["weights_version"] for s in ("0001", "0002")] == [2, 3]
    served_now = {c["id"]: c["root"] for c in tiny_serve.client.models() if c["parent"]}
    assert served_now == {"tiny_grpo-v2": weights_dir + key["0001"]}  # older versions unloaded
    # The server batches whatever requests arrive together (the clean run's flaky trials were retried
    # one by one), so log-probs agree with the clean run's to float rounding, not bit for bit. At lag 0
    # that noise stays out of the update: the ratio's old policy is the trainer's own log-probs. So
    # every step samples the same tokens and trains the same adapter and optimizer state, byte for byte.
    noisy = 0
    for step in steps:
        ours, theirs = crashy.rollouts("tiny_grpo", step).trajectories, clean.rollouts("tiny_grpo", step).trajectories
        assert [t.completion_token_ids for t in ours] == [t.completion_token_ids for t in theirs], step
        pairs = [
            (x, y)
            for a, b in zip(ours, theirs, strict=True)
            for x, y in zip(a.sampling_logprobs, b.sampling_logprobs, strict=True)
        ]
        assert max(abs(x - y) for x, y in pairs) <= 1e-5, step
        noisy += sum(x != y for x, y in pairs)
        mine, clean_files = (
            lab_.store().get_all("weights", lab_.latest("tiny_grpo", "weights", step)["artifact_key"]) for lab_ in (crashy, clean)
        )
        for name in (ADAPTER, OPTIMIZER, STATE):
            assert mine[name] == clean_files[name], (step, name)
        for name in ("loss", "ratio", "kl", "grad_norm", "mean_reward"):
            assert crashy.latest("tiny_grpo", "weights", step)[name] == clean.latest("tiny_grpo", "weights", step)[name], (
                step,
                name,
            )
    print(f"{noisy} sampled log-probs differ between the runs (the server's batch shapes)")


def test_a_server_of_another_base_model_is_refused_with_what_to_do(tiny_serve, tmp_path):
    exp = _exp(policy={"base_model": "/models/Qwen2.5-0.5B-Instruct"})
    backend = ServerRollouts(Endpoint(tiny_serve.base_url))
    with pytest.raises(Exception, match="serves builtin:tiny-qwen2 .*not /models/Qwen2.5-0.5B-Instruct.*vllm serve"):
        backend._check_base(exp, tiny_serve.client.models())


@dataclass
class Landings(ServerRollouts):
    """The `openai_server` backend, recording when each rollout landed (handed to `on_done`)."""

    landed: list[float] = default(default_factory=list)

    def generate(self, exp, requests, behavior, template, on_done=None):
        def record(rollout: LMRollout) -> None:
            self.landed.append(time.monotonic())
            if on_done is not None:
                on_done(rollout)

        return super().generate(exp, requests, behavior, template, record)


def test_each_rollout_goes_to_the_llm_judge_as_it_lands_while_the_others_still_generate(tiny_serve, tmp_path):
    """The step judges through the LLM judge (a stub answering in 0.1 s): the first judge request
    arrives before the last rollout lands; a judgement that fails is a skipped trial, its rewards a
    partial artifact, never stored under their key; rewards are in trial order."""
    from dagster_rl.core.steps import rewards_key
    from dagster_rl.judges.journal import JudgeJournal
    from dagster_rl.judges.llm_judge import LLMJudge, OpenAIChatClient
    from dagster_rl.tasks.lm.backends import HFRollouts, LMTrainer
    from dagster_rl.tasks.lm.code_versions import CODE_VERSIONS
    from dagster_rl.tasks.lm.grading import LMGrading
    from tests.openai_stub import STUB_MODEL, OpenAIStub

    exp = _exp(prompts_per_step=4, n_samples=4, min_trials_per_step=8, sampling={"temperature": 1.0, "top_p": 1.0})
    store = ArtifactStore(f"file://{tmp_path}/artifacts")
    loop = LMLoop()
    behavior, prompts = loop.initial_weights(exp, store), loop.prompt_set(exp)
    rollout = Landings(Endpoint(tiny_serve.base_url), Limits(max_retries=0, timeout_s=30, max_concurrency=2))
    with OpenAIStub(delay_s=0.1) as stub:
        client = OpenAIChatClient(stub.base_url, timeout_s=10.0)
        judge = LLMJudge(client, STUB_MODEL, JudgeJournal(store), LMGrading(), Limits(max_retries=0, max_concurrency=4))
        stub.fail_next(1)  # the first judgement fails (no retries): its trial is skipped
        gen = loop.generate(exp, 0, behavior, prompts, store, Backends(rollout, judge, LMTrainer()), print)
        arrived = list(stub.received_at)
    assert len(rollout.landed) == len(arrived) == 16  # every rollout landed once and was judged once
    assert min(arrived) < max(rollout.landed), "the first judgement started only after the last rollout landed"
    assert 0.0 < gen.judge_hidden_seconds <= gen.judge_seconds <= gen.seconds
    ids = [r.trial_id for r in gen.rewards.rewards]
    assert ids == sorted(ids) and len(ids) == 15 and len(gen.rewards.skipped) == 1
    key = rewards_key(CODE_VERSIONS["rewards"], judge, gen.rollouts_ref, rubric=exp.rubric)
    assert not store.exists("rewards", key) and store.partial("rewards", key) == gen.rewards_ref.key
    # the hf engine hands an attempt's batch over once it is generated: every rollout, each once
    landed: list[LMRollout] = []
    requests = plan_requests(prompts_for_step(prompts.train, exp.seed, 0, 2), exp.seed, 0, 2)
    assert HFRollouts().generate(exp, requests, behavior, prompts.template, landed.append) == landed and len(landed) == 4
