"""The tokenizers of the built-in tiny models, trained in code: byte-level BPEs that Qwen2's tokenizer
rebuilds exactly, and the ChatML chat template the chat models carry.

`tiny_tokenizer` (the 68-token vocabulary of the synthetic task), `gsm8k_tokenizer` (every byte plus
the word problems' words), and the pieces a task's own tiny chat tokenizer is built from
(`dagster_rl.tasks.agent.tiny`): `bpe`, `qwen2_tokenizer`, the special tokens and `CHAT_TEMPLATE`.
The models that use them are `tiny`'s; this module names no task's tokenizer, so a task's imports
it without the models importing the task back.
"""

import json

from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer

PAD, EOS = "<pad>", "<eos>"
DIGITS = tuple(str(d) for d in range(10))
WORDS = ("copy", "last", "what", "is", "the", "answer", "+", "-", "=", "?", ":", ".", ",", "####")


def tiny_tokenizer() -> Qwen2Tokenizer:
    """Byte-level BPE over the task's words, each word (and each word after a space) one token."""
    vocab, merges = bpe([*WORDS, *(f" {w}" for w in WORDS), *DIGITS, " "], [PAD, EOS], byte_alphabet=False)
    return qwen2_tokenizer(vocab, merges, eos=EOS, pad=PAD)


def bpe(corpus: list[str], special_tokens: list[str], byte_alphabet: bool) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocab, merges) of a byte-level BPE trained on `corpus` until every string of it is one token."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    alphabet = pre_tokenizers.ByteLevel.alphabet() if byte_alphabet else []
    trainer = trainers.BpeTrainer(
        vocab_size=4000, min_frequency=1, special_tokens=special_tokens, initial_alphabet=alphabet, show_progress=False
    )
    bpe.train_from_iterator(corpus, trainer=trainer)
    model = json.loads(bpe.to_str())["model"]
    return model["vocab"], [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]


def qwen2_tokenizer(vocab: dict[str, int], merges: list[tuple[str, str]], eos: str, pad: str) -> Qwen2Tokenizer:
    """A Qwen2 tokenizer over a trained BPE, with no unknown token (byte-level: every string encodes)."""
    # transformers annotates `merges` as `str | list[str]` and `unk_token` as `str`; it hands both to
    # `tokenizers.models.BPE`, which takes merge pairs as tuples and None for "no unknown token".
    return Qwen2Tokenizer(vocab=vocab, merges=merges, eos_token=eos, pad_token=pad, unk_token=None)  # type: ignore[arg-type]


IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def gsm8k_tokenizer() -> Qwen2Tokenizer:
    """Every byte, plus each word of the word problems (bare and after a space) as one token, and a
    ChatML chat template whose turns end with the eos token `<|im_end|>`."""
    from dagster_rl.tasks.lm.data.word_problems import vocabulary

    words = [*vocabulary(), "user", "assistant", "system"]
    corpus = [*words, *(f" {w}" for w in words), *DIGITS, " ", "\n", ".\n", "?\n", " ?", " ."]
    vocab, merges = bpe(corpus, [PAD, IM_START, IM_END], byte_alphabet=True)
    tok = qwen2_tokenizer(vocab, merges, eos=IM_END, pad=PAD)
    tok.add_special_tokens({"additional_special_tokens": [IM_START]})
    tok.chat_template = CHAT_TEMPLATE
    return tok
