"""One tool call's JSON object, `{"name": "f", "<key>": {...}}`, read as its text arrives.

The name is sent once it is whole (when it comes first, as hermes models and the "required"
grammar write it), then the arguments value's text as it grows, up to the value's end: the
object's closing brace and what follows are never arguments. `JsonScan` finds where a JSON
object or array ends, fed piece by piece (each character is looked at once).
"""

import json
import re

from pagedkv.server.tools.calls import CallPiece, first_piece

# A JSON string's body: characters other than quote and backslash, or an escape.
_STRING = r'"((?:[^"\\]|\\.)*)"'


class JsonScan:
    """Where a JSON object or array that starts at the first character fed ends."""

    def __init__(self) -> None:
        # Open brackets not yet closed.
        self.depth = 0
        # Inside a string, and just after a backslash in one.
        self.in_string = False
        self.escaped = False
        # Characters fed so far; the value's length once it ended (None before).
        self.seen = 0
        self.end: int | None = None

    def feed(self, text: str) -> int | None:
        """Feeds the next characters; the value's length once it is whole, else None."""
        for char in text:
            if self.end is not None:
                break
            self.seen += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]" and self.depth:  # a stray closer before the value: not its end
                self.depth -= 1
                if self.depth == 0:
                    self.end = self.seen
        return self.end


class CallObject:
    """One call's object text: its name, then its arguments (the value of `key`) streamed."""

    def __init__(self, index: int, key: str) -> None:
        # The call's index among the choice's calls.
        self.index = index
        # The object's text so far, and the text fed after its end (not part of it).
        self.text = ""
        self.rest = ""
        self._object = JsonScan()
        # `{"name": "<name>", "<key>": ` at the start: the name, and where the value begins.
        self._head = re.compile(r'\s*\{\s*"name"\s*:\s*' + _STRING + r'\s*,\s*"'
                                + re.escape(key) + r'"\s*:\s*')
        self._key = key
        # Set once the first piece went out (the name known).
        self.name: str | None = None
        # Where the arguments value starts in `text`, how much of it was sent, and its end.
        self._value_start = 0
        self._sent = 0
        self._value = JsonScan()

    @property
    def ended(self) -> bool:
        """Whether the object's closing brace was read."""
        return self._object.end is not None

    def add(self, text: str) -> list[CallPiece]:
        """The pieces `text` (the object's next characters) completes; characters past the
        object's end go to `rest`."""
        if self.ended:
            self.rest += text
            return []
        end = self._object.feed(text)
        if end is not None:
            taken = end - len(self.text)
            text, self.rest = text[:taken], text[taken:]
        self.text += text
        piece = None
        if self.name is None:
            self.name = self._read_head()
            if self.name is None:
                return []
            piece = first_piece(self.index, self.name)
        value = self.text[self._value_start:]
        end = self._value.feed(value[self._value.seen:])
        more = value[self._sent:end if end is not None else len(value)]
        self._sent += len(more)
        if piece is None:
            return [CallPiece(self.index, more)] if more else []
        piece.arguments = more
        return [piece]

    def close(self) -> list[CallPiece]:
        """The rest of the call once its text is whole: its first piece when the name never
        came first, else the arguments not sent yet; [] when the text is not a call."""
        if self.name is not None:
            return []  # the value's end was seen in add(), or the text is cut: nothing to add
        try:
            call = json.loads(self.text)
        except ValueError:
            return []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return []
        self.name = call["name"]
        arguments = json.dumps(call.get(self._key, {}), ensure_ascii=False)
        return [first_piece(self.index, call["name"], arguments)]

    def _read_head(self) -> str | None:
        """The name, once the text starts `{"name": "...", "<key>": {` (or `[`): the value
        streams from there; else None (a scalar value, or another order, is sent at close)."""
        head = self._head.match(self.text)
        if head is None or self.text[head.end():head.end() + 1] not in ("{", "["):
            return None
        try:
            name = json.loads(f'"{head.group(1)}"')
        except ValueError:
            return None
        self._value_start = head.end()
        return str(name)
