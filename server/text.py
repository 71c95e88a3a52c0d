"""The text of a completion as it is generated: incremental detokenization with OpenAI `stop`
strings, and the text of one token as logprobs show it.

A byte-level BPE token may hold part of a UTF-8 character, and a stop string may be split over
several tokens, so the text that is safe to send lags the tokens: `TextStream` holds back text
while it could still be the start of a stop string, and while the last tokens decode to an
incomplete character (U+FFFD at the end), as vLLM's `detokenize_incrementally` and transformers'
`TextStreamer` do. It decodes a window of the last tokens on each step, never the whole
completion: `prefix_offset` and `read_offset` mark it (tokens [prefix_offset, read_offset) are
the context already read, decoded again only so that the tokenizer's word-boundary rules, such
as SentencePiece's leading space, see the tokens before the new ones).
"""

from collections.abc import Sequence
from functools import cache

from pagedkv.llm.tokenizer import Tokenizer, decoder

# What a tokenizer's decode puts for bytes that are not (yet) a whole UTF-8 character.
REPLACEMENT = "\ufffd"
# How many of the prompt's last tokens are decoded as context for the first generated ones.
PROMPT_CONTEXT = 6
# SentencePiece's word-start marker: decode drops it at the start of a text.
SPACE_MARKER = "\u2581"


class TextStream:
    """The text of one completion, fed its tokens as they come.

    The texts `add` and `finish` return, concatenated, are `text`; for a completion that did
    not stop on a string they equal `tokenizer.decode(tokens, skip_special_tokens=...)` of all
    its tokens; for one that did, that text cut before the stop string's first character
    (OpenAI leaves the stop string out), or after its last with `include_stop` (vLLM's
    include_stop_str_in_output).

    `prompt_ids`: the prompt, whose last tokens are decoded as context, as vLLM does. Byte-level
    BPE does not need it; SentencePiece (Llama 2, Mistral) does: decode drops the space of a
    text's first word, so without the prompt a completion " world" after "hello" reads "world".
    With it, the text is decode(prompt + tokens) less the prompt's text."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), *,
                 skip_special_tokens: bool = True, prompt_ids: Sequence[int] = (),
                 include_stop: bool = False, min_tokens: int = 0) -> None:
        for index, string in enumerate(stop):
            if not string:
                raise ValueError(f"stop[{index}]: a stop string must not be empty")
        # The completion's tokenizer's decode (its Rust decoder's when that gives the same
        # text: two decodes a token).
        self._decode_ids = decoder(tokenizer)
        # The stop strings: the completion ends before the first of them to appear.
        self._stop = tuple(stop)
        # Whether special tokens (the end-of-sequence one) are left out of the text.
        self._skip_special_tokens = skip_special_tokens
        # Whether the stop string that ended the text stays in it.
        self._include_stop = include_stop
        # vLLM's min_tokens: no stop string ends a completion of fewer tokens (one that
        # appeared before is not looked for again, as vLLM looks only at new text).
        self._min_tokens = min_tokens
        # The prompt's last tokens, then the completion's so far (up to the one that
        # completed a stop string).
        self._ids = list(prompt_ids[-PROMPT_CONTEXT:])
        # How many of `_ids` are the prompt's.
        self._context = len(self._ids)
        # Tokens [prefix_offset, read_offset) are decoded again as context for the new ones.
        self._prefix_offset = 0
        # Tokens before read_offset are read (into `_sent` and `_held`); those after
        # decode to an incomplete character (or to nothing yet).
        self._read_offset = self._context
        # The decoded text of tokens [prefix_offset, read_offset), kept while they stay.
        self._prefix_text = self._decode(0) if self._context else ""
        # What add/finish returned: the start of the completion's text.
        self._sent: list[str] = []
        # The read text after that, held back (it could start a stop string), cut before a
        # stop string once one appeared. A stop string never begins in text already sent (it
        # was held), so only this tail is searched: a few characters, whatever the length.
        self._held = ""
        # Whether a stop string appeared: the text ends before it and takes no more tokens.
        self._stopped = False
        # Whether finish() was called: the completion is over.
        self._finished = False

    @property
    def stopped(self) -> bool:
        """Whether a stop string appeared (the server's finish_reason "stop")."""
        return self._stopped

    @property
    def num_tokens(self) -> int:
        """The tokens this completion consumed: all those added, or, once stopped, those up to
        and including the one that completed the stop string (usage.completion_tokens)."""
        return len(self._ids) - self._context

    @property
    def text(self) -> str:
        """The completion's text so far, as its non-streamed answer shows it: what add() and
        finish() returned plus what is held back, cut before a stop string once one appeared.
        After finish() or once stopped, it is the completion's final text."""
        done = self._stopped or self._finished
        return "".join(self._sent) + self._held + ("" if done else self._pending_text())

    def add(self, token_ids: Sequence[int]) -> str:
        """Takes the completion's newly generated tokens; returns the new text that is safe to
        send now ("" once stopped: the tokens after the stop string are not consumed)."""
        if self._finished:
            raise ValueError("add() after finish(): the completion is over")
        for token_id in token_ids:
            if self._stopped:
                break
            self._ids.append(token_id)
            self._read_new()
        return self._release(self._held_back())

    def finish(self) -> str:
        """The held-back text at the end of a completion that did not stop on a string: a
        prefix of a stop string that never completed, and an incomplete last character (as
        decode shows it). "" for one that stopped."""
        if not (self._stopped or self._finished):
            pending = self._pending_text()
            if pending:
                self._append(pending)
                self._prefix_offset = self._read_offset = len(self._ids)
        self._finished = True
        return self._release(0)

    def _decode(self, start: int) -> str:
        return self._decode_ids(self._ids[start:], self._skip_special_tokens)

    def _pending_text(self) -> str:
        """The text of the tokens after read_offset (it may end in an incomplete character)."""
        window = self._decode(self._prefix_offset)
        return window[len(self._prefix_text):] if len(window) > len(self._prefix_text) else ""

    def _read_new(self) -> None:
        """Reads the tokens after read_offset once they decode to whole characters; a stop
        string that ends before an incomplete last character stops the text at once."""
        window = self._decode(self._prefix_offset)
        if len(window) <= len(self._prefix_text):
            return  # nothing new yet (a special token left out, or bytes of one character)
        new_text = window[len(self._prefix_text):]
        if new_text.endswith(REPLACEMENT):
            # A character still incomplete: wait for more tokens, unless the whole ones before
            # it complete a stop string (the text ends there whatever comes next).
            self._cut_at_stop(self._held + new_text.rstrip(REPLACEMENT), len(self._held))
            return
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._prefix_offset)
        self._append(new_text)

    def _append(self, new_text: str) -> None:
        """Adds read text, cut before the earliest stop string that now appears."""
        start = len(self._held)
        self._held += new_text
        self._cut_at_stop(self._held, start)

    def _cut_at_stop(self, text: str, start: int) -> None:
        """Stops the completion at the earliest stop string in `text` (the held text, perhaps
        with more) that ends past `start`, where the text new since the last look begins."""
        if self.num_tokens < self._min_tokens:
            return
        found = [(index, index + len(string)) for string in self._stop
                 if (index := text.find(string, max(0, start - len(string) + 1))) >= 0]
        if found:
            begin, end = min(found)
            self._held = text[:end if self._include_stop else begin]
            self._stopped = True

    def _held_back(self) -> int:
        """How many characters at the end of the held text could start a stop string."""
        if self._stopped:
            return 0
        longest = 0
        for string in self._stop:
            for size in range(min(len(string) - 1, len(self._held)), longest, -1):
                if self._held.endswith(string[:size]):
                    longest = size
                    break
        return longest

    def _release(self, held_back: int) -> str:
        """Returns the held text but its last `held_back` characters."""
        end = len(self._held) - held_back
        piece, self._held = self._held[:end], self._held[end:]
        if piece:
            self._sent.append(piece)
        return piece


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """The text of one token as OpenAI logprobs show it (`tokens`, `top_logprobs` keys): its
    decoded text, special tokens included; a token whose bytes are not valid UTF-8 alone (part
    of a character) shows them escaped, "bytes:\\xe2\\x80", as OpenAI's API does (vLLM shows
    U+FFFD there, which loses the bytes). A SentencePiece word-start piece keeps its space,
    which decode drops from a lone token (as vLLM restores it)."""
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    if REPLACEMENT not in text:
        piece = _piece(tokenizer, token_id) or ""
        missing = len(piece) - len(piece.lstrip(SPACE_MARKER)) - (len(text) - len(text.lstrip(" ")))
        return " " * missing + text
    raw = token_bytes(tokenizer, token_id)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)
    return text


def token_bytes(tokenizer: Tokenizer, token_id: int) -> bytes:
    """The bytes one token stands for (chat logprobs' `bytes`): a byte-level BPE piece mapped
    back through its byte alphabet, a SentencePiece byte-fallback piece `<0xE2>` as its byte,
    else the UTF-8 of its decoded text."""
    piece = _piece(tokenizer, token_id)
    if piece is not None:
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass  # not a byte-fallback piece after all
        if _is_byte_level(tokenizer):
            alphabet = _byte_alphabet()
            if all(char in alphabet for char in piece):
                return bytes(alphabet[char] for char in piece)
    return tokenizer.decode([token_id], skip_special_tokens=False).encode()


def _piece(tokenizer: Tokenizer, token_id: int) -> str | None:
    """The token's vocabulary entry, when the tokenizer says it."""
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    piece = convert(token_id) if convert is not None else None
    return piece if isinstance(piece, str) else None


def _is_byte_level(tokenizer: Tokenizer) -> bool:
    """Whether the tokenizer decodes byte-level BPE pieces (GPT-2's byte alphabet)."""
    from tokenizers import decoders

    backend = getattr(tokenizer, "backend_tokenizer", None)
    return isinstance(getattr(backend, "decoder", None), decoders.ByteLevel)


@cache
def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character that stands for each byte, reversed."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    table: dict[int, str] = bytes_to_unicode()  # type: ignore[no-untyped-call]
    return {char: byte for byte, char in table.items()}
