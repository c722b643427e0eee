"""The tokenizer of `builtin:tiny-qwen2-agent`: a tiny chat model for the text environments, built in code.

Every byte (any text encodes), plus each word of the `secret_search` text world (its titles and the
words it writes and reads, bare and after a space) as one token, the ChatML special tokens and
chat template of `dagster_rl.tasks.lm.model.tiny` (turns end with the eos token `<|im_end|>`). Upper-case hex
characters are never merged with each other (no word has two upper-case letters in a row), so a
digest is one token per character, in the observation and in the answer alike.
"""

from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

from dagster_rl.tasks.agent.text_world import TITLES, VERBS
from dagster_rl.tasks.lm.model.tokenizers import CHAT_TEMPLATE, DIGITS, IM_END, IM_START, PAD, bpe, qwen2_tokenizer


def agent_tokenizer() -> Qwen2Tokenizer:
    words = [*TITLES, *VERBS, "user", "assistant", "system"]
    corpus = [*words, *(f" {w}" for w in words), *DIGITS, *"ABCDEF", " ", "\n", ":", " :"]
    vocab, merges = bpe(corpus, [PAD, IM_START, IM_END], byte_alphabet=True)
    tok = qwen2_tokenizer(vocab, merges, eos=IM_END, pad=PAD)
    tok.add_special_tokens({"additional_special_tokens": [IM_START]})
    tok.chat_template = CHAT_TEMPLATE
    return tok
