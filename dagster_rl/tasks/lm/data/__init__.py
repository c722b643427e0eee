"""Prompts with verifiable answers.

prompts        GSM8K-format JSONL files, or a built-in synthetic set; rendering and answers
word_problems  GSM8K-format word problems written in code
arithmetic     arithmetic questions written in code (`builtin:addition-1-20`)
"""
