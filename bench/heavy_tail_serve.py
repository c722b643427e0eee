"""`dagster-rl serve` whose completions have heavy-tailed lengths: what `bench/async_throughput.py`
samples from, so that a step's stragglers matter.

Each request's completion ends at a length drawn from a Pareto distribution, seeded by the request's
own seed (so a retried trial has the same length): L = min(cap, ceil(min_tokens * u^(-1/alpha))),
u uniform in (0, 1), cap the request's max_tokens. Until then the eos token is never sampled (its
logit is -inf for the choice only), at L it is chosen; every other token is sampled as the server
samples it. The log-probability recorded for every token, the forced eos included, is the model's
own (computed from the unmodified logits), so the trainer scores exactly what the server reports and
the on_policy check holds: only the *lengths* are not the model's. With alpha 1.2 and min_tokens 4 the
median is 7 tokens, the mean (uncapped) 24, and 1 completion in 130 runs past 256: a batch of 64
runs as long as its longest completion, mostly 50-256 tokens.

    PYTHONPATH=. .venv/bin/python bench/heavy_tail_serve.py --alpha 1.2 --min-tokens 4 --model DIR --port 8000 ...
"""

import argparse
import math
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import dagster_rl.tasks.lm.rollout.sampling as sampling
import dagster_rl.tasks.lm.serve.engine as engine
from dagster_rl.base.hashing import seed_of
from dagster_rl.tasks.lm.serve import app, cli


def pareto_length(seed: int, alpha: float, min_tokens: int, cap: int) -> int:
    """A completion's length, a pure function of its request's seed."""
    u = ((seed_of("completion-length", seed) >> 10) + 0.5) / 2**53  # in (0, 1)
    return max(1, min(cap, math.ceil(min_tokens * u ** (-1.0 / alpha))))


def install(alpha: float, min_tokens: int) -> None:
    """Patch the server's sampler: each batch's rows end at their Pareto lengths."""
    state = threading.local()
    original_generate, original_choose = engine.generate, sampling.choose_tokens

    def generate(model, prompts, seeds, settings, eos_id, pad_id, top_logprobs=0):
        state.lengths = torch.tensor([pareto_length(s, alpha, min_tokens, settings.max_new_tokens) for s in seeds])
        state.t, state.eos = 0, eos_id
        try:
            return original_generate(model, prompts, seeds, settings, eos_id, pad_id, top_logprobs)
        finally:
            state.lengths = None

    def choose_tokens(logits, temperature, top_p, uniforms):
        lengths = getattr(state, "lengths", None)
        if lengths is None or state.eos < 0:
            return original_choose(logits, temperature, top_p, uniforms)
        t, state.t = state.t, state.t + 1
        allowed = logits.clone()
        allowed[:, state.eos] = float("-inf")  # no eos before a row's length
        chosen = original_choose(allowed, temperature, top_p, uniforms)
        return torch.where((lengths == t + 1).to(chosen.device), state.eos, chosen)

    engine.generate = generate
    sampling.choose_tokens = choose_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_arguments(parser)
    parser.add_argument("--alpha", type=float, default=1.2, help="the Pareto tail index (smaller: heavier)")
    parser.add_argument("--min-tokens", type=int, default=4, help="the Pareto scale: the shortest completion")
    args = parser.parse_args()
    torch.set_num_threads(1)
    install(args.alpha, args.min_tokens)
    app.main(args)


if __name__ == "__main__":
    main()
