"""dagster-rl: durable RL post-training as a Dagster asset pipeline. This package is the library;
it knows nothing of Dagster (see `resources/` and `assets/` for the Dagster layer).

Start with `task`: what a task is and what it must provide, in one screen.

Generic, for every task:
    task              the Task record a task registers, the loop's contract, the registry
    experiment        what every experiment's settings have (`Experiment`), step keys
    experiment_files  YAML files -> experiments, forks resolved, by each task kind's class
    records           Rollouts[T], Rewards[R], TrainedFrom: what every step stores
    steps             what every loop shares: judging a step, the rollouts and rewards keys
    store             the content-addressed artifact store (any fsspec URL), `get_or_put`
    hashing           canonical JSON, content hashes, cache keys, seeds
    checks            per-step checks (rewards in bounds, enough usable trials)
    advantages        GRPO group-normalized advantages
    rubric_judge      the judge's `in_process` backend: the task's verifier + rubric
    llm_judge         the judge's `openai` backend: an LLM over an OpenAI-compatible endpoint
    judge_journal     every LLM-judge call, journaled so a retry never pays twice
    lineage           trace a checkpoint back to step 0 through the store alone
    retries, faults, counters, errors   limits and retries, seeded faults, call counts, errors

Tasks, each a package that registers itself:
    secret_search     the agentic sandbox world, tabular document priors
    lm                language models: GRPO over a LoRA adapter, prompts with verifiable answers
"""
