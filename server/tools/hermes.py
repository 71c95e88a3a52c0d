"""The hermes tool call format (Qwen2.5, Hermes 2/3 and many others), as vLLM's `hermes` parser
reads it:

    I will look it up.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The text before the first `<tool_call>` is the message's content; each tagged JSON object is a
call (the last one may lack its closing tag: the output ended). Non-streaming, a call that is
not valid JSON makes the whole output content, with no calls, as vLLM answers it. Streaming, the
content goes out as it comes (less a tail that may be the start of a tag), and each call as
pieces: its name once whole, then its arguments' text as it grows.
"""

import json
import re

from pagedkv.server.tools.calls import CallPiece, Parsed, first_piece
from pagedkv.server.tools.json_stream import CallObject

START = "<tool_call>"
END = "</tool_call>"
_CALLS = re.compile(re.escape(START) + r"(.*?)(?:" + re.escape(END) + r"|$)", re.DOTALL)


class HermesReader:
    """One choice's output in the hermes format (a CallReader)."""

    def __init__(self) -> None:
        # Text received and not yet read (a tail that may begin a tag).
        self._pending = ""
        # The call being read, or None outside one; how many calls were opened.
        self._call: CallObject | None = None
        self._calls = 0

    def parse(self, text: str) -> Parsed:
        start = text.find(START)
        if start < 0:
            return Parsed(text)
        pieces: list[CallPiece] = []
        for index, match in enumerate(_CALLS.finditer(text, start)):
            try:
                call = json.loads(match.group(1))
            except ValueError:
                return Parsed(text)
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return Parsed(text)
            arguments = json.dumps(call.get("arguments", {}), ensure_ascii=False)
            pieces.append(first_piece(index, call["name"], arguments))
        return Parsed(text[:start], pieces)

    def feed(self, text: str) -> Parsed:
        self._pending += text
        parsed = Parsed()
        while self._pending:
            tag = END if self._call is not None else START
            found = self._pending.find(tag)
            if found < 0:
                keep = _partial_tag(self._pending, tag)
                self._read(self._pending[:len(self._pending) - keep], parsed)
                self._pending = self._pending[len(self._pending) - keep:]
                break
            self._read(self._pending[:found], parsed)
            self._pending = self._pending[found + len(tag):]
            self._toggle(parsed)
        return parsed

    def finish(self) -> Parsed:
        parsed = Parsed()
        self._read(self._pending, parsed)
        self._pending = ""
        if self._call is not None:
            self._toggle(parsed)
        return parsed

    def _read(self, text: str, parsed: Parsed) -> None:
        """Text outside a tag: content before the first call, a call's text inside one."""
        if self._call is not None:
            parsed.calls.extend(self._call.add(text))
        elif not self._calls:
            parsed.content += text

    def _toggle(self, parsed: Parsed) -> None:
        """A tag was read: a call opens, or the open one closes."""
        if self._call is None:
            self._call = CallObject(self._calls, "arguments")
            self._calls += 1
        else:
            parsed.calls.extend(self._call.close())
            self._call = None


def _partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
