"""The version of the code that makes each kind of the language-model task's artifacts: part of
every key of that kind (a new version is a new key: nothing stored under the old one is reused)."""

CODE_VERSIONS = {
    "initial": "lora-init-1",
    "warmup": "sft-lora-3",  # 2: stops at warmup.target_accuracy; 3: keyed by the prompts' content
    # 2: behavior log-probs recorded by the sampler; 3: keyed by the behavior weights' key and the step's prompts' content;
    # 4: finished rows leave the decode batch (the live rows computed in smaller batches: other float rounding)
    "rollouts": "hf-rollouts-4",
    "rewards": "lm-rubric-2",  # 2: keyed by the rollouts' key, which the rewards record
    # 2: packed micro-batches; 3: the trainer reports logp_max_dev (on_policy); 4: keyed by the keys of the weights and
    # rewards it trains from, and on-policy (the rollouts sampled by the weights it trains) the ratio's old log-probs are
    # the trainer's own
    # 5: no reference forward at kl_beta 0 (the record's `kl` absent there), the padded-token share (`pad_share`) in the
    # record, micro-batches bucketed by length with the least padding (other cuts: other float rounding)
    "weights": "grpo-lora-5",
    # 2: keyed by the held-out prompts' content and template; stores each answer; 3: finished rows leave the decode batch
    # (a greedy tie may break otherwise); a warm-up that checks its accuracy is keyed by this version too
    "evaluation": "greedy-eval-3",
}
