"""Prompts with verifiable answers.

prompts        GSM8K-format JSONL files, or a built-in synthetic set; rendering and answers
word_problems  GSM8K-format word problems written in code
arithmetic     arithmetic questions written in code (`builtin:addition-1-20`)
files          a local JSONL, Parquet or CSV file, read by Hugging Face `datasets` with a column mapping
gym            reasoning-gym's procedural tasks (`gym_score`: their `score_answer`, as a worker calls it)
sources        every kind of prompt source, chosen by `kind`
"""
