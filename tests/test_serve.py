"""Issue 20, finding 6: `dagster-rl serve` degrades, never wedges.

In process (the engine, the batcher, the request parser): unloading the last adapter returns to
the base; a load that fails leaves the model as it was; adapters load only from allowed roots; every
field of a wrong type is a 400 naming it; the batcher answers every request with its own result
under heavy concurrency, drops requests whose client went away, and stops a batch nobody waits for.
Over HTTP (one server for the module): the issue's cases, a client that goes away, and hundreds of
concurrent connections each answered with its own completion.
"""

import json
import random
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from pathlib import Path

import httpx
import pytest
import torch

from dagster_rl.inference.vllm_client import ServerSampling, VLLMClient
from dagster_rl.tasks.lm.model.policy import ADAPTER, ADAPTER_CONFIG, checkpoint_bytes, load_policy, save_checkpoint
from dagster_rl.tasks.lm.serve.app import App
from dagster_rl.tasks.lm.serve.batcher import BatchCancelled, Batcher
from dagster_rl.tasks.lm.serve.cli import add_arguments
from dagster_rl.tasks.lm.serve.engine import Engine
from dagster_rl.tasks.lm.serve.errors import APIError
from dagster_rl.tasks.lm.serve.protocol import CompletionRequest, CompletionResult, parse_completion_request
from dagster_rl.tasks.lm.settings import LoRASettings, PolicySettings
from tests.serve_process import ServeProcess, post

TINY = "builtin:tiny-qwen2"
PROMPT = [3, 9, 11, 4]


def adapter(folder: Path, seed: int, rank: int = 4) -> Path:
    """A LoRA adapter of the tiny model that changes it (B drawn, not 0)."""
    policy = load_policy(PolicySettings(base_model=TINY, lora=LoRASettings(rank=rank, target_modules=("q_proj", "v_proj"))))
    torch.manual_seed(seed)
    with torch.no_grad():
        for n, p in policy.trainable():
            if "lora_B" in n:
                p.normal_(0.0, 0.5)
    return save_checkpoint(folder, checkpoint_bytes(policy, None))


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """The allowed adapter root: two good adapters and three broken ones."""
    root = tmp_path_factory.mktemp("adapters")
    good = adapter(root / "good", seed=1)
    adapter(root / "other", seed=2)
    config = json.loads((good / ADAPTER_CONFIG).read_text())
    broken = {
        "garbage": (config, b"not safetensors" * 10),
        "rank_mismatch": ({**config, "r": 8}, (good / ADAPTER).read_bytes()),
        "no_target": ({**config, "target_modules": ["foo_proj"]}, (good / ADAPTER).read_bytes()),
    }
    for name, (cfg, weights) in broken.items():
        (root / name).mkdir()
        (root / name / ADAPTER_CONFIG).write_text(json.dumps(cfg))
        (root / name / ADAPTER).write_bytes(weights)
    return root


@pytest.fixture(scope="module")
def engine(root) -> Engine:
    return Engine(TINY, adapter_roots=[str(root)])


@pytest.fixture
def clean(engine):
    """The engine with no adapter before and after the test."""
    for name in list(engine.adapters):
        engine.unload_adapter(name)
    yield engine
    for name in list(engine.adapters):
        engine.unload_adapter(name)


def sample(engine: Engine, model: str = TINY, seed: int = 7) -> CompletionResult:
    """One completion of PROMPT with the top 3 log-probs: what the model is, in numbers."""
    return engine.run_batch([CompletionRequest(model, PROMPT, 6, 1.0, 1.0, seed, logprobs=3)])[0]


def lora_layers(engine: Engine) -> int:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return sum(isinstance(m, BaseTunerLayer) for m in engine.base.modules())


def test_unloading_the_last_adapter_returns_to_the_base(clean, root):
    engine = clean
    base = sample(engine)
    engine.load_adapter("a", str(root / "good"))
    adapted = sample(engine, "a")
    assert adapted != base and sample(engine) == base  # the adapter changes the model; the base is served beside it
    engine.unload_adapter("a")
    assert engine.peft is None and lora_layers(engine) == 0 and "peft_config" not in vars(engine.base)
    assert sample(engine) == base  # the base model's numbers, exactly
    engine.load_adapter("a", str(root / "good"))  # and it loads again
    assert sample(engine, "a") == adapted


@pytest.mark.parametrize("broken", ["garbage", "rank_mismatch", "no_target"])
@pytest.mark.parametrize("loaded", [False, True], ids=["first-load", "beside-another"])
def test_a_failed_load_leaves_no_trace(clean, root, broken, loaded):
    engine = clean
    if loaded:
        engine.load_adapter("a", str(root / "good"))
    before = (
        engine.model_cards()[0]["id"],
        list(engine.adapters),
        lora_layers(engine),
        sample(engine),
        loaded and sample(engine, "a"),
    )
    with pytest.raises(APIError) as failed:
        engine.load_adapter("b", str(root / broken))
    assert failed.value.status == HTTPStatus.BAD_REQUEST and failed.value.param == "lora_path"
    assert f"Loading lora b failed: {root / broken} is not a LoRA adapter of {TINY}" in failed.value.message
    assert "nothing was loaded" in failed.value.message
    after = (
        engine.model_cards()[0]["id"],
        list(engine.adapters),
        lora_layers(engine),
        sample(engine),
        loaded and sample(engine, "a"),
    )
    assert after == before
    if loaded:  # PEFT keeps no trace of it either
        assert list(engine.peft.peft_config) == [engine._internal["a"]]
        with pytest.raises(APIError, match="load the adapter in place"):
            engine.load_adapter("a", str(root / "other"))
        with pytest.raises(APIError):  # a failed in-place load keeps the adapter it would have replaced
            engine.load_adapter("a", str(root / broken), inplace=True)
        assert sample(engine, "a") == before[4]
    engine.load_adapter("b", str(root / "other"))  # the name is free, the model loads the next adapter
    assert set(engine.adapters) == ({"a", "b"} if loaded else {"b"})


def test_any_name_is_served_and_an_in_place_load_replaces_the_weights(clean, root):
    engine = clean
    engine.load_adapter("a.b", str(root / "good"))  # PEFT cannot name an adapter a.b: the engine names it internally
    good = sample(engine, "a.b")
    engine.load_adapter("a.b", str(root / "other"), inplace=True)
    other = sample(engine, "a.b")
    assert other != good and list(engine.adapters) == ["a.b"] and len(engine.peft.peft_config) == 1
    engine.unload_adapter("a.b")
    assert engine.peft is None


def test_adapters_load_only_from_the_allowed_roots(clean, root, tmp_path, monkeypatch):
    engine = clean
    outside = adapter(tmp_path / "outside", seed=3)
    for path, says in (
        (outside, f"is outside the folders this server loads adapters from ({root}): it resolves to {outside}"),
        (root / ".." / root.name / ".." / "elsewhere", "is outside the folders"),
    ):
        with pytest.raises(APIError) as refused:
            engine.load_adapter("x", str(path))
        assert (
            refused.value.status == HTTPStatus.FORBIDDEN and refused.value.param == "lora_path" and says in refused.value.message
        )
    (root / "link").symlink_to(outside)  # a link in the root to a folder outside it
    (root / "half").mkdir()
    (root / "half" / ADAPTER_CONFIG).write_bytes((outside / ADAPTER_CONFIG).read_bytes())
    (root / "half" / ADAPTER).symlink_to(outside / ADAPTER)  # a link to a file outside it
    try:
        for name in ("link", "half"):
            with pytest.raises(APIError, match="resolves to") as refused:
                engine.load_adapter("x", str(root / name))
            assert refused.value.status == HTTPStatus.FORBIDDEN
    finally:
        (root / "link").unlink()
        (root / "half" / ADAPTER).unlink()
    with pytest.raises(APIError) as missing:
        engine.load_adapter("x", str(root / "half"))
    assert missing.value.status == HTTPStatus.NOT_FOUND
    monkeypatch.setattr(engine, "adapter_roots", ())
    with pytest.raises(APIError, match="none was given: restart it with --adapter-root") as none:
        engine.load_adapter("x", str(root / "good"))
    assert none.value.status == HTTPStatus.FORBIDDEN
    assert engine.adapters == {} and engine.peft is None


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", "abc"),
        ("model", 5),
        ("prompt", [1, "a"]),
        ("prompt", []),
        ("prompt", [68]),
        ("prompt", {"ids": [1]}),
        ("max_tokens", "abc"),
        ("max_tokens", 0),
        ("max_tokens", -1),
        ("max_tokens", 1.5),
        ("max_tokens", True),
        ("temperature", "abc"),
        ("temperature", -1.0),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", 10**400),
        ("top_p", 0.0),
        ("top_p", 2.0),
        ("top_p", "x"),
        ("logprobs", 21),
        ("logprobs", "x"),
        ("logprobs", True),
        ("seed", "x"),
        ("seed", 2**64),
        ("stop_token_ids", "x"),
        ("stop_token_ids", [999]),
        ("stop_token_ids", 0),
        ("ignore_eos", "yes"),
        ("return_tokens_as_token_ids", 1),
        ("top_k", "abc"),
    ],
)
def test_a_field_of_a_wrong_type_or_value_is_a_400_naming_it(engine, field, value):
    body = {"model": TINY, "prompt": PROMPT, "max_tokens": 4, "ignore_eos": True, "stop_token_ids": [1], field: value}
    with pytest.raises(APIError) as refused:
        parse_completion_request(body, engine)
    assert refused.value.status == HTTPStatus.BAD_REQUEST and refused.value.param == field, refused.value.message


def test_prompt_and_max_tokens_must_fit_the_context(engine):
    assert engine.max_model_len == 256
    ok = parse_completion_request({"prompt": [3] * 250, "max_tokens": 6}, engine)
    assert len(ok.prompt_ids) == 250 and ok.max_tokens == 6
    with pytest.raises(APIError, match=r"you requested 10{399}6 tokens"):
        parse_completion_request({"prompt": [3] * 6, "max_tokens": 10**400}, engine)
    with pytest.raises(APIError) as refused:
        parse_completion_request({"prompt": [3] * 250, "max_tokens": 7}, engine)
    message = refused.value.message
    assert refused.value.status == HTTPStatus.BAD_REQUEST
    assert "maximum context length is 256 tokens" in message and "257 tokens (250 in the prompt, 7 in max_tokens)" in message


def test_adapter_requests_of_a_wrong_type_are_a_400_naming_the_field(engine, root):
    app = App.__new__(App)
    app.engine = engine
    for body, field in (
        ({"lora_name": ["x"], "lora_path": str(root / "good")}, "lora_name"),
        ({"lora_name": "x", "lora_path": 5}, "lora_path"),
        ({"lora_name": "x", "lora_path": str(root / "good"), "load_inplace": "yes"}, "load_inplace"),
    ):
        with pytest.raises(APIError) as refused:
            app._load(body)
        assert refused.value.status == HTTPStatus.BAD_REQUEST and refused.value.param == field
    with pytest.raises(APIError) as refused:
        app._unload({"lora_name": 3})
    assert refused.value.param == "lora_name"


def test_max_batch_is_at_least_one(capsys):
    import argparse

    with pytest.raises(ValueError, match="max_batch must be an integer >= 1, got 0"):
        Batcher(lambda batch, cancelled: [], 0)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["--model", TINY, "--max-batch", "0"])
    assert exited.value.code == 2 and "--max-batch: must be at least 1, got 0" in capsys.readouterr().err
    assert parser.parse_args(["--model", TINY, "--max-batch", "1"]).max_batch == 1


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--port", "70000"], "argument --port: a port is from 1 to 65535, got 70000"),  # uvicorn listened on 70000 mod 65536
        (["--port", "0"], "argument --port: a port is from 1 to 65535, got 0"),
        (["--adapter-root", "/no/such/folder"], "argument --adapter-root: /no/such/folder is not a folder (it does not exist)"),
    ],
)
def test_serve_refuses_a_port_outside_1_to_65535_and_an_adapter_root_that_is_not_a_folder(capsys, argv, said):
    """Issue 24: `--port 70000` listened on 4464; `--adapter-root` of a missing folder was accepted."""
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["--model", TINY, *argv])
    assert exited.value.code == 2 and said in capsys.readouterr().err


def test_serve_of_a_model_that_is_not_there_is_one_message(tmp_path):
    """Issue 24: `dagster-rl serve --model <missing>` printed a 17-line traceback."""
    import subprocess
    import sys
    from pathlib import Path

    missing = tmp_path / "no-model"
    done = subprocess.run(
        [str(Path(sys.executable).parent / "dagster-rl"), "serve", "--model", str(missing), "--port", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and done.stdout == "", done.stdout
    assert done.stderr == (
        f"dagster-rl: cannot load base model '{missing}': no such folder. Give a local model folder (config.json and "
        "weights), or a hub id that is in the local Hugging Face cache when HF_HUB_OFFLINE=1.\n"
    ), done.stderr


# ---- the batcher under load ---------------------------------------------------------------


def test_the_batcher_answers_every_request_with_its_own_result_under_heavy_concurrency():
    """64 threads submit 40 requests each, of 5 groups, and cancel every 7th right away: each request
    not cancelled gets exactly the result made for it, every batch is one group of at most
    max_batch, and a request cancelled while it waited is never generated."""
    ran: list[list[CompletionRequest]] = []
    lock = threading.Lock()

    def run_batch(batch: list[CompletionRequest], cancelled) -> list[CompletionResult]:
        with lock:
            ran.append(list(batch))
        time.sleep(random.random() * 0.002)
        return [CompletionResult([r.seed % 1000, len(r.prompt_ids)], [-float(r.seed % 7), -1.0], "length") for r in batch]

    batcher = Batcher(run_batch, max_batch=8)
    errors: list[str] = []
    dropped: list[CompletionRequest] = []

    def client(t: int) -> None:
        for i in range(40):
            seed = t * 1000 + i
            request = CompletionRequest(f"m{seed % 5}", [1] * (1 + seed % 3), 2, 1.0, 1.0, seed)
            item = batcher.submit(request)
            if i % 7 == 3:
                batcher.cancel(item)
                if item.future.cancelled():
                    with lock:
                        dropped.append(request)
                continue
            result = item.future.result(timeout=60)
            if result.token_ids != [seed % 1000, len(request.prompt_ids)] or result.logprobs[0] != -float(seed % 7):
                errors.append(f"request {seed} got {result}")

    with ThreadPoolExecutor(64) as pool:
        list(pool.map(client, range(64)))
    batcher.close()
    assert not errors, errors[:5]
    assert all(len(b) <= 8 and len({r.group for r in b}) == 1 for b in ran)
    generated = [r for b in ran for r in b]
    assert len(generated) == len({r.seed for r in generated})  # each request at most once
    assert dropped and not {r.seed for r in dropped} & {r.seed for r in generated}
    assert len(generated) + len(dropped) == 64 * 40


def test_a_running_batch_stops_once_every_request_is_cancelled(engine):
    forwards = []

    def cancelled() -> bool:
        forwards.append(1)
        return len(forwards) > 3

    with pytest.raises(BatchCancelled):
        engine.run_batch([CompletionRequest(TINY, PROMPT, 200, 1.0, 1.0, 1)], cancelled)
    assert len(forwards) == 4  # stopped at its 4th forward, not after 200 tokens
    assert len(sample(engine).token_ids) == 6  # and the engine serves on


# ---- over HTTP ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory, root):
    with ServeProcess(tmp_path_factory.mktemp("serve"), adapter_roots=[str(root)], extra=["--max-batch", "8"]) as s:
        yield s


def complete(server, **fields) -> tuple[int | None, object]:
    return post(server, "/completions", {"model": TINY, "prompt": PROMPT, "max_tokens": 3, **fields})


def test_the_issues_cases_over_http(server, root, tmp_path):
    assert post(server, "/load_lora_adapter", {"lora_name": "a", "lora_path": str(root / "good")})[0] == 200
    assert post(server, "/unload_lora_adapter", {"lora_name": "a"})[0] == 200
    assert complete(server)[0] == 200  # unloading the last adapter: the base answers (was a 500 KeyError)
    # a name PEFT cannot take loads (was a 500 that broke every later request); a broken adapter fails, without a trace
    assert post(server, "/load_lora_adapter", {"lora_name": "a.b", "lora_path": str(root / "good")})[0] == 200
    status, body = post(server, "/load_lora_adapter", {"lora_name": "c.d", "lora_path": str(root / "garbage")})
    assert status == 400 and body["error"]["param"] == "lora_path" and "nothing was loaded" in body["error"]["message"]
    assert post(server, "/unload_lora_adapter", {"lora_name": "c.d"})[0] == 404
    assert complete(server, model="a.b")[0] == 200 and complete(server)[0] == 200
    assert post(server, "/unload_lora_adapter", {"lora_name": "a.b"})[0] == 200
    assert complete(server)[0] == 200
    # type errors, max_tokens 0, the context: 400s naming the field
    for fields, param in (
        ({"n": "abc"}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"model": 5}, "model"),
        ({"temperature": "hot"}, "temperature"),
    ):
        status, body = complete(server, **fields)
        assert status == 400 and body["error"]["param"] == param, (fields, body)
    status, body = complete(server, prompt=PROMPT * 60, max_tokens=32)
    assert status == 400 and "(240 in the prompt, 32 in max_tokens)" in body["error"]["message"]
    # adapters from outside --adapter-root: a 403
    outside = adapter(tmp_path / "outside", seed=3)
    status, body = post(server, "/load_lora_adapter", {"lora_name": "x", "lora_path": str(outside)})
    assert (
        status == 403 and body["error"]["type"] == "PermissionDeniedError" and "outside the folders" in body["error"]["message"]
    )
    assert "500" not in re.findall(r'HTTP/1.1" (\d+)', server.log())


def send_and_leave(server, body: dict) -> socket.socket:
    """A client that sends a completion request and will go away before its answer."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def test_a_client_that_goes_away_is_not_served(server):
    """Six long requests, each its own batch (another temperature), keep the engine busy for 6 x 120
    forwards (seconds: ~2 ms a forward on an idle CPU); six clients then send a request and go away
    within 0.1 s, while their requests wait behind them: each is cancelled, none is generated."""
    before = server.log().count("went away before its completion")
    with ThreadPoolExecutor(6) as pool:
        busy = [
            pool.submit(complete, server, max_tokens=120, temperature=0.5 + i / 20, seed=i, ignore_eos=True) for i in range(6)
        ]
        time.sleep(0.05)
        leaving = [
            send_and_leave(server, {"model": TINY, "prompt": PROMPT, "max_tokens": 100, "seed": 100 + i}) for i in range(6)
        ]
        time.sleep(0.05)
        for sock in leaving:
            sock.close()
        assert [f.result(timeout=600)[0] for f in busy] == [200] * 6
    deadline = time.monotonic() + 10
    while server.log().count("went away before its completion") - before < 6 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.log().count("went away before its completion") - before == 6, server.log()[-3000:]
    assert complete(server)[0] == 200


def test_hundreds_of_concurrent_connections_each_get_their_own_completion(server):
    """512 requests at once over 256 connections (256 distinct requests, each sent twice, of 6
    batch groups), amid 32 clients that go away and 32 invalid requests: every valid request is
    answered, each keeps every rule of a completion, and the two answers of one request agree
    (the sampler depends on a request's seed alone, never on its batch): no answer lost or swapped."""
    client = VLLMClient(server.base_url, timeout_s=300, max_connections=256)
    requests = [(seed, 0.7 + (seed % 3) / 10, 2 + seed % 2) for seed in range(256)] * 2
    random.Random(0).shuffle(requests)

    def one(r):
        seed, temperature, max_tokens = r
        return client.complete(TINY, PROMPT, ServerSampling(temperature, 1.0, max_tokens, (1,)), seed=seed, vocab=68)

    def invalid(i):
        return complete(server, max_tokens=0 if i % 2 else "x")[0]

    with ThreadPoolExecutor(256) as pool:
        answers = pool.map(one, requests)
        leaving = [
            send_and_leave(server, {"model": TINY, "prompt": PROMPT, "max_tokens": 3, "seed": 1000 + i}) for i in range(32)
        ]
        statuses = list(pool.map(invalid, range(32)))
        for sock in leaving:
            sock.close()
        answers = list(answers)
    client.close()
    assert statuses == [400] * 32
    by_request: dict[tuple, list] = {}
    for r, a in zip(requests, answers, strict=True):
        by_request.setdefault(r, []).append(a)
    assert len(by_request) == 256
    for r, (a, b) in by_request.items():
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason, r
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5), r
    assert complete(server)[0] == 200


DEEP = 100_000  # the issue's depth: far past Python's recursion limit (1,000)


@pytest.mark.parametrize(
    "path, body, said",
    [
        ("/completions", "[" * DEEP + "]" * DEEP, "nested too deep"),  # the issue's: a 500 RecursionError
        ("/completions", f'{{"model": "{TINY}", "prompt": ' + "[" * DEEP + "]" * DEEP + "}", "nested too deep"),
        ("/load_lora_adapter", '{"lora_name": ' + '{"a": ' * DEEP + "1" + "}" * DEEP + "}", "nested too deep"),
        # nested less than Python's limit: read, then refused by the field's validation
        ("/completions", f'{{"model": "{TINY}", "max_tokens": 3, "prompt": ' + '{"a": ' * 900 + "1" + "}" * 900 + "}", "prompt"),
        ("/completions", f'{{"model": "{TINY}", "max_tokens": 3, "prompt": [1], "stop": ' + "[" * 900 + "]" * 900 + "}", "stop"),
    ],
)
def test_a_body_nested_too_deep_is_a_400_in_vllms_format(server, path, body, said):
    """Finding 5 of issue 36: JSON nested 100,000 deep was a 500 RecursionError."""
    reply = httpx.post(server.base_url + path, content=body.encode(), headers={"Content-Type": "application/json"}, timeout=60)
    error = reply.json()["error"]
    assert (reply.status_code, error["type"], error["code"]) == (400, "BadRequestError", 400), reply.text[:500]
    assert said in error["message"], error["message"][:500]
    assert complete(server)[0] == 200  # the server answers the next request as ever
    assert "500" not in re.findall(r'HTTP/1.1" (\d+)', server.log())
