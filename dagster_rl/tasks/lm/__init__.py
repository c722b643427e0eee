"""The language-model task: GRPO over a LoRA adapter on a `transformers` causal LM. Nothing here
imports Dagster.

    task         the Task record this package registers
    experiment   its settings (task, policy, sampling, rubric, GRPO, trainer)
    settings     LoRA, sampling, GRPO and warm-up settings
    records      the trials' requests, planned, and the rollouts they produce
    rewards      verifier + rubric: accuracy, format and reward functions; the step's scorer
    verifiers    how an answer is checked: the number rule, math-verify, a reasoning-gym scorer
    verify_math  math-verify, as a worker process calls it
    reward_functions  a rubric's reward functions, called as TRL calls them, in worker processes
    grading      the LLM judge's prompt and reward for a completion
    evaluation   greedy accuracy on the held-out prompts
    backend_protocols  what the loop calls on its rollout and trainer backends
    backends     the rollout (`hf`) and trainer (`in_process`, `torchrun`, `k8s`) backends
    code_versions  the code version in every key of each kind of artifact
    weights      stored weights, and step 0's: the base's fresh adapter or the warm-up's (`<exp>/sft`)
    step_generation  a step's rollouts and rewards: generated, judged as they land, stored
    step_evaluation  a step's held-out evaluation (`<exp>/evaluation`)
    loop         the steps: generate, train, evaluate, pipelined
    in_memory    one step in memory, no store (tests, benchmarks)

    model/       the policy (base + LoRA), where its weights come from, its log-probabilities
    data/        prompts with verifiable answers
    rollout/     sampling, and the `hf` and `openai_server` rollout backends
    train/       the GRPO loss, the update, the warm-up, the trainer entrypoint
    serve/       `dagster-rl serve`
"""
