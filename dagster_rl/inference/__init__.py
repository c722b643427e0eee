"""Talking to inference servers, model-agnostic: JSON over HTTP, vLLM's OpenAI-compatible protocol,
and a server process this process starts and stops.

    http_json       one pooled JSON-over-HTTP client, its errors
    vllm_client     a client of vLLM's completions endpoint, the sampling fields vLLM accepts
    server_process  an inference server (vLLM's CPU build, `dagster-rl serve`) started and stopped here

`dagster-rl serve` itself runs the language-model task's policy and sampler, so it lives with
them, in `dagster_rl.tasks.lm.serve`.
"""
