"""Judging as each trial lands against judging after the batch, with a slow LLM judge, on both
language-model tasks: how much of the judge's time hides behind generation, and what it saves a step.

Each step's trials are judged by the LLM judge (`LLMJudge`, journaled) over HTTP on the tests'
OpenAI-compatible stub (`tests/openai_stub.py`), which answers after `--delay` seconds,
`--judge-concurrency` judgements at a time.

- `tiny_grpo` (single-turn completions) sampled through `openai_server` from `dagster-rl serve` of
  the tiny model (`builtin:tiny-qwen2`, started here on 127.0.0.1): one HTTP request per trial, each
  rollout handed to the judge as its request completes. Graded by the task's LLM grading.
  Completions of `--new-tokens` tokens (the experiment samples 1, which leaves generation little
  time to hide anything behind).
- `tiny_agent` (multi-turn episodes, no warm-up: the base policy) on the `hf` backend, batched by
  turn: each trajectory handed to the judge as its episode ends. Graded by the task's LLM grading
  (`tasks.agent.grading`: the episode as text).

Modes, in alternating rounds after one uncounted round, each on a fresh artifact store (the judge's journal replays nothing):
`as landed`, the loop as it is; `after batch`, the same loop with its rollout backend holding every
trajectory back until the whole batch is generated (`JudgedAfterTheBatch`), which is what the loop
did before it judged each as it landed. A step is its generation and judging (`generate_s`) and
its GRPO update (`train_s`, in process); `judge_s` is the wall time during which a judgement ran,
`hidden_s` the part of it spent while trials still generated, overlap = hidden / judge.

    .venv/bin/python bench/judge_overlap.py [--rounds 2] [--delay 0.1] [--judge-concurrency 4]
"""

import argparse
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from dagster_rl.base.retries import Limits
from dagster_rl.core.experiment_files import parse_experiment
from dagster_rl.core.task import Backends, Endpoint
from dagster_rl.judges.journal import JudgeJournal
from dagster_rl.judges.llm_judge import LLMJudge, OpenAIChatClient
from dagster_rl.store.artifact_store import ArtifactStore
from dagster_rl.tasks.lm.backends import LMTrainer
from tests.openai_stub import STUB_MODEL, OpenAIStub
from tests.serve_process import ServeProcess
from tests.settings import served, shipped_settings

MODES = ("as landed", "after batch")


@dataclass
class JudgedAfterTheBatch:
    """A rollout backend whose trajectories reach the loop's `on_done` only once its whole batch is
    generated: every judgement starts after generation, as before the loop judged each as it landed."""

    inner: Any

    def generate(self, *args: Any) -> list:
        *head, on_done = args  # the loop passes on_done last, positionally
        held: list = []
        outcomes = self.inner.generate(*head, held.append)
        for trajectory in held:
            on_done(trajectory)
        return outcomes

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def one_step(loop: Any, exp: Any, rollout: Any, grading: Any, stub: OpenAIStub, args: argparse.Namespace, root: Path) -> dict:
    """Step 0 of `exp` on a fresh store under `root`: its timings."""
    store = ArtifactStore(f"file://{root}/artifacts")
    client = OpenAIChatClient(stub.base_url, timeout_s=60.0)
    judge = LLMJudge(client, STUB_MODEL, JudgeJournal(store), grading, Limits(max_concurrency=args.judge_concurrency))
    backends = Backends(rollout, judge, LMTrainer())
    behavior = loop.initial_weights(exp, store)
    gen = loop.generate(exp, 0, behavior, loop.prompt_set(exp), store, backends, print)
    result, _ = loop._train(exp, 0, behavior, gen, store, backends, None)  # the step's update, without its evaluation
    t = result.timings
    return {**t, "step_s": t["generate_s"] + t["train_s"], "trials": len(gen.rollouts.trajectories)}


def rounds(name: str, run: Callable[[str, Path], dict], args: argparse.Namespace) -> dict[str, list[dict]]:
    rows: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="judge-overlap-", dir=args.tmp) as d:
        run(MODES[0], Path(d))  # not counted: the first step of a process pays for loading and compiling
    for r in range(args.rounds):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            with tempfile.TemporaryDirectory(prefix="judge-overlap-", dir=args.tmp) as d:
                rows[mode].append(run(mode, Path(d)))
                print(f"  {name} round {r} {mode}: {rows[mode][-1]}", file=sys.stderr)
    return rows


def lm_rows(stub: OpenAIStub, args: argparse.Namespace) -> dict[str, list[dict]]:
    from dagster_rl.tasks.lm.grading import LMGrading
    from dagster_rl.tasks.lm.loop import LMLoop
    from dagster_rl.tasks.lm.rollout.openai_client import ServerRollouts

    exp = parse_experiment(
        served(
            warmup=None,
            prompts_per_step=args.prompts,
            n_samples=args.samples,
            min_trials_per_step=1,
            sampling={"top_p": 1.0, "max_new_tokens": args.new_tokens},
        )
    )
    with ServeProcess(Path(args.tmp), adapter_roots=[args.tmp]) as server:
        rollout = ServerRollouts(Endpoint(server.base_url), Limits(max_concurrency=args.rollout_concurrency))

        def run(mode: str, root: Path) -> dict:
            backend = rollout if mode == "as landed" else JudgedAfterTheBatch(rollout)
            return one_step(LMLoop(), exp, backend, LMGrading(), stub, args, root)

        return rounds("tiny_grpo", run, args)


def agent_rows(stub: OpenAIStub, args: argparse.Namespace) -> dict[str, list[dict]]:
    from dagster_rl.tasks.agent.backends import AgentHFRollouts
    from dagster_rl.tasks.agent.grading import AgentGrading
    from dagster_rl.tasks.agent.loop import AgentLoop

    exp = parse_experiment(
        shipped_settings("tiny_agent", warmup=None, prompts_per_step=args.prompts, n_samples=args.samples, min_trials_per_step=1)
    )

    def run(mode: str, root: Path) -> dict:
        rollout = AgentHFRollouts(root / "sandboxes")
        backend = rollout if mode == "as landed" else JudgedAfterTheBatch(rollout)
        return one_step(AgentLoop(), exp, backend, AgentGrading(), stub, args, root)

    return rounds("tiny_agent", run, args)


def table(results: dict[str, dict[str, list[dict]]], args: argparse.Namespace) -> None:
    print(
        f"LLM judge stub answering in {args.delay:g} s, {args.judge_concurrency} at a time; {args.prompts}x{args.samples} trials a step; "
        f"median of {args.rounds} round(s), modes alternating; load average {os.getloadavg()[0]:.1f} at the end"
    )
    head = ("task (backend)", "mode", "step s", "gen+judge s", "judge s", "hidden s", "exposed s", "overlap", "train s")
    print(f"{head[0]:<26}{head[1]:<13}" + "".join(f"{h:>12}" for h in head[2:]))
    for task, rows in results.items():
        med = {m: {k: statistics.median(r[k] for r in rows[m]) for k in rows[m][0]} for m in MODES}
        for mode in MODES:
            s = med[mode]
            overlap = statistics.median(r["judge_hidden_s"] / r["judge_s"] for r in rows[mode])
            exposed = statistics.median(r["judge_s"] - r["judge_hidden_s"] for r in rows[mode])
            cells = (s["step_s"], s["generate_s"], s["judge_s"], s["judge_hidden_s"], exposed, overlap, s["train_s"])
            print(f"{task:<26}{mode:<13}" + "".join(f"{c:>12.2f}" for c in cells))
        ratio = med["as landed"]["step_s"] / med["after batch"]["step_s"]
        print(f"{task:<26}{'step s, as landed / after batch:':<45}{ratio:>8.2f}")
    print(
        "judge s: wall time during which a judgement ran; hidden s: of it, while trials still generated; exposed s: the rest, "
        "which the step waits for after generating; overlap = hidden / judge"
    )


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--delay", type=float, default=0.1, help="seconds the judge stub takes to answer")
    parser.add_argument("--judge-concurrency", type=int, default=4)
    parser.add_argument("--rollout-concurrency", type=int, default=8, help="openai_server: requests in flight")
    parser.add_argument("--new-tokens", type=int, default=32, help="tiny_grpo: completion tokens (the experiment's own: 1)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tasks", nargs="+", default=["tiny_grpo", "tiny_agent"], choices=["tiny_grpo", "tiny_agent"])
    return parser.parse_args(argv)


def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="judge-overlap-") as tmp, OpenAIStub(delay_s=args.delay) as stub:
        args.tmp = tmp
        runs = {"tiny_grpo": ("tiny_grpo (openai_server)", lm_rows), "tiny_agent": ("tiny_agent (hf)", agent_rows)}
        table({runs[t][0]: runs[t][1](stub, args) for t in args.tasks}, args)


if __name__ == "__main__":
    main(arguments())
