"""Generating a step's rollouts.

sampling       batched KV-cache decoding, one seeded generator per row, each token's log-prob
kv_cache       KV caches kept between calls of the sampler: a batch's, carried to its next turn; single rows
hf             a step's rollouts on `transformers`, and greedy completions (rollout `hf`)
openai_client  rollout `openai_server`: a client of a vLLM or `dagster-rl serve` server
vllm_serving   the vLLM command that serves an experiment (its flags from the experiment)
"""
