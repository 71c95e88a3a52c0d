"""The outputs of forced tool calls (server/tools/forced.py): "required"'s JSON array of calls
and a named function's arguments, whole and streamed."""

import json

import pytest

from pagedkv.server.tools.calls import Parsed, tool_calls
from pagedkv.server.tools.forced import NamedReader, RequiredReader
from pagedkv.server.tools.json_stream import JsonScan

ARRAY = ('[{"name": "a", "parameters": {"x": [1, {"y": "]}"}]}}, '
         '{"name": "b", "parameters": {}}]')


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_required_streams_the_calls_the_whole_answer_has(size: int) -> None:
    reader = RequiredReader()
    parsed = Parsed()
    for start in range(0, len(ARRAY), size):
        parsed.add(reader.feed(ARRAY[start:start + size]))
    parsed.add(reader.finish())
    calls = tool_calls(parsed.calls)
    whole = tool_calls(RequiredReader().parse(ARRAY).calls)
    expected = [("a", {"x": [1, {"y": "]}"}]}), ("b", {})]
    for found in (calls, whole):
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in found] == expected
    assert parsed.content == ""


def test_required_output_that_is_not_an_array_of_calls_is_content() -> None:
    for text in ('[{"name": "a", "para', '{"name": "a"}', "[1]"):
        parsed = RequiredReader().parse(text)
        assert parsed.content == text and parsed.calls == []


def test_a_named_function_s_output_is_its_arguments() -> None:
    reader = NamedReader("get_weather")
    pieces = [*reader.feed('{"city": ').calls, *reader.feed('"Paris"}').calls]
    calls = tool_calls(pieces)
    assert calls == [{"id": calls[0]["id"], "type": "function",
                      "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    assert pieces[1].delta() == {"index": 0, "function": {"arguments": '"Paris"}'}}
    assert tool_calls(NamedReader("f").parse("{}").calls)[0]["function"] == {
        "name": "f", "arguments": "{}"}


def test_the_scan_finds_the_end_of_a_value_fed_in_pieces() -> None:
    scan = JsonScan()
    assert scan.feed('{"a": "}\\"') is None
    assert scan.feed('", "b": [1]') is None
    assert scan.feed("} trailing") == len('{"a": "}\\"", "b": [1]}')
