"""The language-model path: GRPO over a LoRA adapter on a `transformers` causal LM.

One idea per module: `tiny` (a tiny model built in code), `tasks` (prompts with verifiable answers),
`policy` (base + adapter + checkpoints), `sampling` and `rollout_hf` (seeded generation),
`rewards` (verifier + rubric), `grpo_loss` (the loss, pure), `trainer` (one update, single or
data-parallel), `worker` (the torchrun entrypoint). Nothing here imports Dagster.
"""
