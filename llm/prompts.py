"""The prompts `LLM.generate` accepts, turned into token ids before any is submitted (so one bad
prompt fails the call with nothing started):

    "text"                        one prompt, encoded by the tokenizer
    ["text", "more text"]         several
    [1, 2, 3]                     one prompt of token ids
    [[1, 2, 3], "text"]           several, either kind
"""

import operator
from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.llm.tokenizer import Tokenizer
from pagedkv.vocab.token_ids import check_vocabulary

# One prompt: text, or token ids.
Prompt = str | Sequence[int]
# What generate() takes: one prompt or a sequence of them.
Prompts = Prompt | Sequence[Prompt]


@dataclass(frozen=True, slots=True)
class EncodedPrompt:
    """A prompt ready for the engine."""

    # The prompt's text; None when it came as token ids.
    text: str | None
    token_ids: list[int]


def split_prompts(prompts: Prompts) -> list[object]:
    """The prompts one by one (each still unchecked)."""
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a str, a list of token ids, or a list of those, got "
                        f"{type(prompts).__name__}")
    if prompts and _is_token_id(prompts[0]):
        return [prompts]  # one prompt of token ids
    return list(prompts)


def encode_prompts(prompts: Prompts, tokenizer: Tokenizer | None, vocab_size: int,
                   no_tokenizer: str, max_model_len: int = 0) -> list[EncodedPrompt]:
    """Every prompt as token ids in [0, vocab_size), at most max_model_len of them (0: no
    limit); ValueError naming the first bad prompt. `no_tokenizer` says why there is no
    tokenizer, for a text prompt when there is none."""
    encoded = []
    for index, prompt in enumerate(split_prompts(prompts)):
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ValueError(f"prompt {index} is text, but {no_tokenizer}: pass token ids")
            token_ids = list(tokenizer.encode(prompt))
            if not token_ids:
                raise ValueError(f"prompt {index} ({prompt!r}) encodes to no tokens")
            encoded.append(EncodedPrompt(prompt, token_ids))
        else:
            encoded.append(EncodedPrompt(None, _token_ids(index, prompt)))
        check_vocabulary(encoded[-1].token_ids, vocab_size, f"prompt {index}:")
        if max_model_len and len(encoded[-1].token_ids) > max_model_len:
            raise ValueError(f"prompt {index} has {len(encoded[-1].token_ids)} tokens; the model "
                             f"takes at most {max_model_len} positions (max_model_len)")
    return encoded


def _is_token_id(value: object) -> bool:
    return not isinstance(value, bool | str) and hasattr(value, "__index__")


def _token_ids(index: int, prompt: object) -> list[int]:
    if not isinstance(prompt, Sequence) or not all(_is_token_id(t) for t in prompt):
        raise ValueError(f"prompt {index} must be a str or a list of int token ids, got "
                         f"{_short(prompt)}")
    if not prompt:
        raise ValueError(f"prompt {index} has no tokens")
    return [operator.index(t) for t in prompt]


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
