"""The model directory's tokenizer: text in, text out. Loaded locally with transformers'
AutoTokenizer (never from the hub); a folder without tokenizer files has none, and the LLM then
takes token ids only."""

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol, cast

# Files a Hugging Face tokenizer is saved as; a folder with none of them has no tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "vocab.txt")


class Tokenizer(Protocol):
    """What the LLM uses of a transformers tokenizer."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...

    def __len__(self) -> int: ...


# Token ids and skip_special_tokens in, text out: a tokenizer's decode (`decoder`).
Decode = Callable[[Sequence[int], bool], str]


def load_tokenizer(folder: Path) -> Tokenizer | None:
    """The tokenizer saved in `folder`, or None when it holds no tokenizer files; ValueError
    when the files are there but do not load."""
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError, ...
        raise ValueError(f"cannot load the tokenizer in {folder}: {exc}") from exc
    return cast(Tokenizer, tokenizer)


def decode(tokenizer: Tokenizer, token_ids: Sequence[int]) -> str:
    """The text of generated tokens, special tokens (the end-of-sequence one) left out, as
    vLLM's default skip_special_tokens=True does."""
    return tokenizer.decode(list(token_ids), skip_special_tokens=True)


def decoder(tokenizer: Tokenizer) -> Decode:
    """`tokenizer.decode`, or the same text straight from its Rust decoder when it is a
    transformers fast tokenizer whose decode returns that text unchanged: the base class's
    decode (no model-specific override) without clean_up_tokenization_spaces. The Python
    wrapper costs several times the decode itself, and a server decodes every token twice
    (server/text.py)."""
    if _decodes_as_backend(tokenizer):
        backend = tokenizer.backend_tokenizer  # type: ignore[attr-defined]
        return lambda ids, skip: cast(str, backend.decode(ids, skip_special_tokens=skip))
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


def _decodes_as_backend(tokenizer: Tokenizer) -> bool:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

    kind = type(tokenizer)
    return (isinstance(tokenizer, PreTrainedTokenizerFast)
            and kind.decode is PreTrainedTokenizerBase.decode
            and kind._decode is PreTrainedTokenizerFast._decode
            and not tokenizer.clean_up_tokenization_spaces)
