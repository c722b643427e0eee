"""Rollouts on a real vLLM: tokens/s of vLLM's CPU build, `dagster-rl serve` and the `hf` engine on
one model, in one run, and how far each sampler's log-probabilities are from the trainer's.

Every engine runs what a step runs: `backend.generate(exp, requests, behavior, template)` (the
`openai_server` backend's pooled requests, `max_concurrency` = all rows at once, for vLLM and
`dagster-rl serve`; the `hf` engine's batched decode in this process), for the same requests
(prompts x samples, seeded), with the same behavior adapter (every attention and MLP projection,
random B so that it changes the model), at temperature 1, top-p 1. Tokens: completion tokens of
the rollouts. Median of --repeats after one warm-up, by wall time; vLLM and `dagster-rl serve` run
as servers on 127.0.0.1 (started by `ManagedServer`, vLLM from .venv-vllm: `make vllm`), one engine
at a time, each with --threads torch threads. On a machine other work shares, torch's threads wait
on each other: run it quiet, or with --threads 1.

On-policy: for each engine's rollouts, the trainer's log-probability of every sampled token (one
`train_step` of the GRPO trainer at the same dtype: its `logp_max_dev`, the number the `on_policy`
check bounds, with `logp_mean_dev`) against the one the sampler recorded: the max, the signed mean
(trainer - sampler) and the mean |difference| over the tokens.
`--logit-scale` multiplies the model's head: the random model's logits are nearly flat (std 0.3),
a trained model's are not (std 2-4); the deviation of a low-precision forward grows with them.

With `--model` (a model folder, or a `builtin:` name such as `builtin:smollm2-135m-instruct`) the
engines serve that model instead, on `--prompts-path` (a GSM8K-format set, each question in the
model's chat template; default `builtin:addition-1-20`), with vLLM started for it
(`--max-model-len 1024`) and the adapter of experiments/smollm2_arithmetic.yaml (rank 16).

    PYTHONPATH=. .venv/bin/python bench/vllm_rollouts.py [--dtypes float32,bfloat16] [--hidden 256 --layers 4]
        [--prompts 16 --samples 8 --max-new-tokens 32] [--repeats 3] [--logit-scale 10]
        [--model builtin:smollm2-135m-instruct]
"""

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import lm_common
import torch
from safetensors.torch import load_file, save_file

from dagster_rl.base.hashing import cache_key
from dagster_rl.base.retries import Limits
from dagster_rl.core.task import Endpoint, Weights
from dagster_rl.inference.server_process import ManagedServer, ServerStartError, vllm_cpu_command
from dagster_rl.inference.vllm_client import VLLM_VERSION, VLLMClient
from dagster_rl.store.artifact_store import ArtifactStore
from dagster_rl.tasks.lm.backends import HFRollouts
from dagster_rl.tasks.lm.data.prompts import load_prompt_set, prompts_for_step
from dagster_rl.tasks.lm.experiment import LMExperiment
from dagster_rl.tasks.lm.model.logprobs import pack, packed_logprobs
from dagster_rl.tasks.lm.model.policy import checkpoint_bytes, load_policy, make_optimizer
from dagster_rl.tasks.lm.model.tiny import resolve_model
from dagster_rl.tasks.lm.records import plan_requests
from dagster_rl.tasks.lm.rewards import score
from dagster_rl.tasks.lm.rollout.openai_client import ServerRollouts
from dagster_rl.tasks.lm.rollout.vllm_serving import MAX_MODEL_LEN
from dagster_rl.tasks.lm.train.trainer import build_samples, train_step

REPO = Path(__file__).resolve().parent.parent
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def model_folder(root: Path, hidden: int, layers: int, logit_scale: float) -> Path:
    folder = lm_common.save_model(root / f"model-h{hidden}-l{layers}-x{logit_scale:g}", hidden=hidden, layers=layers)
    weights = folder / "model.safetensors"
    tensors = load_file(weights)
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * logit_scale
    save_file(tensors, weights, metadata={"format": "pt"})
    return folder


def experiment(model: Path, args, dtype: str) -> LMExperiment:
    source = {"kind": "gsm8k", "path": args.prompts_path} if args.model else {"kind": "synthetic", "ops": ["copy", "add", "last"]}
    rank = 16 if args.model else 8
    return LMExperiment.model_validate(
        {
            "name": "bench_vllm", "n_steps": 1, "prompts_per_step": args.prompts, "n_samples": args.samples,
            "task": {"kind": "verifiable_prompts", "source": source},
            "policy": {"base_model": str(model), "dtype": dtype, "device": "cpu",
                       "lora": {"rank": rank, "alpha": 2 * rank, "target_modules": list(PROJECTIONS), "init_seed": 7}},
            "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": args.max_new_tokens},
            "rollout": {"backend": "openai_server"},
        }
    )  # fmt: skip


def behavior_weights(exp: LMExperiment, store: ArtifactStore) -> Weights:
    """An adapter that changes the model (LoRA B random, not 0), stored as a step stores weights."""
    policy = load_policy(exp.policy.model_copy(update={"dtype": "float32"}))
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(1)
        for name, p in policy.trainable():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    files = checkpoint_bytes(policy, None)
    ref = store.put("weights", cache_key("weights", "bench-vllm", model=exp.policy.base_model), files)
    return Weights("initial", ref, files, 0)


def deviation(exp: LMExperiment, behavior: Weights, rollouts: list) -> tuple[float, float, float]:
    """(the trainer's logp_max_dev and logp_mean_dev, the mean |difference| over the sampled tokens) at exp's dtype."""
    policy = load_policy(exp.policy, behavior.payload)
    samples, facts = build_samples(rollouts, [score(r, exp.rubric) for r in rollouts], exp.grpo.advantage_eps)
    with torch.no_grad():
        policy.mode(training=True)
        pad = policy.tokenizer.pad_token_id
        batch = pack(
            [s.prompt_ids for s in samples], [s.completion_ids for s in samples], [s.temperature for s in samples], pad, "cpu"
        )
        new = packed_logprobs(policy.model, batch)[batch.completion_mask]
    old = torch.tensor([v for s in samples for v in s.old_logp])
    metrics = train_step(policy, make_optimizer(policy, exp.grpo), samples, len(samples), exp.grpo, facts)
    return metrics.logp_max_dev, metrics.logp_mean_dev, float((new - old).abs().mean())


def timed(fn, repeats: int) -> tuple[list, float, int]:
    """(the rollouts of the last run, median wall seconds, completion tokens) after one warm-up."""
    walls, out = [], []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        out = fn()
        if i:
            walls.append(time.perf_counter() - t0)
    assert all(hasattr(r, "completion_token_ids") for r in out), [r for r in out if not hasattr(r, "completion_token_ids")][:2]
    return out, statistics.median(walls), sum(len(r.completion_token_ids) for r in out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def started(command: list[str], port: int, root: Path) -> ManagedServer:
    return ManagedServer(command, VLLMClient(f"http://127.0.0.1:{port}/v1", timeout_s=600), 1200.0, log_dir=str(root)).start()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument(
        "--hidden", type=int, default=256, help="4 heads: the head size is hidden / 4 (vLLM's CPU attention: 32, 64, ...)"
    )
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--logit-scale", type=float, default=1.0)
    parser.add_argument("--vllm-python", default=str(REPO / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--engines", default="hf,serve,vllm", help="comma-separated, of hf, serve, vllm")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each engine (OMP_NUM_THREADS of the servers)")
    parser.add_argument(
        "--model", default="", help="a model folder or builtin: name (default: a random model of --hidden/--layers)"
    )
    parser.add_argument("--prompts-path", default="builtin:addition-1-20", help="with --model: a GSM8K-format prompt set")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows, failed = [], []
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        model = Path(resolve_model(args.model)) if args.model else model_folder(root, args.hidden, args.layers, args.logit_scale)
        store = ArtifactStore(f"file://{root}/artifacts")
        for dtype in args.dtypes.split(","):
            exp = experiment(model, args, dtype)
            behavior = behavior_weights(exp, store)
            prompts = load_prompt_set(exp.task.source)
            requests = plan_requests(prompts_for_step(prompts.train, 0, 0, args.prompts), 0, 0, args.samples)
            n = len(requests)
            wanted = set(args.engines.split(","))
            engines = {"hf (in process)": HFRollouts(Limits(0, 3600, 1))} if "hf" in wanted else {}
            servers, serve_start, vllm_start = [], 0.0, 0.0
            try:
                if "serve" in wanted:
                    port = free_port()
                    serve_cmd = [
                        "env", f"OMP_NUM_THREADS={args.threads}", str(Path(sys.executable).parent / "dagster-rl"), "serve",
                        "--model", str(model), "--port", str(port), "--dtype", dtype, "--max-batch", str(n), "--adapter-root", str(root),
                    ]  # fmt: skip
                    t0 = time.monotonic()
                    servers.append(started(serve_cmd, port, root))
                    serve_start = time.monotonic() - t0
                    endpoint = Endpoint(f"http://127.0.0.1:{port}/v1", request_timeout_s=600)
                    engines["dagster-rl serve"] = ServerRollouts(endpoint, Limits(0, 3600, n))
                if "vllm" in wanted:
                    port = free_port()
                    t0 = time.monotonic()
                    try:
                        command = vllm_cpu_command(
                            str(model), port, python=args.vllm_python, dtype=dtype, threads=args.threads,
                            max_lora_rank=exp.policy.lora.rank, max_model_len=MAX_MODEL_LEN if args.model else None,
                        )  # fmt: skip
                        servers.append(started(command, port, root))
                        endpoint = Endpoint(f"http://127.0.0.1:{port}/v1", request_timeout_s=600)
                        engines[f"vLLM {VLLM_VERSION} (CPU)"] = ServerRollouts(endpoint, Limits(0, 3600, n))
                    except ServerStartError as e:  # vllm-cpu 0.32 in bfloat16 dies of SIGILL on some CPUs: say so, go on
                        failed.append(f"{dtype}: vLLM did not start: {str(e).splitlines()[0]}")
                        print(f"  {failed[-1]}", flush=True)
                    vllm_start = time.monotonic() - t0
                for name, engine in engines.items():
                    try:
                        out, wall, tokens = timed(
                            partial(engine.generate, exp, requests, behavior, prompts.template), args.repeats
                        )
                    except Exception:  # a server that died: its own log says why
                        for s in servers:
                            print(f"--- {' '.join(s.command[:4])} ... its log:\n{s.log_tail(10**6)}", file=sys.stderr)
                        raise
                    max_dev, mean_dev, mean_abs = deviation(exp, behavior, out)
                    start = {"dagster-rl serve": serve_start}.get(name, vllm_start if name.startswith("vLLM") else 0.0)
                    rows.append((dtype, name, n, tokens, wall, tokens / wall, max_dev, mean_dev, mean_abs, start))
                    print(
                        f"  {dtype} {name}: {tokens} tokens in {wall:.3f} s, max |dlogp| {max_dev:.2e}, load {os.getloadavg()[0]:.1f}",
                        flush=True,
                    )
            finally:
                for s in servers:
                    s.stop()
    size = (
        f"model {args.model}"
        if args.model
        else f"model hidden {args.hidden} / {args.layers} layers / head size {args.hidden // 4}, head x{args.logit_scale:g}"
    )
    print(
        f"\nrollouts: {args.prompts} prompts x {args.samples} samples, up to {args.max_new_tokens} new tokens, temperature 1, "
        f"{size}; median of {args.repeats} after 1 warm-up; {args.threads} thread(s) each; load average now {os.getloadavg()[0]:.1f}\n"
    )
    print("| dtype | engine | rows | tokens | wall s | tokens/s | max abs dlogp | mean dlogp | mean abs dlogp | server start s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for dtype, name, n, tokens, wall, tps, max_dev, mean_dev, mean_abs, start in rows:
        print(
            f"| {dtype} | {name} | {n} | {tokens} | {wall:.3f} | {tps:.0f} | {max_dev:.2e} | {mean_dev:+.1e} | {mean_abs:.2e} | {start:.0f} |"
        )
    for line in failed:
        print(f"\n{line}")


if __name__ == "__main__":
    main()
