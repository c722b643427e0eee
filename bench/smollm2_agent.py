"""A real pretrained model as the agent: SmolLM2-135M-Instruct in the `secret_search` text world,
held-out greedy success before and after a few GRPO steps, and the time of each step, through the driver.

Runs `bench/smollm2_agent.yaml` (the model `builtin:smollm2-135m-instruct`: `make smollm2`) as the
`smollm2_agent_train` job (its warm-up `<exp>/sft` first, then every step) on an ephemeral Dagster
instance with a fresh artifact store, in this process, and prints from the materializations' metadata:

- held-out greedy success and mean turns on `--eval` worlds never trained on: the base model's, the
  warm-up's (where GRPO starts) and each step's;
- per step: the seconds of its rollouts (`generate_s`: the episodes, judged as each lands), of which
  the judge's (`judge_s`; `judge_hidden_s` of it while other episodes still played), of its update
  (`train_s`) and of its held-out evaluation (`eval_s`, in a thread beside the next step), with the
  sampled success, mean turns and GRPO groups with a signal.

    .venv/bin/python bench/smollm2_agent.py                          # defaults: 4 steps of 4 worlds x 4 trials (9-15 min on 2 busy cores)
    .venv/bin/python bench/smollm2_agent.py --experiment experiments/smollm2_python.yaml --seed 1   # the Python tool
    .venv/bin/python bench/smollm2_agent.py --steps 20 --worlds 8 --samples 8 --eval 64   # a longer run (a GPU's size)
    .venv/bin/python bench/smollm2_agent.py --warmup-steps 0          # GRPO from the base model alone
    .venv/bin/python bench/smollm2_agent.py --set '{"grpo": {"learning_rate": 0.002}}'    # any setting, one level deep

The converted model folder lives in the model cache (DAGSTER_RL_MODEL_CACHE, default ~/.cache/dagster_rl/models).
"""

import argparse
import json
import os
import resource
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# runs on an ephemeral instance: the code location's DAGSTER_HOME check needs a folder, any will do
os.environ.setdefault("DAGSTER_HOME", tempfile.mkdtemp(prefix="dagster-rl-bench-home-"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
EXPERIMENT = Path(__file__).with_suffix(".yaml")
from bench.learning_curves import train_through_driver


def settings(args: argparse.Namespace) -> dict:
    """The experiment file (bench/smollm2_agent.yaml by default) with the flags given, then `--set`,
    merged one level deep."""
    import yaml

    raw = yaml.safe_load(args.experiment.read_text())
    given = {"n_steps": args.steps, "prompts_per_step": args.worlds, "n_samples": args.samples, "seed": args.seed}
    raw.update({k: v for k, v in given.items() if v is not None})
    if args.worlds is not None or args.samples is not None:
        raw["min_trials_per_step"] = raw["prompts_per_step"] * raw["n_samples"]
    episode = {k: v for k, v in (("max_turns", args.turns), ("max_turn_tokens", args.turn_tokens)) if v is not None}
    raw["task"] = {**raw["task"], "episode": {**raw["task"]["episode"], **episode}}
    if args.eval is not None:
        raw["task"]["n_eval"] = args.eval
    if args.warmup_steps == 0:
        raw.pop("warmup", None)
    elif args.warmup_steps is not None:
        raw["warmup"] = {**raw["warmup"], "steps": args.warmup_steps}
    raw["trainer"] = {**raw["trainer"], "threads_per_process": args.threads}
    raw["generation_threads"] = args.threads
    for key, value in json.loads(args.set).items():
        raw[key] = {**raw[key], **value} if isinstance(value, dict) and isinstance(raw.get(key), dict) else value
    return raw


def run(raw: dict) -> dict:
    """The experiment's train job through the driver; the metadata of its warm-up, evaluations and weights."""
    wall, found = train_through_driver(raw, ("sft", "evaluation", "weights"))
    return {"wall_s": wall, "sft": found["sft"].get(None), **{k: found[k] for k in ("evaluation", "weights")}}


def print_tables(raw: dict, result: dict, load_before: float) -> None:
    episode, evaluation, weights = raw["task"]["episode"], result["evaluation"], result["weights"]
    steps = sorted(weights)
    first = evaluation[steps[0]]
    sft = result["sft"]
    print(
        f"\n{raw['name']}: {raw['policy']['base_model']}, {len(steps)} GRPO steps of {raw['prompts_per_step']} worlds x "
        f"{raw['n_samples']} trials, up to {episode['max_turns']} turns of {episode['max_turn_tokens']} tokens; "
        f"{first['n_worlds']} held-out worlds; {result['wall_s']:.0f} s in all; load average {load_before:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after; peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB"
    )
    tools = "tool_call_share" in first  # an environment that runs programs: the share of episodes that did

    def share(md: dict, prefix: str = "") -> str:
        return f" {md[f'{prefix}tool_call_share']:.3f} |" if tools else ""

    print("\nheld-out greedy episodes")
    print("| policy | success | mean turns |" + (" called the tool |" if tools else ""))
    print("| --- | --- | --- |" + (" --- |" if tools else ""))
    if sft is not None:
        print(f"| base model | {sft['base_success']:.3f} | {sft['base_mean_turns']:.2f} |" + share(sft, "base_"))
        print(
            f"| warm-up ({sft['sft_steps']} SFT steps on {sft['demos']} demonstrations, {sft['warmup_s']:.0f} s with its "
            f"evaluations): GRPO's start | {sft['success']:.3f} | {sft['mean_turns']:.2f} |" + share(sft)
        )
    else:
        print(
            f"| base model: GRPO's start | {first['start_success']:.3f} | {first['start_mean_turns']:.2f} |"
            + share(first, "start_")
        )
    for s in steps:
        print(
            f"| after step {int(s)} | {evaluation[s]['success']:.3f} | {evaluation[s]['mean_turns']:.2f} |" + share(evaluation[s])
        )

    print(
        "\nper step (seconds; the judge's milliseconds are part of the rollout's, its hidden part judged while other episodes played)"
    )
    print(
        "| step | rollout s | environment s (sandbox s) | judge ms (hidden) | train s | eval s | sampled success | "
        "sampled mean turns | called the tool | mean reward | groups with signal |"
    )
    print("| --- " * 11 + "|")
    for s in steps:
        w = weights[s]
        called = f"{w['tool_call_share']:.3f}" if "tool_call_share" in w else ""
        print(
            f"| {int(s)} | {w['generate_s']:.1f} | {w.get('environment_s', 0.0):.1f} ({w.get('sandbox_s', 0.0):.1f}) | "
            f"{1000 * w['judge_s']:.2f} ({1000 * w['judge_hidden_s']:.2f}) | {w['train_s']:.1f} | "
            f"{evaluation[s]['eval_s']:.1f} | {w['success_rate']:.3f} | {w['mean_turns']:.2f} | {called} | {w['mean_reward']:.3f} | "
            f"{w['groups_with_signal']:.0f}/{raw['prompts_per_step']} |"
        )
    n = len(steps)
    mean = {k: sum(weights[s].get(k, 0.0) for s in steps) / n for k in ("generate_s", "environment_s", "sandbox_s", "train_s")}
    print(
        f"| mean | {mean['generate_s']:.1f} | {mean['environment_s']:.1f} ({mean['sandbox_s']:.1f}) | | {mean['train_s']:.1f} "
        "| | | | | | |",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--experiment",
        type=Path,
        default=EXPERIMENT,
        help="the experiment file (default: %(default)s; experiments/smollm2_python.yaml: the Python tool)",
    )
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps (default: the file's)")
    parser.add_argument("--worlds", type=int, default=None, help="training worlds per step (GRPO groups)")
    parser.add_argument("--samples", type=int, default=None, help="trials per world")
    parser.add_argument("--eval", type=int, default=None, help="held-out worlds of each greedy evaluation")
    parser.add_argument("--turns", type=int, default=None, help="an episode's turn budget")
    parser.add_argument("--turn-tokens", type=int, default=None, help="tokens one action may sample")
    parser.add_argument("--warmup-steps", type=int, default=None, help="SFT steps on demonstrations before GRPO; 0: none")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of generation and of the trainer")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--set", default="{}", metavar="JSON", help="override settings, merged one level deep")
    parser.add_argument("--json", type=Path, default=None, help="append the run's settings and metadata to this JSON-lines file")
    args = parser.parse_args()
    raw = settings(args)
    load_before = os.getloadavg()[0]
    print(f"load average before: {load_before:.2f}", flush=True)
    result = run(raw)
    if args.json is not None:
        with args.json.open("a") as f:
            f.write(json.dumps({"settings": raw, **result}, default=str) + "\n")
    print_tables(raw, result, load_before)


if __name__ == "__main__":
    main()
