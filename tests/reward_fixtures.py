"""Reward functions the tests name as `tests.reward_fixtures:<name>` (a module on the Python path), and
the text of a user's reward-function file, as one beside an experiment holds it."""

import os
import time


def length(prompts, completions, completion_ids, **columns):
    """Shorter is better: -0.125 per completion token (binary fractions: the sums are exact)."""
    return [-0.125 * len(ids) for ids in completion_ids]


def mentions_answer(prompts, completions, completion_ids, answer, **columns):
    """1 when the reference answer appears in the completion, else no opinion."""
    return [1.0 if a in c else None for c, a in zip(completions, answer, strict=True)]


def echo_columns(prompts, completions, completion_ids, **columns):
    """The number of columns it was given (what reaches a function beside the prompt and completion)."""
    return [float(len(columns)) for _ in completions]


def sleepy(prompts, completions, completion_ids, **columns):
    time.sleep(float(os.environ.get("REWARD_FIXTURES_SLEEP", "0")))
    return [0.5 for _ in completions]


# A user's file: the reward is the number of distinct characters of the completion, over 64 (exact in
# binary), or, while `BROKEN` is in the file, a ZeroDivisionError.
USER_FILE = """\
def distinct_chars(prompts, completions, completion_ids, **kwargs):
    return [len(set(c)) / 64 for c in completions]
"""
BROKEN_USER_FILE = """\
def distinct_chars(prompts, completions, completion_ids, **kwargs):
    return [len(set(c)) / 0 for c in completions]  # BROKEN
"""
