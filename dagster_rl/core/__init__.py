"""The generic core, the same for every task: what a task is, what an experiment is, what a step
stores and checks. It builds on `dagster_rl.base` (errors, hashing, bounds, strict settings) and on
`store` and `runtime`; none of those imports it.

    task                  the Task record a task registers, the loop's contract, the registry
    experiment            what every experiment's settings have (`Experiment`), step keys
    experiment_files      YAML files -> experiments, forks resolved, by each task kind's class
    experiment_reference  the experiment-file reference, written from the pydantic models
    records               Rollouts[T], Rewards[R], TrainedFrom: what every step stores
    steps                 what every loop shares: judging a step, the rollouts and rewards keys
    checks                per-step checks (rewards in bounds, enough usable trials)
    advantages            GRPO group-normalized advantages
    lineage               trace a checkpoint back to step 0 through the store alone
    progress              trials generated and judged of planned, for the run's log
"""
