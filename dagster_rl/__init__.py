"""dagster-rl: durable RL post-training as a Dagster asset pipeline. This package is the library;
it knows nothing of Dagster (see `resources/` and `assets/` for the Dagster layer).

Start with `core.task`: what a task is and what it must provide, in one screen.

    base        the foundation, importing nothing of dagster_rl: errors, hashing, bounds, strict settings
    core        generic: task, experiment, records, steps, checks, lineage
    store       the content-addressed artifact store
    runtime     processes, workers, pods, Kubernetes manifests
    inference   JSON over HTTP, the vLLM client, managed inference servers
    judges      the judge's backends: the task's rubric in process, an LLM judge
    sandbox     the sandbox tier: programs a model wrote, run isolated (bubblewrap here, pods on a cluster)
    tasks       one package per task: `secret_search` (agentic sandbox), `lm` (language models)
"""
