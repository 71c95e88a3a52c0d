"""The output of a forced tool call, whose shape the constraint guarantees (request.py):

- `tool_choice: "required"`: a JSON array of `{"name": ..., "parameters": {...}}`, one item per
  call (vLLM's shape);
- a named function: the output is that function's arguments, nothing else.

Neither has content. Streaming, each call's name goes out once whole and its arguments as they
grow, as for hermes.
"""

import json

from pagedkv.server.tools.calls import CallPiece, Parsed, first_piece
from pagedkv.server.tools.json_stream import CallObject


class RequiredReader:
    """The JSON array of calls of `tool_choice: "required"` (a CallReader)."""

    def __init__(self) -> None:
        self._call: CallObject | None = None
        self._calls = 0

    def parse(self, text: str) -> Parsed:
        try:
            calls = json.loads(text)
        except ValueError:
            return Parsed(text)
        if not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
            return Parsed(text)
        return Parsed("", [first_piece(index, call["name"],
                                       json.dumps(call.get("parameters", {}), ensure_ascii=False))
                           for index, call in enumerate(calls)])

    def feed(self, text: str) -> Parsed:
        parsed = Parsed()
        while text:
            if self._call is None:  # between items: "[", ",", whitespace, or "]" at the end
                opened = text.find("{")
                if opened < 0:
                    return parsed
                self._call = CallObject(self._calls, "parameters")
                self._calls += 1
                text = text[opened:]
            parsed.calls.extend(self._call.add(text))
            if not self._call.ended:
                return parsed
            parsed.calls.extend(self._call.close())
            text = self._call.rest
            self._call = None
        return parsed

    def finish(self) -> Parsed:
        parsed = Parsed()
        if self._call is not None:
            parsed.calls.extend(self._call.close())
            self._call = None
        return parsed


class NamedReader:
    """The output of a named tool choice: the function's arguments (a CallReader)."""

    def __init__(self, name: str) -> None:
        # The function the request named.
        self._name = name
        self._started = False

    def parse(self, text: str) -> Parsed:
        return Parsed("", [first_piece(0, self._name, text)])

    def feed(self, text: str) -> Parsed:
        if not text:
            return Parsed()
        if self._started:
            return Parsed("", [CallPiece(0, text)])
        self._started = True
        return Parsed("", [first_piece(0, self._name, text)])

    def finish(self) -> Parsed:
        return Parsed()
