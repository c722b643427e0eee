"""`dagster-rl serve`: the project's own engine behind the subset of vLLM's OpenAI-compatible
protocol the loop uses.

    app  the server: routes, request models, the batcher, adapters
    cli  the command line (loads no model code for `--help`)
"""
