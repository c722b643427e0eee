"""`dagster-rl serve`: the project's own engine behind the subset of vLLM's OpenAI-compatible
protocol the loop uses.

    app       the server: a Starlette application, its routes and its one exception handler; `main`
    protocol  the request bodies (pydantic models), the request a batch runs, vLLM's completion answer
    errors    vLLM's error format (`APIError`), a pydantic validation error worded as one
    batcher   concurrent requests run in batches of one group, each answered with its own result
    engine    the base model, its LoRA adapters by name, the generation of one batch
    prefix_cache  the KV caches of the sequences served, by token prefix: a continued sequence computes its new tokens only
    cli       the command line (loads no model code for `--help`)
"""
