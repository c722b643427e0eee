"""The tasks, each a package that registers itself (`dagster_rl.core.task.register`).

secret_search  the agentic sandbox world, tabular document priors
lm             language models: GRPO over a LoRA adapter, prompts with verifiable answers
agent          a language model acting in a text environment over several turns (`text_agent`)
"""
