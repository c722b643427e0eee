"""The language-model agent task: a LoRA policy acts in a text environment over several turns, trained
by GRPO over whole trajectories. Nothing here imports Dagster.

One idea per module:
    task         the Task record this package registers (`text_agent`)
    experiment   its settings: the environment, the episode's budgets, the held-out worlds
    environment  the text-environment protocol, and environments registered by name
    text_world   `secret_search` as a text environment (clue, titles, `open`, `next`, `answer`)
    python_tool  `python_tool`: questions one line of Python answers, and a Python tool run in the sandbox
    textarena_settings  the `textarena` environment's settings: the games verified offline, their options (no textarena import)
    textarena_game  `textarena`: a single-player textarena game (GuessTheNumber, TowerOfHanoi), seeded by its world
    trial_sandbox  what an environment gets for one trial: its own folder, and a sandbox for its programs
    environment_process  one trial's environment in a process of its own, each call timed alone
    environment_host  the process that forks the environments' processes
    tiny         the tokenizer of `builtin:tiny-qwen2-agent`
    chat         the chat template's turn markers as token ids
    records      episodes planned; one trajectory per trial (ids, mask, log-probs, turns); rewards
    episode      one trial's turn loop: its environment's process, its sandbox, its token sequence
    rollout_hf   episodes on `transformers`, the live trials of a step batched by turn
    backends     the rollout backend `hf` (the trainers are the language-model task's)
    rollout_server  the rollout backend `openai_server`: one completion request per turn, token ids in and out
    judge        verifier + rubric: success, and fewer turns
    grading      the LLM judge's prompt (the episode as text) and its reward
    warmup       SFT on the environment's demonstrations, loss on the actions only
    evaluation   greedy episodes on held-out worlds: success, mean turns
    loop         the step (the language-model loop over episodes)
"""
