"""Our in-process GRPO step against TRL's GRPOTrainer: wall time per step and peak memory.

Both engines train the same tiny Qwen2 (built in code) with the same LoRA adapter (same config: every
attention and MLP projection, not lm_head, which TRL refuses to adapt; the same initial weights,
copied into TRL's), on the same synthetic prompts (step k gets the prompts of
`prompts_for_step(seed, k)` in both), the same reward (`rewards.score_text` with the rubric
accuracy 1 + format 0.5), the same batch (prompts x samples completions per optimizer step), max
new tokens, temperature/top-p, lr (constant), AdamW betas/eps, grad clip, beta (KL) and epsilon
(clip), for the same number of steps, on the same device and dtype with the same torch thread
count. Each engine runs in its own subprocess, so their memory peaks do not mix.

TRL is configured to match ours as far as it can: num_generations = samples,
per_device_train_batch_size = prompts x samples, gradient_accumulation_steps = steps_per_generation
= num_iterations = 1 (one generation and one optimizer step per step, on-policy), loss_type "grpo"
(per-sequence token mean, then the mean over sequences: our loss), importance_sampling_level
"token", scale_rewards "group" ((r - mean) / (std + 1e-4) per prompt, TRL's std with Bessel's
correction where ours is the population std: a scale of the advantages, not of the work),
reference = the base with the adapter disabled (TRL does that when given a LoraConfig), top_k 0,
use_vllm False, no logging, reporting, saving or shuffling. Ours packs the step's samples into
micro-batches of `grpo.micro_batch_tokens` (its default unless --micro-batch-tokens); TRL runs
the whole batch at once. `--baseline DIR` runs ours also as another checkout of the project has it
(the commit before a change), in the same run, alternated: the before and after of a change by one clock.

Where time goes, per step (median over the steps after the first, which is reported apart):
- decode: sampling the tokens (ours: `sampling.generate`, which records each token's log-prob as it
  samples; TRL: its `_generate`, a model.generate);
- no-grad log-probs: the reference forwards with the adapter disabled (ours: one per micro-batch;
  TRL: its batched reference forward). Neither recomputes the behavior log-probs on-policy;
- reward: scoring (and ours: group advantages);
- train: the rest: the forwards with grad, backwards and the optimizer step.
Distance to the limit (`roofline`, measured at the start of the run at the engines' thread count):
ours' update in useful GFLOP/s (`roofline.train_flops` of the step's sequences over its train
seconds) as a fraction of the float32 matmul peak, its padded-token share, and its decode's sampled
tokens/s against `roofline.decode_roofline`.
Memory: RSS when the first step starts, the high-water mark of RSS during the steps (VmHWM reset at
the first step) and the process's peak (imports and setup included); on CUDA also the peak of
`torch.cuda.max_memory_allocated` during the steps.

With `--model` (a model folder, or a `builtin:` name such as `builtin:smollm2-135m-instruct`) both
train that model instead of the tiny one, on `--prompts-path` (a GSM8K-format set; default
`builtin:addition-1-20`), each question as the user's turn of the model's chat template (TRL is
given conversational prompts, which it renders with the same template), with the SmolLM2 experiment's
adapter (rank 16, alpha 32, the seven projections). TRL runs twice there: `trl` with its defaults
for what is not an algorithmic setting (gradient checkpointing on) and `trl-nogc` with gradient
checkpointing off, its fastest configuration. The issue's comparison:

    PYTHONPATH=. .venv/bin/python bench/grpo_vs_trl.py --trl-python /work/trl-venv/bin/python \
        --model builtin:smollm2-135m-instruct --prompts 8 --samples 8 --max-new-tokens 64 --threads 1 \
        --lr 1e-3 --beta 0 --steps 3 --rounds 2 --engines ours,trl,trl-nogc

TRL is not a project dependency. Without it the TRL row is skipped with a message. Install it in a
separate venv, never into the project's (torch pinned: an unpinned one pulls a CUDA build):

    python3.11 -m venv /work/trl-venv
    /work/trl-venv/bin/pip install torch==2.13.0
    /work/trl-venv/bin/pip install 'transformers==5.24.0' 'peft==0.21.2' 'trl==1.16.0' 'pydantic>=2.7,<3' pyyaml fsspec gguf

(`gguf`: for a `builtin:` model provisioned from a GGUF file, which the bench converts with the
project's venv before either engine starts; TRL then reads the converted folder.)

(trl 1.16.0, the newest on the registry, requires transformers>=4.56.2 and no torch pin: it runs on
torch 2.13 and transformers 5.24.) Then run (ours with the project's venv, TRL with the other):

    PYTHONPATH=. .venv/bin/python bench/grpo_vs_trl.py --trl-python /work/trl-venv/bin/python
        [--steps 6] [--rounds 2] [--prompts 4] [--samples 8] [--max-new-tokens 8] [--threads 1]
        [--hidden 256 --layers 4]  (a larger model)  [--device cuda --dtype bfloat16]  (on a GPU)
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import lm_common  # sets the offline environment and sys.path first
import roofline

from dagster_rl.tasks.lm.model.tiny import resolve_model
from dagster_rl.tasks.lm.settings import ATTENTION_AND_MLP

PHASES = ("decode", "nograd_logp", "reward")
WORK = ("train_flops", "decode_rows", "decode_tokens", "decode_context", "pad_share")  # ours: what a step computed
RUBRIC = {"name": "accuracy", "accuracy": 1.0, "format": 0.5}
# TRL refuses an adapter on lm_head (it reads lm_head.weight directly), so both engines adapt the
# project's default modules: every attention and MLP projection.
LORA = lm_common.LORA.model_copy(update={"target_modules": ATTENTION_AND_MLP})
REAL_MODEL_LORA = LORA.model_copy(update={"rank": 16, "alpha": 32.0})  # experiments/smollm2_arithmetic.yaml's
OPS = ("copy", "add")


def lora_of(args):
    return REAL_MODEL_LORA if args.model else LORA


def prompt_set_of(args):
    """The tiny model's synthetic prompts, or a GSM8K-format set for a real model."""
    from dagster_rl.tasks.lm.data.prompts import GSM8KPrompts, SyntheticPrompts, load_prompt_set

    return load_prompt_set(GSM8KPrompts(path=args.prompts_path) if args.model else SyntheticPrompts(ops=OPS))


def no_grad_now() -> bool:
    import torch

    return not torch.is_grad_enabled()


class Clock:
    """Seconds per phase of the current step, from wrapped functions."""

    def __init__(self) -> None:
        self.now: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []

    def wrap(self, phase, fn, when=lambda: True):
        def timed(*a, **kw):
            if not when():
                return fn(*a, **kw)
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.now[phase] += time.perf_counter() - t0

        return timed

    def start(self) -> None:
        self.now = defaultdict(float)
        self.t0, self.cpu0 = time.perf_counter(), time.process_time()

    def stop(self, **extra: float) -> None:
        _synchronize()
        cpu = time.process_time() - self.cpu0
        self.steps.append({"step": time.perf_counter() - self.t0, "cpu": cpu, **self.now, **extra})


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def gpu_peak_kib() -> int:
    import torch

    return torch.cuda.max_memory_allocated() // 1024 if torch.cuda.is_available() and torch.cuda.is_initialized() else 0


def reset_gpu_peak() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def reset_hwm() -> int:
    """Reset the RSS high-water mark (Linux) and return RSS now, KiB."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return rss_kib("VmRSS")


def settings(args):
    from dagster_rl.tasks.lm.rewards import LMRubric
    from dagster_rl.tasks.lm.settings import GRPOLMSettings, SamplingSettings

    sampling = SamplingSettings(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens)
    grpo = GRPOLMSettings(learning_rate=args.lr, kl_beta=args.beta, clip_eps=args.epsilon, max_grad_norm=1.0)
    if args.micro_batch_tokens:
        grpo = grpo.model_copy(update={"micro_batch_tokens": args.micro_batch_tokens})
    return sampling, grpo, LMRubric(**RUBRIC)


def run_ours(args, model_dir: Path) -> dict:

    from dagster_rl.tasks.lm import in_memory
    from dagster_rl.tasks.lm.model.policy import make_optimizer
    from dagster_rl.tasks.lm.rollout import hf as rollout_hf
    from dagster_rl.tasks.lm.train import trainer

    sampling, grpo, rubric = settings(args)
    dtype = "bfloat16" if args.worker == "ours-bf16" else args.dtype
    policy = lm_common.make_policy(model_dir, lora_of(args), device=args.device, dtype=dtype)
    optimizer = make_optimizer(policy, grpo)
    prompt_set = prompt_set_of(args)
    clock = Clock()
    rollout_hf.generate = clock.wrap("decode", rollout_hf.generate)
    trainer.packed_logprobs = clock.wrap("nograd_logp", trainer.packed_logprobs, when=no_grad_now)
    in_memory.score = clock.wrap("reward", in_memory.score)
    in_memory.build_samples = clock.wrap("reward", in_memory.build_samples)
    in_memory.train_step = recording_shapes(in_memory.train_step, shapes := [])
    rss_start = reset_hwm()
    reset_gpu_peak()
    for step in range(args.steps):
        clock.start()
        _, rewards, metrics = in_memory.inprocess_step(
            policy, optimizer, prompt_set, args.seed, step, args.prompts, args.samples, sampling, rubric, grpo
        )
        # the sampler's log-probs against the trainer's (the on_policy check's numbers)
        clock.stop(
            mean_reward=sum(r.reward for r in rewards) / len(rewards),
            logp_max_dev=metrics.logp_max_dev,
            logp_mean_dev=metrics.logp_mean_dev,
            pad_share=metrics.pad_share,
            **step_work(policy, shapes[-1], lora_of(args)),
        )
    return _memory(clock, rss_start)


def recording_shapes(train_step, shapes: list):
    """`train_step`, recording each call's sequences: (prompt tokens, completion tokens, sampled tokens) each."""

    def recorded(policy, optimizer, samples, *a, **kw):
        shapes.append([(len(s.prompt_ids), len(s.completion_ids), s.sampled) for s in samples])
        return train_step(policy, optimizer, samples, *a, **kw)

    return recorded


def step_work(policy, sequences: list[tuple[int, int, int]], lora) -> dict[str, float]:
    """What the step computed, for the roofline: the update's useful FLOPs, the decode's rows, its
    sampled tokens and mean context (`roofline`)."""
    import roofline

    shape = roofline.Shape.of(policy.model.get_base_model().config)
    return {
        "train_flops": roofline.train_flops(shape, [(p + c, k) for p, c, k in sequences], lora.rank, lora.target_modules),
        "decode_rows": float(len(sequences)),
        "decode_tokens": float(sum(c for _, c, _ in sequences)),
        "decode_context": sum(p + c / 2 for p, c, _ in sequences) / len(sequences),
        "decode_prompt": sum(p for p, _, _ in sequences) / len(sequences),
        "completions": [c for _, c, _ in sequences],  # not a number: kept out of the medians
    }


def _memory(clock: "Clock", rss_start: int) -> dict:
    return {
        "steps": clock.steps,
        "rss_start": rss_start,
        "rss_hwm": rss_kib("VmHWM"),
        "peak": lm_common.peak_rss_mib() * 1024,
        "gpu_peak": gpu_peak_kib(),
    }


def run_trl(args, model_dir: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from dagster_rl.tasks.lm.data.prompts import prompts_for_step, render
    from dagster_rl.tasks.lm.model.policy import lora_config
    from dagster_rl.tasks.lm.rewards import score_text

    sampling, grpo, rubric = settings(args)
    prompt_set = prompt_set_of(args)
    rows = [it for step in range(args.steps) for it in prompts_for_step(prompt_set.train, args.seed, step, args.prompts)]
    tok = AutoTokenizer.from_pretrained(model_dir)

    def prompt(it):  # what ours encodes: the user's turn of the chat template, or the plain template
        return [{"role": "user", "content": it.question}] if tok.chat_template else render(it, prompt_set.template)

    dataset = Dataset.from_list([{"prompt": prompt(it), "reference": it.reference} for it in rows])

    def reward(completions, reference, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]  # conversational: the assistant's turn
        return [sum(score_text(t, ref, rubric)[1].values()) for t, ref in zip(texts, reference, strict=True)]

    peft_config = lora_config(lora_of(args))
    batch = args.prompts * args.samples
    config = GRPOConfig(
        output_dir=str(model_dir.parent / "trl-out"),
        max_steps=args.steps,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=args.samples,
        num_iterations=1,
        max_completion_length=sampling.max_new_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=0,
        learning_rate=grpo.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=grpo.weight_decay,
        adam_beta1=grpo.betas[0],
        adam_beta2=grpo.betas[1],
        adam_epsilon=grpo.adam_eps,
        max_grad_norm=grpo.max_grad_norm,
        optim="adamw_torch",
        beta=grpo.kl_beta,
        epsilon=grpo.clip_eps,
        loss_type="grpo",
        importance_sampling_level="token",
        scale_rewards="group",
        mask_truncated_completions=False,
        disable_dropout=True,
        shuffle_dataset=False,
        use_vllm=False,
        use_cpu=args.device == "cpu",
        bf16=args.dtype == "bfloat16",
        fp16=False,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        log_completions=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=args.seed,
        gradient_checkpointing=args.worker == "trl",  # trl: TRL's default (on); trl-nogc: off, its fastest
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype))
    trl = GRPOTrainer(
        model=model, reward_funcs=reward, args=config, train_dataset=dataset, processing_class=tok, peft_config=peft_config
    )
    # the same initial adapter as ours (LoRA A drawn from lora.init_seed; B = 0)
    ours = {
        n: p.to(next(trl.model.parameters()).device)
        for n, p in lm_common.make_policy(model_dir, lora_of(args), device="cpu").trainable()
    }
    trained = [(n, p) for n, p in trl.model.named_parameters() if p.requires_grad]
    if sorted(n for n, _ in trained) != sorted(ours):
        raise SystemExit(f"TRL's adapter has other parameters than ours: {sorted(n for n, _ in trained)[:4]}...")
    with torch.no_grad():
        for n, p in trained:
            p.copy_(ours[n])
    del ours

    clock = Clock()
    trl._generate = clock.wrap("decode", trl._generate)
    trl._get_per_token_logps_and_entropies = clock.wrap("nograd_logp", trl._get_per_token_logps_and_entropies, when=no_grad_now)
    rewards_seen: list[float] = []

    def calculate_rewards(*a, **kw):
        out = calculate(*a, **kw)
        rewards_seen.append(float(out.nansum(dim=1).mean()))
        return out

    calculate = trl._calculate_rewards
    trl._calculate_rewards = clock.wrap("reward", calculate_rewards)

    class Steps(TrainerCallback):
        def on_step_begin(self, *_, **__):
            clock.start()

        def on_step_end(self, *_, **__):
            clock.stop(mean_reward=rewards_seen[-1] if rewards_seen else float("nan"))

    trl.add_callback(Steps())
    rss_start = reset_hwm()
    reset_gpu_peak()
    trl.train()
    return _memory(clock, rss_start)


def worker(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    result = (run_ours if args.worker.startswith("ours") else run_trl)(args, Path(args.model_dir))  # trl, trl-nogc
    print("RESULT " + json.dumps(result), flush=True)


def spawn(python: str, engine: str, args, model_dir: Path) -> dict:
    script, env = Path(__file__).resolve(), None
    if engine == "baseline":  # ours, as another checkout of the project has it
        script, engine = Path(args.baseline).resolve() / "bench" / "grpo_vs_trl.py", "ours"
        env = {**os.environ, "PYTHONPATH": str(Path(args.baseline).resolve())}
    cmd = [python, str(script), "--worker", engine, "--model-dir", str(model_dir)]
    for name in (
        "steps",
        "prompts",
        "samples",
        "max_new_tokens",
        "threads",
        "lr",
        "beta",
        "epsilon",
        "temperature",
        "top_p",
        "seed",
        "micro_batch_tokens",
        "device",
        "dtype",
        "prompts_path",
    ):
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if args.model:
        cmd += ["--model", args.model]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{engine} worker failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def trl_importable(python: str) -> str | None:
    """None when `python` imports trl; else why not."""
    done = subprocess.run([python, "-c", "import trl; print(trl.__version__)"], capture_output=True, text=True)
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["no output"])[-1]


def summary(runs: list[dict]) -> dict[str, float]:
    later = [s for r in runs for s in r["steps"][1:]]
    med = {k: statistics.median(s.get(k, 0.0) for s in later) for k in ("step", "cpu", *PHASES, *WORK)}
    med["train"] = med["step"] - sum(med[p] for p in PHASES)
    med["first"] = statistics.median(r["steps"][0]["step"] for r in runs)
    med["reward_first"] = runs[0]["steps"][0]["mean_reward"]
    med["reward_last"] = runs[0]["steps"][-1]["mean_reward"]
    every = [s for r in runs for s in r["steps"]]
    if "logp_max_dev" in every[0]:  # ours: the on_policy check's numbers, over every step of every run
        med["logp_max_dev"] = max(s["logp_max_dev"] for s in every)
        med["logp_mean_dev"] = max((s["logp_mean_dev"] for s in every), key=abs)
    return med


def distance_to_the_limit(m: dict[str, float], machine, model_dir, args, last: dict) -> str:
    """Ours against the machine's peaks: the update's FLOP/s and the decode's tokens/s."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir) if model_dir else None
    if config is None:
        from dagster_rl.tasks.lm.model.tiny import tiny_config, tiny_tokenizer

        tok = tiny_tokenizer()
        config = tiny_config(len(tok), tok.pad_token_id, tok.eos_token_id, hidden=args.hidden, layers=args.layers)
    shape = roofline.Shape.of(config)
    train_rate = m["train_flops"] / max(m["train"], 1e-9) / 1e9
    decode_rate = m["decode_tokens"] / max(m["decode"], 1e-9)
    bound = roofline.decode_roofline(machine, shape, int(m["decode_rows"]), m["decode_context"])
    least = roofline.decode_seconds_bound(machine, shape, last["decode_prompt"], last["completions"])
    return (
        f"distance to the limit, ours (median step): update {m['train_flops'] / 1e9:.0f} useful GFLOP in {m['train']:.2f} s "
        f"= {train_rate:.1f} GFLOP/s, {train_rate / machine.fp32_gflops:.2f} of the float32 matmul peak "
        f"({machine.fp32_gflops:.0f}); padded tokens {m['pad_share']:.3f} of the update's; decode {decode_rate:.1f} sampled "
        f"tokens/s, {decode_rate / bound:.2f} of the roofline {bound:.0f} tokens/s ({int(m['decode_rows'])} rows, mean "
        f"context {m['decode_context']:.0f}, {machine.bandwidth_gbs:.1f} GB/s); the last step's completions needed at least "
        f"{least:.2f} s of its {last['decode']:.2f} s of decode ({least / last['decode']:.2f}, `roofline.decode_seconds_bound`)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step (GRPO groups)")
    parser.add_argument("--samples", type=int, default=8, help="completions per prompt (TRL num_generations)")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads in each engine's process")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--beta", type=float, default=0.04, help="KL weight")
    parser.add_argument("--epsilon", type=float, default=0.2, help="clip window")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="of the base model")
    parser.add_argument("--micro-batch-tokens", type=int, default=0, help="ours: grpo.micro_batch_tokens (0: its default)")
    parser.add_argument(
        "--engines",
        default="ours,trl",
        help="which engines to run, of ours, ours-bf16 (ours, the base in bfloat16), trl (its defaults), trl-nogc (gradient checkpointing off)",
    )
    parser.add_argument("--rounds", type=int, default=2, help="runs of each engine, alternated")
    parser.add_argument("--trl-python", default=sys.executable, help="the python that has trl (default: this one)")
    parser.add_argument(
        "--model", default="", help="a model folder or builtin: name (default: the tiny model of --hidden/--layers)"
    )
    parser.add_argument("--prompts-path", default="builtin:addition-1-20", help="with --model: a GSM8K-format prompt set")
    parser.add_argument(
        "--baseline",
        default="",
        help="a checkout of the project (a folder): its `ours` runs too, as `baseline`, alternated with the others",
    )
    parser.add_argument("--worker", choices=("ours", "ours-bf16", "trl", "trl-nogc"), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.steps < 2:
        parser.error("--steps must be >= 2: the first step is reported apart")

    lora = lora_of(args)
    size = f"model {args.model}" if args.model else f"hidden {args.hidden}, {args.layers} layers"
    print(
        f"GRPO step: {args.prompts} prompts x {args.samples} samples, {args.max_new_tokens} new tokens, {args.steps} steps, "
        f"{size}, LoRA r{lora.rank} on {','.join(lora.target_modules)}, {args.threads} torch thread(s) per engine; "
        f"load average at start {os.getloadavg()[0]:.2f}"
    )
    why = trl_importable(args.trl_python)
    if why is not None:
        print(
            f"TRL skipped: `{args.trl_python} -c 'import trl'` failed ({why}). Install trl in a separate venv "
            "(see this file's docstring) and pass --trl-python."
        )
    engines = {
        "ours": sys.executable,
        "ours-bf16": sys.executable,
        **({"baseline": sys.executable} if args.baseline else {}),
        **({"trl": args.trl_python, "trl-nogc": args.trl_python} if why is None else {}),
    }
    engines = {k: v for k, v in engines.items() if k in args.engines.split(",") or k == "baseline"}
    runs: dict[str, list[dict]] = {k: [] for k in engines}
    machine = roofline.measure(args.threads)  # the machine's peaks in this run, at the engines' thread count
    print(machine.line(), flush=True)
    loads = []
    with tempfile.TemporaryDirectory() as d:
        model_dir = (
            Path(resolve_model(args.model))
            if args.model
            else lm_common.save_model(Path(d) / "model", hidden=args.hidden, layers=args.layers)
        )
        for _ in range(args.rounds):  # alternated, so that a busy spell of the machine hits both
            for name, python in engines.items():
                try:
                    runs[name].append(spawn(python, name, args, model_dir))
                except SystemExit as e:  # one engine's failure (out of memory, say) loses no other engine's numbers
                    print(f"{name}: {str(e)[-2000:]}", flush=True)
                loads.append(os.getloadavg()[0])
                print(f"  {name} done, load average {loads[-1]:.1f}", flush=True)
    runs = {k: v for k, v in runs.items() if v}
    rows = {k: summary(v) for k, v in runs.items()}
    results = {k: {m: max(r.get(m, 0) for r in v) for m in ("rss_start", "rss_hwm", "peak", "gpu_peak")} for k, v in runs.items()}
    gpu = args.device == "cuda"
    print(
        f"\nseconds per step: median of steps 2..{args.steps} of {args.rounds} run(s) each; memory MiB, max over runs; "
        f"load average after each run {', '.join(f'{x:.1f}' for x in loads)}"
    )
    head = f"{'engine':<10}{'step s':>8}{'CPU s':>8}{'decode':>8}{'nograd':>8}{'reward':>8}{'train':>8}{'1st step':>10}{'RSS@start':>11}{'HWM steps':>11}{'peak':>8}"
    print(head + (f"{'GPU peak':>10}" if gpu else "") + f"{'reward 1st->last':>18}")
    for name, m in rows.items():
        r = results[name]
        print(
            f"{name:<10}{m['step']:>8.3f}{m['cpu']:>8.3f}{m['decode']:>8.3f}{m['nograd_logp']:>8.3f}{m['reward']:>8.3f}{m['train']:>8.3f}"
            f"{m['first']:>10.3f}{r['rss_start'] / 1024:>11.0f}{r['rss_hwm'] / 1024:>11.0f}{r['peak'] / 1024:>8.0f}"
            + (f"{r['gpu_peak'] / 1024:>10.0f}" if gpu else "")
            + f"{m['reward_first']:>9.2f} ->{m['reward_last']:>5.2f}"
        )
    print(
        "step s: wall time; CPU s: this process's CPU time (user + system), the steadier figure on a busy machine; "
        "decode: sampling tokens (ours records their log-probs as it samples); nograd: the reference forwards, adapter "
        "disabled (ours: one per micro-batch; TRL: one batched); train: forwards with grad, backwards, optimizer "
        "(ours: one forward and backward per micro-batch; TRL: the whole batch at once)"
    )
    memory = "gpu_peak" if gpu else "rss_hwm"
    for name, m in rows.items():
        if "logp_max_dev" in m:
            print(
                f"on-policy, {name}: max |logp_trainer - logp_sampler| {m['logp_max_dev']:.2e}, largest |mean| {m['logp_mean_dev']:+.2e} (every step of every run)"
            )
    if "ours" in rows:
        last = runs["ours"][-1]["steps"][-1]
        print(distance_to_the_limit(rows["ours"], machine, model_dir if args.model else None, args, last))
    if "ours" in rows and "ours-bf16" in rows:
        o, b = rows["ours"], rows["ours-bf16"]
        print(
            f"bfloat16 / float32 (ours): step time {b['step'] / o['step']:.2f} (CPU time {b['cpu'] / o['cpu']:.2f}; decode "
            f"{b['decode'] / o['decode']:.2f}, train {b['train'] / o['train']:.2f}), RSS high-water mark "
            f"{results['ours-bf16'][memory] / max(results['ours'][memory], 1):.2f}"
        )
    for ours, trl in [(o, t) for o in ("ours", "baseline") for t in ("trl", "trl-nogc")]:
        if trl not in rows or ours not in rows:
            continue
        if args.model:  # the real model's targets: against TRL's defaults, and against its fastest configuration
            target = 0.5 if trl == "trl" else 0.6
        else:  # the tiny model's: fixed costs weigh most at the tiny size
            target = 1.0 if (args.hidden, args.layers) == (64, 2) else 0.8
        ratio = rows[ours]["step"] / rows[trl]["step"]
        cpu_ratio = rows[ours]["cpu"] / rows[trl]["cpu"]
        mem = results[ours][memory] / max(results[trl][memory], 1)
        parts = {phase: rows[ours][phase] / max(rows[trl][phase], 1e-9) for phase in ("decode", "train")}
        print(
            f"ratio {ours}/{trl}: step time {ratio:.2f} ({'meets' if ratio <= target else 'misses'} the target <= {target}; "
            f"CPU time {cpu_ratio:.2f}; decode {parts['decode']:.2f}, train {parts['train']:.2f}), "
            f"{'GPU memory peak' if gpu else 'RSS high-water mark during the steps'} {mem:.2f} "
            f"({'meets' if mem <= 1.0 else 'misses'} the target <= 1.0)"
        )


if __name__ == "__main__":
    main()
