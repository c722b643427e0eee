"""The generic core, the same for every task: what a task is, what an experiment is, what a step
stores and checks, and how artifacts are named by content.

    task                  the Task record a task registers, the loop's contract, the registry
    experiment            what every experiment's settings have (`Experiment`), step keys
    experiment_files      YAML files -> experiments, forks resolved, by each task kind's class
    experiment_reference  the experiment-file reference, written from the pydantic models
    plugins               user code an experiment imports (`plugins`), and installed `dagster_rl.plugins` entry points
    strict, bounds        the settings base (unknown fields are errors) and every upper bound
    records               Rollouts[T], Rewards[R], TrainedFrom: what every step stores
    steps                 what every loop shares: judging a step, the rollouts and rewards keys
    hashing               canonical JSON, content hashes, cache keys, seeds
    checks                per-step checks (rewards in bounds, enough usable trials)
    advantages            GRPO group-normalized advantages
    lineage               trace a checkpoint back to step 0 through the store alone
    differences           what differs between two computations of one artifact
    progress              trials generated and judged of planned, for the run's log
    plugins               user code an experiment names: a file in the experiments folder, or a module
    retries, faults, counters, errors   limits and retries, seeded faults, call counts, errors
"""
