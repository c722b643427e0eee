"""The agentic task: an agent searches sandboxed worlds of documents for the digest of a secret.

One idea per module:
    task        the Task record this package registers
    experiment  its settings: worlds, rubric, tabular GRPO
    records     trials, trajectories, rewards, tabular weights
    world       worlds built deterministically from their id
    agent       one trial in a private copy of its world
    judge       verifier plus rubric
    grading     the LLM judge's prompt and reward for a trajectory
    prior       the Plackett-Luce document prior
    update      the tabular GRPO update (a pure function) and its finiteness check
    backends    the rollout (sandbox) and trainer (in-process) backends
    loop        the step: generate, judge, train, cached by content
"""
