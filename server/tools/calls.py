"""Tool calls as the chat answer carries them, whole or as stream deltas, in vLLM's shapes.

    reader.feed(text) -> Parsed        # streaming: content text and call pieces, as they come
    reader.finish()   -> Parsed        # what was held back at the end
    reader.parse(text) -> Parsed       # non-streaming: the whole output at once

A call streams as pieces: its first carries `index`, `id` (`chatcmpl-tool-...`), `type` and
`function.name` (and whatever arguments text is known), the later ones `function.arguments`
pieces only; concatenated, the pieces' arguments are the call's arguments (JSON text).
"""

import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol


def call_id() -> str:
    """A new tool call id, as vLLM makes them."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(slots=True)
class CallPiece:
    """A piece of one tool call: the first names it, the others add to its arguments."""

    # The call's place among the choice's calls (0, 1, ...).
    index: int
    # Its arguments' next characters (JSON text).
    arguments: str = ""
    # The call's id and function name: set on its first piece only.
    id: str | None = None
    name: str | None = None

    def delta(self) -> dict[str, Any]:
        """The piece as an element of a stream delta's `tool_calls`."""
        function: dict[str, Any] = {}
        if self.name is not None:
            function["name"] = self.name
        if self.arguments or self.name is None:
            function["arguments"] = self.arguments
        head = {"id": self.id, "type": "function"} if self.id is not None else {}
        return {"index": self.index, **head, "function": function}


@dataclass(slots=True)
class Parsed:
    """What a reader found in some output: text for `content`, and tool call pieces."""

    content: str = ""
    calls: list[CallPiece] = field(default_factory=list)

    def add(self, other: "Parsed") -> None:
        self.content += other.content
        self.calls.extend(other.calls)


class CallReader(Protocol):
    """Reads one choice's output into content and tool calls."""

    def feed(self, text: str) -> Parsed:
        """The content and call pieces `text` (the output's next text) completes."""
        ...

    def finish(self) -> Parsed:
        """What was held back, at the end of the output."""
        ...

    def parse(self, text: str) -> Parsed:
        """The whole output at once (non-streaming); no call found: all of it is content."""
        ...


def tool_calls(pieces: list[CallPiece]) -> list[dict[str, Any]]:
    """A message's `tool_calls` from the pieces of its calls."""
    calls: dict[int, dict[str, Any]] = {}
    for piece in pieces:
        call = calls.setdefault(piece.index, {"id": piece.id, "type": "function",
                                              "function": {"name": piece.name,
                                                           "arguments": ""}})
        call["function"]["arguments"] += piece.arguments
    return [calls[index] for index in sorted(calls)]


def first_piece(index: int, name: str, arguments: str = "") -> CallPiece:
    """A call's first piece: a new id, its name, and the arguments known so far."""
    return CallPiece(index, arguments, call_id(), name)


class FirstCallOnly:
    """A reader that keeps only its first call (`parallel_tool_calls: false`)."""

    def __init__(self, reader: CallReader) -> None:
        self._reader = reader

    def feed(self, text: str) -> Parsed:
        return _first_call(self._reader.feed(text))

    def finish(self) -> Parsed:
        return _first_call(self._reader.finish())

    def parse(self, text: str) -> Parsed:
        return _first_call(self._reader.parse(text))


def _first_call(parsed: Parsed) -> Parsed:
    parsed.calls = [piece for piece in parsed.calls if piece.index == 0]
    return parsed
