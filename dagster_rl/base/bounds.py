"""Upper bounds of the experiment settings, and where each comes from.

Every number an experiment file holds has an upper bound, checked when the file loads (the error
names the file, the field and the bound). Sizes multiply into memory, so they are derived from what
one node of the largest kind an experiment is meant for can hold, stated once here:

    NODE_THREADS      1,024   hardware threads of one node (the largest: 2 sockets x 192 cores x 2)
    NODE_GPUS            16   GPUs of one node (8 is the usual)
    DRIVER_STEP_BYTES 16 GiB  what the driver's process may hold of one step: it loads a step's
                              rollouts and rewards whole (records in Python lists, and their JSON)

and products are checked where sizes multiply (trials x tokens, prompts x tokens, processes x
threads, LoRA alpha / rank; LoRA rank x the model's hidden size when the model loads). Scalars
(learning rates, rubric weights, scales) are bounded where the update's float32 arithmetic stays
finite with a wide margin, far above any value that trains: past it a value is a typo, and would
crash far away (an overflow, a 256 GB allocation) instead of failing here.
"""

NODE_THREADS = 1024
NODE_GPUS = 16
DRIVER_STEP_BYTES = 16 * 2**30

# Seeds are 64-bit: what torch's and numpy's generators take.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1

# Steps are partitions keyed 0000..9999.
MAX_STEPS = 9999
# How many steps the sampler may run ahead of the trainer (`max_policy_lag`): prime-rl's
# `max_off_policy_steps` default, the largest of the anchors'; the driver holds the rollouts of the
# step that trains and of every step generated ahead of it, so a step's tokens count lag + 1 times.
MAX_POLICY_LAG = 8
# An importance weight's cap (the off-policy corrections'): past 1,000 a weight capped there already
# lets one token outweigh a thousand; the anchors use 2 to 5.
MAX_IMPORTANCE_CAP = 1000.0

# Threads of one process, and processes x threads of one node: the node's hardware threads
# (torch.set_num_threads(10**9) dies in libgomp's allocator).
MAX_THREADS = NODE_THREADS
MAX_NODES = 1024  # pods of one trainer Job: a cluster's worth of nodes
MAX_RESTARTS = 100
MAX_DEADLINE_S = 7 * 24 * 3600  # a week per update (or per attempt of a call): longer is a typo in seconds
# An environment's calls at once (threads of the driver's process: each a trial, a judgement, a
# request) and its retries of one call.
MAX_CONCURRENCY = 4096
MAX_RETRIES = 100

# Tokens one completion may sample (the context of the models we serve: 32k).
MAX_NEW_TOKENS = 32_768
# Tokens one step may sample (trials x max_new_tokens), or one evaluation (held-out prompts x
# eval_max_new_tokens): a step's records live whole in the driver's process at about 100 bytes a
# sampled token (its id and log-probability in Python lists, and their JSON), so 2^27 tokens is
# ~13 GiB, within DRIVER_STEP_BYTES.
BYTES_PER_SAMPLED_TOKEN = 100
MAX_TOKENS_PER_STEP = 2**27
MAX_HELDOUT_PROMPTS = 100_000

# A LoRA rank above the model's hidden size makes the adapter larger than the layers it adapts
# (checked against the model when it loads); statically, the largest hidden size of open models
# (Llama 3.1 405B: 16,384).
MAX_LORA_RANK = 16_384
# The adapter's output is scaled by alpha / rank (usually 1 or 2): at 1,024 a LoRA B entry of 1e-3
# already adds a whole unit to an activation.
MAX_LORA_SCALE = 1024.0
# Padded tokens of one trainer micro-batch: at the largest hidden size (16,384) in bfloat16 one
# layer's input for 2^20 tokens is 32 GiB, what one GPU can spare at most.
MAX_MICRO_BATCH_TOKENS = 2**20

# Adam moves each weight by about the learning rate per step, and weights (LoRA's included) are
# O(1): above 1 every step replaces the weights with noise.
MAX_LEARNING_RATE = 1.0
# The tabular update moves a prior's logits by learning_rate x (advantage-weighted gradient, O(1)):
# at 1,000 nats a single step already makes a prior one-hot (floored); beyond, only overflow.
MAX_TABULAR_LEARNING_RATE = 1000.0
# AdamW multiplies weights by 1 - lr x weight_decay: with lr <= 1, weight_decay <= 1 keeps it >= 0.
MAX_WEIGHT_DECAY = 1.0
# Epsilons guard a zero denominator (Adam's second moment, a group's reward spread); they are not
# scales: at 1 they already flatten gradients or advantages on the rubric's unit scale.
MAX_EPS = 1.0
# A gradient-norm clip threshold: float32 norms of O(1) gradients; beyond 1e6 it clips nothing.
MAX_GRAD_NORM = 1e6
# The KL penalty's weight against an O(1) policy-gradient term: at 100 the update only holds the
# policy at its reference; larger values only overflow the loss.
MAX_KL_BETA = 100.0
# Sampling temperature: at 100 the next token is uniform over the vocabulary to within 1%.
MAX_TEMPERATURE = 100.0

# A rubric weight scales one criterion of the reward. GRPO normalizes rewards within a group, so
# only ratios of weights matter: at 1e6 one criterion already silences the others, and 65,536
# squared rewards of that scale (a group's spread) stay near 1e17, far inside float32 (3.4e38).
MAX_REWARD_WEIGHT = 1e6

# secret_search: turns of one episode (an agent reads at most one document a turn, and a world
# holds at most 1,000 documents).
MAX_TURNS = 1000

# Modules an experiment imports before it is read (`plugins`): a list a person writes, one module per
# task kind or environment it registers.
MAX_PLUGINS = 64
