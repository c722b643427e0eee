"""The `openai_server` backend against a real vLLM (the CPU build, `make vllm`), started and stopped by
the rollout environment's `server_command` (tests/vllm_server.py), on a model folder that carries
Qwen2.5-Instruct's sampling defaults in its generation_config.json:

1. a range through the driver is on-policy at every step (the `on_policy` check, float32 <= 1e-3);
2. each weights version is served as `<exp>-v<version>` and older versions are unloaded;
3. a run that crashed mid-range and resumed against the same server continues the version sequence,
   and ends within the numerics contract of an uninterrupted run;
4. temperature 0.7 with top_p 1 is on-policy under `--logprobs-mode processed_logprobs`;

and that a request that leaves fields to the server's defaults fails the step loudly, that the
requests state every sampling field vLLM's CompletionRequest has, that `dagster-rl serve` answers
like vLLM, that a model vLLM's CPU attention cannot run is a clear error of the managed start, and
that a server reporting raw log-probabilities is refused before a rollout.
Each test prints the numbers it measured (`pytest -s`)."""

import json
import re
import subprocess

import pytest
import torch
from safetensors.torch import load as load_safetensors

from dagster_rl.base.retries import Limits
from dagster_rl.core.task import RolloutEnv, task_of
from dagster_rl.inference.http_json import JSONEndpoint
from dagster_rl.inference.server_process import ServerStartError, vllm_cpu_command
from dagster_rl.inference.vllm_client import NEUTRAL_SAMPLING, VLLM_VERSION, ServerSampling, VLLMClient, completion_body
from dagster_rl.store.artifact_store import ArtifactStore
from dagster_rl.tasks.lm.data.prompts import load_prompt_set, prompts_for_step
from dagster_rl.tasks.lm.experiment import LMExperiment
from dagster_rl.tasks.lm.loop import LMLoop
from dagster_rl.tasks.lm.model.policy import ADAPTER, load_policy, save_checkpoint
from dagster_rl.tasks.lm.model.tiny import save_tiny_model
from dagster_rl.tasks.lm.records import plan_requests
from dagster_rl.tasks.lm.rollout.openai_client import RolloutServerError
from dagster_rl.tasks.lm.settings import LoRASettings, PolicySettings
from resources import RolloutEnvironment
from tests import REPO
from tests.harness import failure_message
from tests.lm_fixtures import FLOAT32_TOLERANCE
from tests.machine import free_port
from tests.serve_process import ServeProcess
from tests.settings import shipped_settings
from tests.vllm_server import LOADED, VLLM_PYTHON, require_vllm, vllm_model

NAME = "vllm_grpo"
STEPS = ("0000", "0001", "0002", "0003")
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # vLLM adapts no lm_head
REMOVED = re.compile(r"Removed LoRA adapter: name '([^']+)'")


def experiment(model: str, name: str = NAME, **overrides) -> dict:
    """tiny_grpo's task on the vLLM-servable model: 4 prompts x 4 samples a step, 4 new tokens, no warm-up."""
    raw = shipped_settings("tiny_grpo")
    raw.pop("warmup")
    raw.update(
        name=name, n_steps=8, prompts_per_step=4, n_samples=4, min_trials_per_step=8,
        task={"kind": "verifiable_prompts", "source": {"kind": "synthetic", "ops": ["last"], "n_eval": 16}, "eval_max_new_tokens": 1},
        policy={"base_model": model, "lora": {"rank": 8, "alpha": 16, "target_modules": PROJECTIONS, "init_seed": 7}},
        sampling={"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 4},
        rollout={"backend": "openai_server"},
    )  # fmt: skip
    for key, value in overrides.items():
        raw[key] = {**raw[key], **value} if isinstance(value, dict) and isinstance(raw.get(key), dict) else value
    return raw


def on_policy_evaluations(lab, name: str) -> dict[str, object]:
    """partition -> the latest on_policy evaluation."""
    out = {}
    for e in reversed(lab.check_evaluations(name, "on_policy")):  # oldest first: the latest wins
        out[e.partition] = e
    return out


def served_adapters(client: VLLMClient) -> dict[str, str]:
    return {c["id"]: c["root"] for c in client.models() if c.get("parent")}


def test_the_versions_the_tests_run_are_the_pinned_ones():
    """make vllm, the `vllm` extra, the deployment's image and the client name one vLLM version."""
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^VLLM_VERSION := (\S+)$", makefile, re.M).group(1) == VLLM_VERSION
    assert f'"vllm=={VLLM_VERSION}"' in (REPO / "pyproject.toml").read_text()
    assert f"image: vllm/vllm-openai:v{VLLM_VERSION}\n" in (REPO / "deploy" / "k8s" / "vllm.yaml").read_text()
    assert "--generation-config=vllm" in (REPO / "deploy" / "k8s" / "vllm.yaml").read_text()
    if VLLM_PYTHON.exists():
        installed = subprocess.run(
            [str(VLLM_PYTHON), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert installed.stdout.strip() == VLLM_VERSION, installed


def test_a_model_whose_head_size_vllms_cpu_attention_cannot_run_is_a_clear_error_of_the_managed_start(tmp_path):
    python = require_vllm()
    model = save_tiny_model(tmp_path / "head16", builtin="tiny-qwen2")  # hidden 64 / 4 heads: head size 16
    port = free_port()
    env = RolloutEnvironment(
        base_url=f"http://127.0.0.1:{port}/v1",
        server_command=vllm_cpu_command(str(model), port, python=python),
        server_startup_timeout_s=900,
    )
    with pytest.raises(ServerStartError) as raised:
        env.endpoint().start([])
    message = str(raised.value)
    print("\nthe managed start said: " + "\n".join(message.splitlines()[:3]))
    assert message.startswith("the rollout server answered /health but could not generate a token of its base model")
    assert "head sizes 32, 64, 80" in message and "head_dim=16" in message  # the hint, and vLLM's own line from its log
    server = env._server
    assert server is None or server.proc is None  # stopped, not left behind
    assert not VLLMClient(env.base_url).healthy()


def test_a_server_that_reports_raw_logprobs_is_refused_before_a_rollout(tmp_path):
    """vLLM's default --logprobs-mode raw_logprobs reports log-probs that ignore the temperature and
    whatever the server does to the logits: the on_policy check could not see what it samples."""
    python = require_vllm()
    model = vllm_model(tmp_path / "model")
    port = free_port()
    command = vllm_cpu_command(str(model), port, python=python, logprobs_mode="raw_logprobs")
    env = RolloutEnvironment(base_url=f"http://127.0.0.1:{port}/v1", server_command=command, server_startup_timeout_s=900)
    exp = LMExperiment.model_validate(experiment(str(model)))
    store = ArtifactStore(f"file://{tmp_path}/artifacts")
    prompts = load_prompt_set(exp.task.source)
    requests = plan_requests(prompts_for_step(prompts.train, exp.seed, 0, 2), exp.seed, 0, 2)
    try:
        backend = task_of(exp.kind).backend("rollout", exp, RolloutEnv(Limits(), tmp_path, env.endpoint()))
        with pytest.raises(RolloutServerError, match="do not depend on the temperature.*--logprobs-mode processed_logprobs"):
            backend.generate(exp, requests, LMLoop().initial_weights(exp, store), prompts.template)
    finally:
        env.teardown_after_execution(None)
    assert not VLLMClient(env.base_url).healthy()


def test_the_requests_state_every_sampling_field_of_vllms_completion_request():
    """Every field of the installed vLLM's CompletionRequest is either sent, or one that changes
    neither the sampled tokens nor their log-probabilities: a vLLM that adds a field fails here."""
    python = require_vllm()
    listed = subprocess.run(
        [python, "-c", "import json; from vllm.entrypoints.openai.completion.protocol import CompletionRequest as C; "
         "print(json.dumps({n: repr(f.get_default(call_default_factory=True)) for n, f in sorted(C.model_fields.items())}))"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr[-3000:]
    defaults = json.loads(listed.stdout.strip().splitlines()[-1])  # field -> repr of vLLM's default
    fields = set(defaults)
    body = completion_body("m", [1], ServerSampling(1.0, 1.0, 4, (1,)), seed=0)
    not_sampling = {
        "add_special_tokens",  # text prompts only: ours are token ids
        "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",  # the text, not the tokens
        "length_penalty",  # beam search only (use_beam_search: false)
        "truncation_side",  # only with truncate_prompt_tokens (null: never truncated)
        "prompt_logprobs", "prompt_embeds", "suffix", "user", "request_id", "session_id", "priority", "cache_salt",
        "return_token_ids", "return_token_offsets", "return_mm_kwargs", "mm_payload", "routed_experts_prompt_start",
        "stream_options", "stream_interval", "kv_transfer_params", "ec_transfer_params",
    }  # fmt: skip
    assert set(body) <= fields, f"sent but unknown to vLLM {VLLM_VERSION}: {set(body) - fields}"
    assert fields - set(body) <= not_sampling, (
        f"fields of vLLM's CompletionRequest the requests leave to the server: {fields - set(body) - not_sampling}"
    )
    # the one table of neutral sampling fields (what the requests send, what dagster-rl serve accepts):
    # every row a request sends is sent, no row vLLM does not know is sent, and vLLM's own default of
    # each row it knows is one of the row's neutral values (a row left out is neutral on vLLM too)
    assert {n for n, f in NEUTRAL_SAMPLING.items() if f.sent} <= set(body)
    assert all(not NEUTRAL_SAMPLING[n].sent for n in set(NEUTRAL_SAMPLING) - fields), set(NEUTRAL_SAMPLING) - fields
    not_neutral = {
        n: defaults[n] for n, f in NEUTRAL_SAMPLING.items() if n in defaults and defaults[n] not in {repr(v) for v in f.accepted}
    }
    assert not not_neutral, f"vLLM {VLLM_VERSION}'s defaults that are not neutral values of NEUTRAL_SAMPLING: {not_neutral}"


def test_a_completion_stops_where_the_sampler_stops_not_at_the_generation_configs_eos_ids(vllm):
    """The folder's generation_config.json lists eos ids [1, 0]; the tokenizer's eos, where the
    project's sampler stops, is 1. Left to vLLM, a completion also stops at 0; the requests stop at 1 only."""
    http = JSONEndpoint(vllm.base_url, timeout_s=120)
    sampling = ServerSampling(1.0, 1.0, 48, (1,))
    ours, defaults = [], []
    for seed in range(16):
        body = completion_body(vllm.model, [3, 9, 11, 4], sampling, seed=seed)
        ours.append(http.call_json("POST", "/completions", body)[0]["choices"][0])
        left = {k: v for k, v in body.items() if k not in ("ignore_eos", "stop_token_ids")}  # vLLM's own eos handling
        defaults.append(http.call_json("POST", "/completions", left)[0]["choices"][0])
    ids = [[int(t.split(":")[1]) for t in c["logprobs"]["tokens"]] for c in ours]
    went_on = sum(0 in i[:-1] for i in ids)
    stopped_at_0 = sum(c["finish_reason"] == "stop" and c["stop_reason"] == 0 for c in defaults)
    print(
        f"\n16 completions of up to 48 tokens: {went_on} went on past token 0 as requested; left to vLLM, {stopped_at_0} stopped at it"
    )
    assert all(c["finish_reason"] == ("stop" if i[-1] == 1 else "length") for c, i in zip(ours, ids, strict=True))
    assert all(c["stop_reason"] == (1 if c["finish_reason"] == "stop" else None) for c in ours)
    assert went_on >= 1 and stopped_at_0 >= 1


def test_seeded_prompts_beyond_the_batched_token_budget_are_served(vllm):
    """vLLM 0.32's CPU build split the prompt of a seeded request once the prompts in flight held
    more than its 2,048 batched tokens (chunked prefill), and its engine died: `CPU Generator does
    not use offset`, then HTTP 500 for every request (found by bench/vllm_rollouts.py: 64 SmolLM2
    rollouts). The managed start turns chunked prefill off."""
    from concurrent.futures import ThreadPoolExecutor

    client = VLLMClient(vllm.base_url, timeout_s=300)
    sampling = ServerSampling(1.0, 1.0, 4, (1,))
    prompts = [[3 + (i + j) % 50 for j in range(200)] for i in range(24)]  # 4,800 prompt tokens at once
    with ThreadPoolExecutor(len(prompts)) as pool:
        done = list(pool.map(lambda ip: client.complete(vllm.model, ip[1], sampling, seed=ip[0], vocab=None), enumerate(prompts)))
    assert all(1 <= len(c.token_ids) <= 4 for c in done) and client.healthy()


@pytest.fixture(scope="module")
def clean(vllm, tmp_path_factory):
    """An uninterrupted range of 4 steps on the shared server, and the server's log of it."""
    from tests.harness import new_dagster_home, open_lab
    from tests.settings import write_experiments

    home = new_dagster_home(tmp_path_factory.mktemp("vllm-clean") / "home")
    lab = open_lab(home, write_experiments(home / "experiments", experiment(vllm.model)), rollout=vllm.shared())
    before = len(vllm.log())
    result = lab.run(NAME, STEPS[0], STEPS[-1], raise_on_error=False)
    assert result.success, failure_message(result)
    lab.server_log = vllm.log()[before:]
    yield lab
    lab.close()


def test_a_range_on_vllm_is_on_policy_at_every_step_and_serves_each_version_as_its_own_adapter(vllm, clean):
    checks = on_policy_evaluations(clean, NAME)
    devs = [clean.latest(NAME, "weights", s)["logp_max_dev"] for s in STEPS]
    print(f"\non-policy max |logp_trainer - logp_vllm| per step, temperature 1: {[f'{d:.2e}' for d in devs]}")
    for step, dev in zip(STEPS, devs, strict=True):
        assert checks[step].passed and checks[step].metadata["logp_max_dev"].value == dev, (step, checks[step].description)
        assert 0.0 <= dev <= FLOAT32_TOLERANCE and clean.latest(NAME, "weights", step)["ratio_max_dev"] <= FLOAT32_TOLERANCE
    # completions end at the tokenizer's eos (1) or at max_new_tokens, never at the folder's other eos id (0)
    trajectories = [t for s in STEPS for t in clean.rollouts(NAME, s).trajectories]
    assert len(trajectories) == 4 * 16 and all(
        t.finish_reason == ("stop" if t.completion_token_ids[-1] == 1 else "length") for t in trajectories
    )

    # each version as <exp>-v<version>, from its weights' artifact folder; older ones unloaded
    weights_dir = f"{clean.home}/artifacts/weights/"
    behavior = [clean.rollouts(NAME, s).behavior_policy for s in STEPS]
    assert [b["version"] for b in behavior] == [0, 1, 2, 3]
    assert [clean.latest(NAME, "weights", s)["weights_version"] for s in STEPS] == [1, 2, 3, 4]
    assert LOADED.findall(clean.server_log) == [(f"{NAME}-v{b['version']}", weights_dir + b["key"]) for b in behavior]
    assert REMOVED.findall(clean.server_log) == [f"{NAME}-v0", f"{NAME}-v1", f"{NAME}-v2"]
    assert served_adapters(vllm.client) == {f"{NAME}-v3": weights_dir + behavior[3]["key"]}


def test_a_crash_mid_range_resumes_on_the_same_server_with_the_next_versions(vllm, clean, lab):
    crashy = lab("crashy", experiment(vllm.model, faults={"crash_driver_at_step": 1}), rollout=vllm.shared())
    before = len(vllm.log())
    assert not crashy.run(NAME, STEPS[0], STEPS[-1], raise_on_error=False).success
    assert sorted(crashy.metadata(NAME, "weights")) == ["0000", "0001"]
    resumed_from = len(vllm.log())
    result = crashy.run(NAME, "0002", "0003", raise_on_error=False)
    assert result.success, failure_message(result)
    log, resumed = vllm.log()[before:], vllm.log()[resumed_from:]

    weights_dir = f"{crashy.home}/artifacts/weights/"
    key = {s: crashy.latest(NAME, "weights", s)["artifact_key"] for s in STEPS}
    assert [crashy.rollouts(NAME, s).behavior_policy["version"] for s in STEPS] == [0, 1, 2, 3]
    assert [crashy.latest(NAME, "weights", s)["weights_version"] for s in STEPS] == [1, 2, 3, 4]
    assert all(path.startswith(weights_dir) for _, path in LOADED.findall(log))  # never the clean run's adapters
    # the resumed run loads no version below the behavior policy's: step 0002's rollouts were made by
    # the crashed run (it generates the next step before its crash) and are a cache hit
    assert LOADED.findall(resumed) == [(f"{NAME}-v3", weights_dir + key["0002"])]
    assert served_adapters(vllm.client) == {f"{NAME}-v3": weights_dir + key["0002"]}  # the clean run's v3 was replaced
    assert all(e.passed for e in on_policy_evaluations(crashy, NAME).values()) and len(on_policy_evaluations(crashy, NAME)) == 4

    # The numerics contract: the same tokens from the same weights (step 0000 samples the initial
    # weights in both runs); vLLM batches the requests as they arrive, so log-probs, hence updates,
    # agree to float rounding only, which Adam turns into moves of up to the learning rate where a
    # gradient is rounding-sized: later steps agree in numbers, and the adapters stay close.
    same = [t.completion_token_ids for t in crashy.rollouts(NAME, "0000").trajectories]
    assert same == [t.completion_token_ids for t in clean.rollouts(NAME, "0000").trajectories]
    for step in STEPS:
        ours, theirs = crashy.latest(NAME, "weights", step), clean.latest(NAME, "weights", step)
        assert ours["mean_reward"] == pytest.approx(theirs["mean_reward"], abs=0.1), step
        for name in ("loss", "ratio", "kl", "grad_norm"):
            assert ours[name] == pytest.approx(theirs[name], rel=1e-4 if step == "0000" else 5e-2, abs=1e-6), (step, name)
    a = load_safetensors(crashy.store().get("weights", key["0003"], ADAPTER))
    b = load_safetensors(clean.store().get("weights", clean.latest(NAME, "weights", "0003")["artifact_key"], ADAPTER))
    worst = max(float((a[n] - b[n]).abs().max()) for n in a)
    lr = LMExperiment.model_validate(experiment(vllm.model)).grpo.learning_rate
    print(f"\nadapter after 4 steps, crashed + resumed vs uninterrupted: max |difference| {worst:.2e} (learning rate {lr})")
    assert worst <= 4 * lr  # at most the four updates' Adam steps


def test_temperature_0_7_is_on_policy_with_processed_logprobs(vllm, lab):
    warm = lab("warm", experiment(vllm.model, name="vllm_t07", sampling={"temperature": 0.7}), rollout=vllm.shared())
    result = warm.run("vllm_t07", "0000", "0001", raise_on_error=False)
    assert result.success, failure_message(result)
    devs = [warm.latest("vllm_t07", "weights", s)["logp_max_dev"] for s in ("0000", "0001")]
    print(f"\non-policy max |logp_trainer - logp_vllm| per step, temperature 0.7: {[f'{d:.2e}' for d in devs]}")
    assert all(0.0 <= d <= FLOAT32_TOLERANCE for d in devs)
    assert all(e.passed for e in on_policy_evaluations(warm, "vllm_t07").values())
    assert all(r.temperature == 0.7 for r in warm.rollouts("vllm_t07", "0001").trajectories)


def test_a_request_that_leaves_fields_to_the_server_fails_the_step_and_its_rollouts_are_sampled_again(vllm, lab, monkeypatch):
    """A client that sends only what the experiment names (an older one) gets the folder's top_k 20,
    repetition_penalty 1.05 and eos list: the on_policy check stops the step, naming the causes."""
    from dagster_rl.base import counters

    off = lab("off", experiment(vllm.model, name="vllm_off"), rollout=vllm.shared())
    monkeypatch.setattr(
        ServerSampling, "fields", lambda s: {"temperature": s.temperature, "top_p": s.top_p, "max_tokens": s.max_tokens}
    )
    result = off.run("vllm_off", "0000", "0001", raise_on_error=False)
    assert not result.success
    message = failure_message(result)
    print(f"\nthe failed step said: {message[:600]}")
    assert "blocking check(s) failed" in message and "on_policy" in message
    for cause in (
        "generation_config.json",
        "--generation-config vllm",
        "--logprobs-mode processed_logprobs",
        "dtype",
        "stale adapter",
    ):
        assert cause in message, cause
    evaluation = on_policy_evaluations(off, "vllm_off")["0000"]
    assert not evaluation.passed and evaluation.metadata["logp_max_dev"].value > 0.05
    assert off.latest("vllm_off", "weights", "0000")["checks_failed"] == "on_policy"
    assert sorted(off.metadata("vllm_off", "weights")) == ["0000"]  # the range stopped there
    moved = list((off.home / "artifacts" / "quarantine" / "rollouts").glob("*.off_policy"))
    assert len(moved) == 1

    monkeypatch.undo()  # the fix; the step is sampled again, not found
    before = counters.read("trials_executed")
    result = off.run("vllm_off", "0000", "0001", raise_on_error=False)
    assert result.success, failure_message(result)
    assert counters.read("trials_executed") - before == 2 * 16
    assert all(e.passed for p, e in on_policy_evaluations(off, "vllm_off").items())
    assert off.latest("vllm_off", "weights", "0000")["checks_failed"] == "none" and "supersedes" in off.latest(
        "vllm_off", "weights", "0000"
    )


def shape(value):
    """A JSON value's shape: keys and types (a dict keyed by tokens is one shape, whatever the tokens)."""
    if isinstance(value, dict):
        if value and all(str(k).startswith("token_id:") for k in value):
            return {"token_id:*": sorted({shape(v) for v in value.values()})[0]}
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return "number" if isinstance(value, (int, float)) and not isinstance(value, bool) else type(value).__name__


def same_shape(ours, theirs, where: str = "") -> None:
    """`ours` (dagster-rl serve) has no key vLLM lacks, and each of its values has vLLM's shape."""
    if isinstance(ours, dict):
        assert isinstance(theirs, dict), (where, ours, theirs)
        assert set(ours) <= set(theirs), f"{where}: serve answers {set(ours) - set(theirs)}, which vLLM does not"
        for k in ours:
            same_shape(ours[k], theirs[k], f"{where}.{k}")
    elif isinstance(ours, list):
        assert isinstance(theirs, list) and bool(ours) == bool(theirs), (where, ours, theirs)
        if ours:
            same_shape(ours[0], theirs[0], f"{where}[0]")
    else:
        assert ours == theirs, (where, ours, theirs)


def test_dagster_rl_serve_answers_the_same_requests_as_vllm(vllm, tmp_path):
    """The same requests to both servers, on the same model folder and adapter: the same shapes, the
    same tokens where both sample identically (greedy), log-probs to float rounding."""
    policy = load_policy(PolicySettings(base_model=vllm.model, lora=LoRASettings(rank=8, target_modules=tuple(PROJECTIONS))))
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in policy.trainable():
            if "lora_B" in n:
                p.normal_(0.0, 0.2)  # an adapter that changes the model
    from dagster_rl.tasks.lm.model.policy import checkpoint_bytes

    adapter = str(save_checkpoint(tmp_path / "adapter", checkpoint_bytes(policy, None)))
    prompts = [[3, 9, 11, 4], [5, 7, 2], [12, 13, 14, 15, 16]]
    greedy = ServerSampling(0.0, 1.0, 6, (1,))
    with ServeProcess(tmp_path, model=vllm.model, adapter_roots=[str(tmp_path)]) as serve:
        answers = {}
        for name, base_url in (("serve", serve.base_url), ("vllm", vllm.base_url)):
            client, http = VLLMClient(base_url, timeout_s=120), JSONEndpoint(base_url, timeout_s=120)
            client.load_adapter("replay-v1", adapter)
            got = []
            for model in (vllm.model, "replay-v1"):
                for prompt in prompts:
                    for logprobs in (0, 3):
                        got.append(
                            http.call_json(
                                "POST", "/completions", completion_body(model, prompt, greedy, seed=5, logprobs=logprobs)
                            )[0]
                        )
                    sampled = completion_body(model, prompt, ServerSampling(0.7, 1.0, 6, (1,)), seed=5)
                    got.append(http.call_json("POST", "/completions", sampled)[0])
                    plain = {**completion_body(model, prompt, greedy, seed=5), "logprobs": None}
                    got.append(http.call_json("POST", "/completions", plain)[0])
            client.unload_adapter("replay-v1")
            answers[name] = got
    worst = 0.0
    for i, (ours, theirs) in enumerate(zip(answers["serve"], answers["vllm"], strict=True)):
        same_shape(shape(ours), shape(theirs), f"request {i}")
        a, b = ours["choices"][0], theirs["choices"][0]
        assert (a["logprobs"] is None) == (b["logprobs"] is None) and a["finish_reason"] in ("stop", "length")
        if i % 4 in (0, 1, 3):  # greedy: both engines take the argmax
            assert a["text"] == b["text"] and a["finish_reason"] == b["finish_reason"] and a["stop_reason"] == b["stop_reason"], i
        if a["logprobs"] is not None and i % 4 in (0, 1):
            assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"], i
            diffs = [abs(x - y) for x, y in zip(a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"], strict=True)]
            worst = max(worst, *diffs)
            for da, db in zip(a["logprobs"]["top_logprobs"], b["logprobs"]["top_logprobs"], strict=True):
                assert set(da) == set(db) and all(abs(da[k] - db[k]) < 1e-4 for k in da), (i, da, db)
    print(f"\ngreedy log-probs, dagster-rl serve vs vLLM: max |difference| {worst:.2e}")
    assert worst < 1e-4
