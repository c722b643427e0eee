"""Where a GRPO step's time goes: one step of ours (decode, then the update) under torch.profiler, by
kind of operation, against this machine's float32 matmul peak (`roofline`, measured in the same run).

The step is `in_memory.inprocess_step`'s pieces, as `bench/grpo_vs_trl.py` times them: rollouts of
--prompts x --samples completions of `builtin:addition-1-20` in the model's chat template, then one
update (LoRA r16 on the seven projections, `--beta` KL weight). Step 0 warms up unprofiled; step 1
is profiled, then its update runs again under `FlopCounterMode` (the FLOPs the kernels were asked
for, counted by torch) beside `roofline.train_flops` (the useful FLOPs, by formula).

Kinds, by self time: `matmul` (mm, bmm, addmm: the only work that can run at the matmul peak),
`attention` (the fused attention kernels), `vocabulary` (log-softmax, logsumexp and the sampler's
softmax/cumsum over the 49,152-token vocabulary), `elementwise` (everything else: norms, activations,
residual adds, the LoRA scaling, copies, the optimizer).

    PYTHONPATH=. .venv/bin/python bench/step_profile.py [--model builtin:smollm2-135m-instruct]
        [--prompts 8 --samples 8 --max-new-tokens 64] [--threads 1] [--beta 0]
"""

import argparse
import os
import time
from collections import defaultdict

import lm_common  # sets the offline environment and sys.path first
import roofline
import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode

from dagster_rl.tasks.lm.data.prompts import GSM8KPrompts, load_prompt_set, prompts_for_step
from dagster_rl.tasks.lm.model.policy import make_optimizer
from dagster_rl.tasks.lm.model.tiny import resolve_model
from dagster_rl.tasks.lm.records import plan_requests
from dagster_rl.tasks.lm.rewards import LMRubric, score
from dagster_rl.tasks.lm.rollout.hf import generate_rollouts
from dagster_rl.tasks.lm.settings import ATTENTION_AND_MLP, GRPOLMSettings, SamplingSettings
from dagster_rl.tasks.lm.train.trainer import build_samples, train_step

MATMUL = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm")
VOCABULARY = ("aten::_log_softmax", "aten::logsumexp", "aten::_softmax", "aten::cumsum", "aten::searchsorted", "aten::sort")


def kind(name: str) -> str:
    if name in MATMUL:
        return "matmul"
    if "scaled_dot_product" in name or "flash_attention" in name:
        return "attention"
    if name in VOCABULARY:
        return "vocabulary"
    return "elementwise"


def by_kind(prof) -> dict[str, float]:
    seconds: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        if event.key.startswith("aten::") or "attention" in event.key:
            seconds[kind(event.key)] += event.self_cpu_time_total / 1e6
    return dict(seconds)


def table(title: str, wall: float, seconds: dict[str, float], prof) -> None:
    total = sum(seconds.values())
    print(f"\n{title}: {wall:.2f} s wall, {total:.2f} s in aten operators")
    for name in ("matmul", "attention", "vocabulary", "elementwise"):
        print(f"  {name:<12}{seconds.get(name, 0.0):>8.2f} s  {seconds.get(name, 0.0) / max(total, 1e-9):>6.1%}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--beta", type=float, default=0.0)
    parser.add_argument("--micro-batch-tokens", type=int, default=1024)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    machine = roofline.measure(args.threads)
    print(machine.line())
    lora = lm_common.LORA.model_copy(update={"target_modules": ATTENTION_AND_MLP, "rank": 16, "alpha": 32.0})
    policy = lm_common.make_policy(resolve_model(args.model), lora)
    grpo = GRPOLMSettings(learning_rate=1e-3, kl_beta=args.beta, micro_batch_tokens=args.micro_batch_tokens)
    sampling = SamplingSettings(temperature=1.0, top_p=1.0, max_new_tokens=args.max_new_tokens)
    optimizer = make_optimizer(policy, grpo)
    prompt_set = load_prompt_set(GSM8KPrompts(path="builtin:addition-1-20"))
    rubric = LMRubric(accuracy=1.0, format=0.5)
    shape = roofline.Shape.of(policy.model.get_base_model().config)

    def batch(step: int):
        items = prompts_for_step(prompt_set.train, 0, step, args.prompts)
        return plan_requests(items, 0, step, args.samples)

    def update(rollouts):
        samples, facts = build_samples(rollouts, [score(r, rubric) for r in rollouts], grpo.advantage_eps)
        return samples, lambda: train_step(policy, optimizer, samples, len(samples), grpo, facts, old_logp="trainer")

    warm = generate_rollouts(policy, batch(0), sampling, prompt_set.template)
    update(warm)[1]()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as decode_prof:
        rollouts = generate_rollouts(policy, batch(1), sampling, prompt_set.template)
    decode_s = time.perf_counter() - t0
    samples, run = update(rollouts)
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as update_prof:
        metrics = run()
    update_s = time.perf_counter() - t0
    with FlopCounterMode(display=False) as counter:
        run()
    counted = counter.get_total_flops()
    useful = roofline.train_flops(
        shape, [(len(s.prompt_ids) + len(s.completion_ids), s.sampled) for s in samples], lora.rank, lora.target_modules
    )
    tokens = sum(len(r.completion_token_ids) for r in rollouts)
    context = sum(len(r.prompt_token_ids) + len(r.completion_token_ids) / 2 for r in rollouts) / len(rollouts)
    bound = roofline.decode_roofline(machine, shape, len(rollouts), context)
    decode_kinds, update_kinds = by_kind(decode_prof), by_kind(update_prof)
    table(f"decode of {len(rollouts)} rows, {tokens} sampled tokens", decode_s, decode_kinds, decode_prof)
    table(
        f"update of {len(samples)} samples (kl_beta {args.beta}, pad_share {metrics.pad_share:.3f})",
        update_s,
        update_kinds,
        update_prof,
    )
    matmul_s = update_kinds.get("matmul", 0.0)
    print(
        f"\nupdate: {useful / 1e9:.0f} useful GFLOP (formula), {counted / 1e9:.0f} GFLOP counted by torch (padding, "
        f"the reference forward if any); {useful / update_s / 1e9:.1f} useful GFLOP/s = "
        f"{useful / update_s / 1e9 / machine.fp32_gflops:.2f} of the float32 peak {machine.fp32_gflops:.0f}; its matmuls "
        f"alone ran at {counted / max(matmul_s, 1e-9) / 1e9:.0f} GFLOP/s (counted FLOPs / their self time; attention "
        f"included in the count) in {matmul_s / max(sum(update_kinds.values()), 1e-9):.0%} of its operator time"
    )
    prompt = sum(len(r.prompt_token_ids) for r in rollouts) / len(rollouts)
    least = roofline.decode_seconds_bound(machine, shape, prompt, [len(r.completion_token_ids) for r in rollouts])
    print(
        f"decode: {tokens / decode_s:.1f} sampled tokens/s, {tokens / decode_s / bound:.2f} of the roofline {bound:.0f} "
        f"of {len(rollouts)} rows all sampling (mean context {context:.0f}, {machine.bandwidth_gbs:.1f} GB/s); these "
        f"completions' lengths need at least {least:.2f} s (`roofline.decode_seconds_bound`): {least / decode_s:.2f} of "
        f"the {decode_s:.2f} s taken; load average now {os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    main()
