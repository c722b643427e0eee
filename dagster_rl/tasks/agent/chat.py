"""The chat template's turn markers as token ids: how a trajectory grows, turn by turn.

A trajectory is one token sequence (`dagster_rl.tasks.agent.records`). Its first prompt is the chat
template around the environment's first observation, ready for the assistant's turn. After each
action the model sampled (its ids appended as sampled) come the template's end of the assistant's
turn and the observation as the next user turn, ready for the assistant again:

    <|im_start|>user\\nfind memo ...<|im_end|>\\n<|im_start|>assistant\\n       first prompt
    open memo<|im_end|>                                                   sampled (mask 1)
    \\n<|im_start|>user\\ndigest 3FA9C1<|im_end|>\\n<|im_start|>assistant\\n   observation (mask 0)
    answer 3FA9C1<|im_end|>                                               sampled (mask 1)

What goes between two actions is read from the tokenizer's own chat template, by difference: the
ids of a conversation with one more user turn, less the ids of the conversation before it. The
end of the assistant's turn is the template's text after an assistant message's content, starting
with the eos token (ChatML's `<|im_end|>\\n`): when the model sampled the eos, only the rest is
added; when the per-turn token budget cut it, all of it, so that every observation follows a
closed assistant turn, as the template writes it. A template whose earlier turns change when a turn
is added (one that cannot be extended by difference) is refused.
"""

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from dagster_rl.base.errors import DagsterRLError

_PROBE = [{"role": "user", "content": "probe"}, {"role": "assistant", "content": "reply"}]


class ChatTemplateError(DagsterRLError):
    """The tokenizer's chat template cannot frame a multi-turn trajectory."""

    retryable = False


def _ids(tok: PreTrainedTokenizerBase, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
    text = tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
    return list(tok(text, add_special_tokens=False)["input_ids"])


@dataclass(frozen=True)
class ChatTurns:
    """Token ids of a trajectory's prompt and of what follows each action, from one tokenizer."""

    tokenizer: PreTrainedTokenizerBase
    eos_id: int
    turn_end: tuple[int, ...]  # the template's end of an assistant turn, eos first

    @classmethod
    def of(cls, tok: PreTrainedTokenizerBase) -> "ChatTurns":
        if not getattr(tok, "chat_template", None):
            raise ChatTemplateError(
                "the agent task needs a tokenizer with a chat template (its turn markers frame every observation); "
                f"{type(tok).__name__} has none: use a chat model (e.g. builtin:tiny-qwen2-agent)"
            )
        eos = tok.eos_token_id
        asked = _ids(tok, _PROBE[:1], True)
        answered = _ids(tok, _PROBE, False)
        if answered[: len(asked)] != asked or eos not in answered[len(asked) :]:
            raise ChatTemplateError(
                "the tokenizer's chat template does not end an assistant turn with its eos token after the generation "
                "prompt: the agent task cannot tell where a sampled turn ends"
            )
        tail = answered[len(asked) :]
        end = tuple(tail[len(tail) - 1 - tail[::-1].index(eos) :])
        return cls(tok, eos, end)

    def prompt(self, observation: str) -> list[int]:
        """The first prompt: the first observation as the user's turn, ready for the assistant's."""
        return _ids(self.tokenizer, [{"role": "user", "content": observation}], True)

    def after_action(self, action_ids: list[int], observation: str) -> list[int]:
        """What follows an action's sampled ids: the end of its turn (the part it did not sample) and
        the observation as the next user turn, ready for the assistant's."""
        closed = self.turn_end[1:] if action_ids and action_ids[-1] == self.eos_id else self.turn_end
        return [*closed, *self.observation(observation)]

    def observation(self, text: str) -> list[int]:
        """A user turn after an assistant turn, ready for the assistant's next: by difference."""
        before = _ids(self.tokenizer, _PROBE, False)
        after = _ids(self.tokenizer, [*_PROBE, {"role": "user", "content": text}], True)
        if after[: len(before)] != before:
            raise ChatTemplateError(
                "the tokenizer's chat template changes earlier turns when a turn is added: a trajectory cannot be "
                "extended turn by turn with it"
            )
        return after[len(before) :]
