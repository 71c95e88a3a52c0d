"""A chat request's tools and tool_choice (server/tools/request.py): what the template sees,
which constraint forces a call, and every bad field refused by name."""

import json

import pytest

from pagedkv.client.pool.structured_outputs import StructuredOutputs
from pagedkv.server.errors import ApiError
from pagedkv.server.protocol import Limits, read_chat
from pagedkv.server.structured import check_compiles
from pagedkv.server.tools.request import read_tools, required_schema

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"$ref": "#/$defs/City"}},
                   "required": ["city"], "$defs": {"City": {"type": "string"}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
MESSAGES = [{"role": "user", "content": "hi"}]


def test_no_tools_is_text() -> None:
    plan = read_tools({}, None)
    assert plan.tools is None and plan.choice == "none" and plan.reader() is None


def test_none_shows_the_tools_to_the_template_and_reads_no_calls() -> None:
    plan = read_tools({"tools": [WEATHER], "tool_choice": "none"}, None)
    assert plan.tools == [WEATHER] and plan.constraint is None and plan.reader() is None


def test_auto_is_the_default_with_tools_and_needs_the_server_s_parser() -> None:
    with pytest.raises(ApiError) as refused:
        read_tools({"tools": [WEATHER]}, None)
    assert refused.value.param == "tool_choice"
    assert "--enable-auto-tool-choice and --tool-call-parser" in refused.value.message
    plan = read_tools({"tools": [WEATHER]}, "hermes")
    assert plan.choice == "auto" and plan.constraint is None and plan.reader() is not None
    assert plan.finish_reason("stop", True) == "tool_calls"
    assert plan.finish_reason("stop", False) == "stop"


def test_required_is_vllm_s_array_of_calls_with_the_defs_lifted() -> None:
    plan = read_tools({"tools": [WEATHER, CLOCK], "tool_choice": "required"}, None)
    assert plan.constraint is not None and plan.constraint.field == "tool_choice"
    schema = json.loads(plan.constraint.outputs.json or "")
    assert schema == required_schema([WEATHER["function"], CLOCK["function"]])
    assert schema["type"] == "array" and schema["minItems"] == 1
    weather, clock = schema["items"]["anyOf"]
    assert weather["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}
    assert "$defs" not in weather["properties"]["parameters"]
    assert schema["$defs"] == {"City": {"type": "string"}}
    assert clock["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert "$defs" in WEATHER["function"]["parameters"]  # the request's tool is left as sent
    assert plan.finish_reason("stop", True) == "tool_calls"
    assert plan.finish_reason("length", False) == "length"


def test_a_named_function_is_constrained_to_its_parameters() -> None:
    plan = read_tools({"tools": [WEATHER, CLOCK], "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}}, None)
    assert plan.choice == "function" and plan.name == "get_weather"
    assert plan.constraint is not None
    assert json.loads(plan.constraint.outputs.json or "") == WEATHER["function"]["parameters"]
    assert plan.finish_reason("stop", True) == "stop"  # as OpenAI answers a forced function


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": {"a": 1}}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "extra": 1}}]},
     "tools[0].function.extra"),
    ({"tools": [CLOCK, CLOCK]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [CLOCK], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [CLOCK], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True}}],
      "tool_choice": "auto"}, "tools[0].function.strict"),
])
def test_a_bad_tool_field_is_refused_by_name(body: dict[str, object], param: str) -> None:
    with pytest.raises(ApiError) as refused:
        read_tools(body, "hermes")
    assert refused.value.status == 400 and refused.value.param == param


def test_a_forced_call_and_a_response_format_are_two_constraints() -> None:
    body = {"model": "m", "messages": MESSAGES, "tools": [CLOCK], "tool_choice": "required",
            "response_format": {"type": "json_object"}}
    with pytest.raises(ApiError) as refused:
        read_chat(body, Limits())
    assert refused.value.param == "response_format"
    chat = read_chat({**body, "tool_choice": "none"}, Limits())
    assert chat.sampling.params.structured_outputs == StructuredOutputs(json_object=True)


async def test_a_tool_whose_parameters_cannot_compile_is_named() -> None:
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}
    chat = read_chat({"model": "m", "messages": MESSAGES, "tools": [CLOCK, bad],
                      "tool_choice": "none"}, Limits())
    with pytest.raises(ApiError) as refused:
        await check_compiles(*chat.tools.schemas)
    assert refused.value.param == "tools[1].function.parameters"


def test_parallel_tool_calls_false_allows_one_call() -> None:
    body = {"tools": [WEATHER, CLOCK], "tool_choice": "required", "parallel_tool_calls": False}
    plan = read_tools(body, None)
    assert plan.constraint is not None
    assert json.loads(plan.constraint.outputs.json or "")["maxItems"] == 1
    auto = read_tools({**body, "tool_choice": "auto"}, "hermes").reader()
    assert auto is not None
    text = ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "x"}}</tool_call>')
    assert [p.name for p in auto.parse(text).calls] == ["get_time"]
    with pytest.raises(ApiError) as refused:
        read_tools({**body, "parallel_tool_calls": "no"}, None)
    assert refused.value.param == "parallel_tool_calls"
