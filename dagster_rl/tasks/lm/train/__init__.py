"""Training the adapter: the GRPO loss, one update, the reference policy, the warm-up, and the
trainer entrypoint the pods run.

    grpo_loss   the clipped-ratio loss with k3 KL, pure, per sample or per padded batch
    corrections the off-policy corrections: decoupled objective, sampler-trainer mismatch (TIS / MIS)
    trainer     one update over micro-batches, single process or data-parallel
    reference   the KL term's reference policy: the base or the warm-up's adapter
    warmup      the supervised warm-up on demonstrations
    session     a trainer session: workers that take step after step of a range
    entrypoint  `python -m dagster_rl.tasks.lm.train.entrypoint`: alone, under torchrun, in pods
"""
