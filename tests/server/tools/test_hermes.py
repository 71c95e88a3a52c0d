"""The hermes tool call format read from text (server/tools/hermes.py), whole and streamed in
pieces of every size: the streamed pieces add up to what the whole answer says."""

import json

import pytest

from pagedkv.server.tools.calls import Parsed, tool_calls
from pagedkv.server.tools.hermes import HermesReader

TWO_CALLS = ('Let me look.<tool_call>\n{"name": "get_weather", "arguments": '
             '{"city": "Paris", "when": {"day": "to}day"}}}\n</tool_call>\n<tool_call>\n'
             '{"arguments": {"x": 1}, "name": "add"}\n</tool_call>')


def streamed(text: str, size: int) -> Parsed:
    reader = HermesReader()
    parsed = Parsed()
    for start in range(0, len(text), size):
        parsed.add(reader.feed(text[start:start + size]))
    parsed.add(reader.finish())
    return parsed


def test_the_whole_answer_has_the_content_before_the_calls_and_each_call() -> None:
    parsed = HermesReader().parse(TWO_CALLS)
    assert parsed.content == "Let me look."
    calls = tool_calls(parsed.calls)
    assert [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris",
                                                             "when": {"day": "to}day"}}
    assert json.loads(calls[1]["function"]["arguments"]) == {"x": 1}
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in calls)
    assert calls[0]["id"] != calls[1]["id"]


@pytest.mark.parametrize("size", [1, 2, 5, 13, 1000])
def test_streamed_pieces_add_up_to_the_same_calls(size: int) -> None:
    parsed = streamed(TWO_CALLS, size)
    assert parsed.content == "Let me look."
    calls = tool_calls(parsed.calls)
    whole = tool_calls(HermesReader().parse(TWO_CALLS).calls)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole]


def test_a_call_streams_its_name_first_then_argument_pieces() -> None:
    """vLLM's delta shape: the first piece of a call carries index, id, type and the name;
    the later ones only argument text."""
    text = '<tool_call>\n{"name": "f", "arguments": {"a": "bcd"}}\n</tool_call>'
    reader = HermesReader()
    deltas = [piece.delta() for char in text for piece in reader.feed(char).calls]
    first, *rest = deltas
    assert first == {"index": 0, "id": first["id"], "type": "function",
                     "function": {"name": "f", "arguments": "{"}}  # the value has begun
    assert len(rest) > 3
    assert all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
               for d in rest)
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"a": "bcd"}'


def test_text_without_calls_is_content_and_a_partial_tag_is_held_then_released() -> None:
    reader = HermesReader()
    assert reader.feed("a <tool").content == "a "
    assert reader.feed("box").content == "<toolbox"
    assert reader.feed(" <tool_c").content == " "
    assert reader.finish().content == "<tool_c"
    assert HermesReader().parse("just text").content == "just text"


def test_a_call_without_its_closing_tag_still_counts() -> None:
    text = 'x<tool_call>{"name": "f", "arguments": {}}'
    assert [c["function"]["name"] for c in tool_calls(HermesReader().parse(text).calls)] == ["f"]
    assert [c["function"]["name"] for c in tool_calls(streamed(text, 3).calls)] == ["f"]


def test_a_call_that_is_not_json_makes_the_whole_answer_content() -> None:
    text = 'a<tool_call>{"name": "f", "arguments": </tool_call>'
    parsed = HermesReader().parse(text)
    assert parsed.content == text and parsed.calls == []
