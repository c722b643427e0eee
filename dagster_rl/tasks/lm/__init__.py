"""The language-model task: GRPO over a LoRA adapter on a `transformers` causal LM. Nothing here
imports Dagster.

    task         the Task record this package registers
    experiment   its settings (task, policy, sampling, rubric, GRPO, trainer)
    settings     LoRA, sampling, GRPO and warm-up settings
    records      the trials' requests, planned, and the rollouts they produce
    rewards      verifier + rubric: accuracy and format
    grading      the LLM judge's prompt and reward for a completion
    evaluation   greedy accuracy on the held-out prompts
    backends     the rollout (`hf`) and trainer (`in_process`, `torchrun`) backends
    loop         the step: generate, judge, train, evaluate, pipelined
    in_memory    one step in memory, no store (tests, benchmarks)

    model/       the policy (base + LoRA), where its weights come from, its log-probabilities
    data/        prompts with verifiable answers
    rollout/     sampling, and the `hf` and `openai_server` rollout backends
    train/       the GRPO loss, the update, the warm-up, the trainer entrypoint
    serve/       `dagster-rl serve`
"""
