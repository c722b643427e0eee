"""The judge environment's backends, for every task.

rubric_judge  `in_process`: the task's own verifier + rubric, in this process
llm_judge     `openai`: an LLM over an OpenAI-compatible chat endpoint
journal       every LLM-judge call, journaled so a retry never pays twice
"""
