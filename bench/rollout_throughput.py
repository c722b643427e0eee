"""Rollout tokens/s of our `hf` engine against a bare `model.generate` on the same batch.

Same model with the same LoRA adapter attached (a PeftModel), same left-padded batch of synthetic
prompts (prompts x samples rows), same max_new_tokens, temperature and top-p (top-k off), both
stopping when every row has sampled eos. Only generated tokens count: per row up to and including
its first eos, at most max_new_tokens. Rows:

- `ours: generate_rollouts`: what a step runs: the seeded KV-cache decode loop, which records each
  token's log-prob from the logits it samples from (no second forward), then the decoded text and
  the records;
- `ours: decode only`: `sampling.generate` alone, the part comparable to `model.generate`;
- `bare model.generate`: transformers' sampling, which records nothing.

Median of --repeats after one warm-up of each, the three interleaved, by wall time and by this
process's CPU time (the steadier figure when other work shares the machine); torch intra-op threads fixed
by --threads (default 1, the share generation gets when it runs beside the trainer). Two sizes by
default: the tiny model (hidden 64, 2 layers) and a larger one (hidden 256, 4 layers, 32 new
tokens), so the ratio is not only Python overhead on a toy. Target: ours / bare >= 0.9. Each size
also prints its decode's distance to the limit: tokens/s against `roofline.decode_roofline` (this
machine's bandwidth and float32 peak, measured at the start of the run).

    PYTHONPATH=. .venv/bin/python bench/rollout_throughput.py [--repeats 5] [--threads 1]
        [--sizes tiny,large] [--prompts 8] [--samples 8]
"""

import argparse
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import lm_common
import roofline
import torch

from dagster_rl.tasks.lm.data.prompts import SyntheticPrompts, load_prompt_set, prompts_for_step, render
from dagster_rl.tasks.lm.records import plan_requests
from dagster_rl.tasks.lm.rollout.hf import generate_rollouts
from dagster_rl.tasks.lm.rollout.sampling import generate
from dagster_rl.tasks.lm.settings import SamplingSettings

TARGET = 0.9


@dataclass(frozen=True)
class Size:
    name: str
    hidden: int
    layers: int
    max_new_tokens: int


SIZES = {"tiny": Size("tiny", 64, 2, 16), "large": Size("large", 256, 4, 32)}


def count_generated(rows: list[list[int]], eos_id: int) -> int:
    """Tokens per row up to and including the first eos (what our rollouts keep)."""
    return sum(row.index(eos_id) + 1 if eos_id in row else len(row) for row in rows)


def bench_size(size: Size, args, root: Path) -> dict[str, tuple[int, float]]:
    model_dir = lm_common.save_model(root / size.name, hidden=size.hidden, layers=size.layers)
    policy = lm_common.make_policy(model_dir)
    model, tok = policy.model.eval(), policy.tokenizer
    prompt_set = load_prompt_set(SyntheticPrompts(ops=("copy", "add", "last")))
    items = prompts_for_step(prompt_set.train, args.seed, 0, args.prompts)
    requests = plan_requests(items, args.seed, 0, args.samples)
    sampling = SamplingSettings(temperature=args.temperature, top_p=args.top_p, max_new_tokens=size.max_new_tokens)
    rows = len(requests)
    prompt_ids = [tok(render(r.item, prompt_set.template))["input_ids"] for r in requests]
    width = max(len(p) for p in prompt_ids)
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompt_ids])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])

    def ours() -> int:
        rollouts = generate_rollouts(policy, requests, sampling, prompt_set.template, batch_size=rows)
        return sum(len(r.completion_token_ids) for r in rollouts)

    def decode_only() -> int:
        gens = generate(model, prompt_ids, [r.seed for r in requests], sampling, tok.eos_token_id, tok.pad_token_id)
        return sum(len(g.completion_ids) for g in gens)

    def bare() -> int:
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=0,
                max_new_tokens=sampling.max_new_tokens,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
        return count_generated(out[:, width:].tolist(), tok.eos_token_id)

    runs = {"ours: generate_rollouts": ours, "ours: decode only": decode_only, "bare model.generate": bare}
    samples: dict[str, list[tuple[int, float, float]]] = {k: [] for k in runs}
    for repeat in range(args.repeats + 1):
        for name, fn in runs.items():
            t0, c0 = time.perf_counter(), time.process_time()
            tokens = fn()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            if repeat:  # the first round is the warm-up
                samples[name].append((tokens, wall, cpu))
    # median by tokens/s; tokens, wall and CPU time of that same run
    result = {k: sorted(v, key=lambda r: r[0] / r[1])[len(v) // 2] for k, v in samples.items()}
    tokens = result["ours: decode only"][0]
    context = sum(len(p) for p in prompt_ids) / rows + tokens / rows / 2
    bound = roofline.decode_roofline(args.machine, roofline.Shape.of(policy.model.get_base_model().config), rows, context)
    return {**result, "roofline": (int(bound), 1.0, 1.0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--sizes", default="tiny,large", help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8, help="per prompt; rows = prompts x samples")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.machine = roofline.measure(args.threads)
    print(args.machine.line())
    rows = args.prompts * args.samples
    print(
        f"rollout throughput: {rows} rows ({args.prompts} prompts x {args.samples} samples), temperature "
        f"{args.temperature}, top-p {args.top_p}, {args.threads} torch thread(s), median of {args.repeats} after 1 warm-up"
    )
    with tempfile.TemporaryDirectory() as d:
        for key in args.sizes.split(","):
            size = SIZES[key.strip()]
            result = bench_size(size, args, Path(d))
            bound = result.pop("roofline")[0]
            bare = result["bare model.generate"]
            bare_tps, bare_cpu_tps = bare[0] / bare[1], bare[0] / bare[2]
            print(f"\n{size.name}: hidden {size.hidden}, {size.layers} layers, {size.max_new_tokens} new tokens")
            print(f"{'engine':<26}{'tokens':>8}{'wall s':>10}{'tokens/s':>11}{'vs bare':>9}{'CPU s':>9}{'vs bare (CPU)':>15}")
            for name, (tokens, wall, cpu) in result.items():
                print(
                    f"{name:<26}{tokens:>8}{wall:>10.4f}{tokens / wall:>11.0f}{tokens / wall / bare_tps:>9.2f}"
                    f"{cpu:>9.4f}{tokens / cpu / bare_cpu_tps:>15.2f}"
                )
            ours, decode = result["ours: generate_rollouts"], result["ours: decode only"]
            for label, (tokens, wall, cpu) in (("rollouts", ours), ("decode only", decode)):
                ratio = tokens / wall / bare_tps
                print(
                    f"ratio ours/bare, {label}: {ratio:.2f} ({'meets' if ratio >= TARGET else 'misses'} the target >= {TARGET}; "
                    f"by CPU time {tokens / cpu / bare_cpu_tps:.2f})"
                )
            print(f"text and records: {ours[1] - decode[1]:.4f} s of the rollouts' {ours[1]:.4f} s")
            print(
                f"distance to the limit: decode only {decode[0] / decode[1]:.0f} tokens/s = {decode[0] / decode[1] / bound:.2f} "
                f"of the roofline {bound} tokens/s; bare {bare_tps / bound:.2f} (`roofline.decode_roofline`)"
            )


if __name__ == "__main__":
    main()
