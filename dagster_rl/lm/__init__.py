"""The language-model task: GRPO over a LoRA adapter on a `transformers` causal LM. Nothing here
imports Dagster.

One idea per module:
    task         the Task record this package registers
    experiment   its settings (task, policy, sampling, rubric, GRPO, trainer)
    settings     LoRA, sampling and GRPO settings
    prompts      prompts with verifiable answers: GSM8K-format files, a synthetic set
    records      the trials' requests, planned, and the rollouts they produce
    tiny         a tiny Qwen2 built in code (`builtin:tiny-qwen2`)
    policy       base + adapter (a live `Policy`) and its checkpoints
    sampling     batched KV-cache decoding, one seeded generator per row, each token's log-prob
    logprobs     the one definition of a completion's log-probabilities; packed batches
    rollout_hf   a step's rollouts on `transformers`, and greedy completions
    rewards      verifier + rubric: accuracy and format
    grpo_loss    the clipped-ratio loss with k3 KL, pure, per sample or per padded batch
    trainer      one update over micro-batches, single process or data-parallel
    worker       the trainer entrypoint (`python -m dagster_rl.lm.worker`, torchrun, pods)
    backends     the rollout (`hf`) and trainer (`in_process`, `torchrun`) backends
    evaluation   greedy accuracy on the held-out prompts
    loop         the step: generate, judge, train, evaluate, pipelined
    in_memory    one step in memory, no store (tests, benchmarks)
"""
