"""Multi-turn agent rollouts on a server against single-turn ones: sampled tokens/s of the text_agent
task's `openai_server` backend on `dagster-rl serve` and on a real vLLM (the CPU build, `make vllm`), and of
its `hf` backend in this process.

Both shapes run what a step runs, `backend.generate(exp, requests, behavior)`, on the same model
(`builtin:tiny-qwen2-agent`, hidden 128, 2 layers, as a folder), the same server, the same episodes
(--worlds x --samples, seeded) and the same behavior adapter (every attention and MLP projection,
random B), at temperature 1, top-p 1, up to --turn-tokens tokens per turn, all episodes at once
(`max_concurrency` = episodes):

- single-turn: `task.episode.max_turns` 1, one request per episode;
- multi-turn: `max_turns` --turns, one request per turn, each the whole sequence so far (the first
  prompt, every earlier action and observation) as token ids.

The environment is the tests' `chatter` (tests/agent_fixtures.py): it answers every action with a
short line and never ends an episode itself, so every episode takes all its turns. `hf` plays the
same experiments in process (`rollout.backend: hf`), with --threads torch threads: its live episodes
advance a turn together, each turn continuing the batch's KV cache. Each row also says how far its
sampled tokens/s are from `roofline.decode_roofline` (this machine's float32 peak and bandwidth,
measured at the start). Sampled tokens: the model's tokens of the
trajectories (mask 1). The two shapes alternate, --rounds times each after one warm-up of each;
the median wall time. One server at a time, each with --threads torch threads.

    PYTHONPATH=. .venv/bin/python bench/agent_server_rollouts.py [--engines hf,serve,vllm] [--worlds 8 --samples 8]
        [--turns 4 --turn-tokens 16] [--rounds 3] [--threads 1]
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import roofline
import torch
import vllm_rollouts
from transformers import AutoConfig

from dagster_rl.base.retries import Limits
from dagster_rl.core.task import Endpoint, RolloutEnv, task_of
from dagster_rl.inference.server_process import vllm_cpu_command
from dagster_rl.inference.vllm_client import VLLM_VERSION
from dagster_rl.store.artifact_store import ArtifactStore
from dagster_rl.tasks.agent.experiment import AgentExperiment
from dagster_rl.tasks.agent.loop import plan_episodes
from dagster_rl.tasks.agent.records import AgentTrajectory
from dagster_rl.tasks.lm.model.tiny import save_tiny_model
from dagster_rl.tasks.lm.settings import ATTENTION_AND_MLP
from tests.agent_fixtures import CHATTER


def experiment(model: Path, args, turns: int, backend: str = "openai_server") -> AgentExperiment:
    return AgentExperiment.model_validate(
        {
            "name": "bench_agent_server", "n_steps": 1, "prompts_per_step": args.worlds, "n_samples": args.samples,
            "task": {"kind": "text_agent", "environment": {"name": CHATTER.name},
                     "episode": {"max_turns": turns, "max_turn_tokens": args.turn_tokens}},
            "policy": {"base_model": str(model), "device": "cpu",
                       "lora": {"rank": 8, "alpha": 16, "target_modules": list(ATTENTION_AND_MLP), "init_seed": 7}},
            "sampling": {"temperature": 1.0, "top_p": 1.0},
            "rollout": {"backend": backend},
        }
    )  # fmt: skip


def one_run(backend, exp: AgentExperiment, behavior) -> tuple[float, int, int, int]:
    """(wall s, sampled tokens, requests, prompt tokens over the requests) of one step's episodes."""
    t0 = time.perf_counter()
    out = backend.generate(exp, plan_episodes(exp, 0), behavior)
    wall = time.perf_counter() - t0
    assert all(isinstance(t, AgentTrajectory) for t in out), [t for t in out if not isinstance(t, AgentTrajectory)][:2]
    sampled = sum(sum(t.completion_mask) for t in out)
    requests = sum(t.n_turns for t in out)
    prompts = sum(len(t.prompt_token_ids) + turn.action_start for t in out for turn in t.turns)
    return wall, sampled, requests, prompts


def measured(name: str, backends: dict, shapes: dict, behavior, args, n: int) -> list[tuple]:
    """The two shapes alternated, --rounds times after a warm-up: a row per shape."""
    runs: dict[str, list] = {shape: [] for shape in shapes}
    for i in range(args.rounds + 1):  # round 0 warms up
        for shape, exp in shapes.items():
            run = one_run(backends[shape], exp, behavior)
            if i:
                runs[shape].append(run)
    rows = []
    for shape, got in runs.items():
        wall = statistics.median(r[0] for r in got)
        _, sampled, requests, prompts = got[-1]
        rows.append((name, shape, n, requests, sampled, prompts / requests, wall, sampled / wall))
        print(f"  {name} {shape}: {sampled} tokens in {wall:.3f} s, load {os.getloadavg()[0]:.1f}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", default="hf,serve,vllm", help="comma-separated, of hf (in process), serve, vllm")
    parser.add_argument("--worlds", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each server (OMP_NUM_THREADS)")
    parser.add_argument("--vllm-python", default=str(vllm_rollouts.REPO / ".venv-vllm" / "bin" / "python"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    machine = roofline.measure(args.threads)
    print(machine.line(), flush=True)
    rows: list[tuple] = []
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        model = save_tiny_model(root / "tiny-qwen2-agent", builtin="tiny-qwen2-agent")
        shape = roofline.Shape.of(AutoConfig.from_pretrained(model))
        store = ArtifactStore(f"file://{root}/artifacts")
        shapes = {"single-turn": experiment(model, args, 1), "multi-turn": experiment(model, args, args.turns)}
        behavior = vllm_rollouts.behavior_weights(shapes["single-turn"], store)
        n = args.worlds * args.samples
        for engine in args.engines.split(","):
            if engine == "hf":  # in process: the step's episodes batched by turn, in this process's threads
                name = "hf (in process)"
                env = RolloutEnv(Limits(0, 3600, n), root / "scratch")
                shapes_hf = {
                    shape: experiment(model, args, turns, "hf")
                    for shape, turns in (("single-turn", 1), ("multi-turn", args.turns))
                }
                rows += measured(
                    name,
                    {s: task_of("text_agent").backend("rollout", e, env) for s, e in shapes_hf.items()},
                    shapes_hf,
                    behavior,
                    args,
                    n,
                )
                continue
            port = vllm_rollouts.free_port()
            if engine == "serve":
                name = "dagster-rl serve"
                command = [
                    "env", f"OMP_NUM_THREADS={args.threads}", str(Path(sys.executable).parent / "dagster-rl"), "serve",
                    "--model", str(model), "--port", str(port), "--max-batch", str(n), "--adapter-root", str(root),
                ]  # fmt: skip
            else:
                name = f"vLLM {VLLM_VERSION} (CPU)"
                command = vllm_cpu_command(str(model), port, python=args.vllm_python, threads=args.threads)
            server = vllm_rollouts.started(command, port, root)
            try:
                env = RolloutEnv(
                    Limits(0, 3600, n), root / "scratch", Endpoint(f"http://127.0.0.1:{port}/v1", request_timeout_s=600)
                )
                backends = {shape: task_of("text_agent").backend("rollout", exp, env) for shape, exp in shapes.items()}
                rows += measured(name, backends, shapes, behavior, args, n)
            except Exception:
                print(f"--- {name}'s log:\n{server.log_tail(10**5)}", file=sys.stderr)
                raise
            finally:
                server.stop()
    print(
        f"\n{args.worlds} worlds x {args.samples} episodes, all at once; multi-turn: {args.turns} turns; up to "
        f"{args.turn_tokens} tokens a turn; temperature 1; builtin:tiny-qwen2-agent (hidden 128, 2 layers), rank-8 "
        f"adapter; median of {args.rounds} alternating rounds after 1 warm-up; {args.threads} thread(s) per server; "
        f"load average now {os.getloadavg()[0]:.1f}\n"
    )
    print(
        "| engine | shape | episodes | requests | sampled tokens | prompt tokens / request | wall s | sampled tokens/s | "
        "vs single-turn | vs roofline |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    single = {r[0]: r[7] for r in rows if r[1] == "single-turn"}
    for name, kind, n, requests, sampled, prompt, wall, tps in rows:
        bound = roofline.decode_roofline(machine, shape, n, prompt + args.turn_tokens / 2)
        print(
            f"| {name} | {kind} | {n} | {requests} | {sampled} | {prompt:.0f} | {wall:.3f} | {tps:.0f} | "
            f"{tps / single[name]:.2f} | {tps / bound:.3f} |"
        )
    print(
        f"\nvs roofline: sampled tokens/s over `roofline.decode_roofline` ({n} rows at once, the request's mean prompt "
        f"plus half a turn of context): {machine.line()}"
    )


if __name__ == "__main__":
    main()
