"""The daemon's or the server's log as JSON lines, read back by event name (`log_lines` fixture,
tests/conftest.py)."""

import io
import json


def events(stream: io.StringIO, name: str) -> list[dict[str, object]]:
    """Every line of `stream` whose event is `name`, parsed."""
    return [line for line in map(json.loads, stream.getvalue().splitlines())
            if line["event"] == name]
