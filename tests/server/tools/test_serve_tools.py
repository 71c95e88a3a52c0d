"""Tool calls through the real `openai` client against `pagedkv serve` (tests/server/conftest.py).

A random model writes no `<tool_call>` of its own accord, so what is covered end to end is: the
tools, assistant calls and tool messages reaching the template (the prompt's token count equals
the template's own rendering), calls forced by a constraint ("required", a named function) read
into `tool_calls` whole and streamed, and "auto" read by the hermes parser from an output a
grammar forces into the hermes format. The parser on free text is tests/server/tools/
test_hermes.py's.
"""

import json
from pathlib import Path
from typing import Any

import openai
import pytest

from chat_model import fast_tokenizer
from tool_model import TOOL_MODEL

WEATHER: Any = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]}},
                   "required": ["city"], "additionalProperties": False}}}
CLOCK: Any = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {},
                                       "additionalProperties": False}}}
MESSAGES: Any = [{"role": "user", "content": "weather in Paris?"}]
HERMES_CALL = (r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Tokyo)"\}\}'
               r"</tool_call>")


def prompt_tokens(model_dir: Path, messages: Any, **options: Any) -> int:
    tokenizer = fast_tokenizer(model_dir)
    return len(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False,
                                             **options))


def test_tools_and_past_calls_reach_the_template(tool_client: openai.OpenAI,
                                                 tool_model_dir: Path) -> None:
    conversation: Any = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call-1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": '{"temperature": 21}'}]
    answer = tool_client.chat.completions.create(
        model=TOOL_MODEL, messages=conversation, tools=[WEATHER], tool_choice="none",
        max_tokens=2, temperature=0)
    template_messages = [*conversation[:1], {**conversation[1], "content": "", "tool_calls": [{
        "id": "call-1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}, conversation[2]]
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == prompt_tokens(
        tool_model_dir, template_messages, tools=[WEATHER], add_generation_prompt=True)
    assert answer.choices[0].message.tool_calls is None


def test_template_options_reach_the_template(tool_client: openai.OpenAI,
                                             tool_model_dir: Path) -> None:
    cases: list[tuple[dict[str, Any], dict[str, Any]]] = [
        ({"chat_template_kwargs": {"be_brief": True}},
         {"be_brief": True, "add_generation_prompt": True}),
        ({"add_generation_prompt": False}, {"add_generation_prompt": False}),
        ({"add_generation_prompt": False, "continue_final_message": True},
         {"continue_final_message": True})]
    messages: Any = [*MESSAGES, {"role": "assistant", "content": "It is"}]
    for extra, options in cases:
        answer = tool_client.chat.completions.create(model=TOOL_MODEL, messages=messages,
                                                     max_tokens=1, extra_body=extra)
        assert answer.usage is not None
        assert answer.usage.prompt_tokens == prompt_tokens(tool_model_dir, messages, **options)
    with pytest.raises(openai.BadRequestError) as refused:
        tool_client.chat.completions.create(model=TOOL_MODEL, messages=messages, max_tokens=1,
                                            extra_body={"chat_template_kwargs": {"tokenize": 0}})
    assert refused.value.param == "chat_template_kwargs.tokenize"


def test_required_makes_a_call_that_matches_its_tool(tool_client: openai.OpenAI) -> None:
    answer = tool_client.chat.completions.create(
        model=TOOL_MODEL, messages=MESSAGES, tools=[WEATHER, CLOCK], tool_choice="required",
        parallel_tool_calls=False, max_tokens=64, temperature=0)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1
    call = calls[0]
    assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
    allowed = {"get_weather": [{"city": "Paris"}, {"city": "Tokyo"}], "get_time": [{}]}
    assert json.loads(call.function.arguments) in allowed[call.function.name]


def test_streamed_calls_have_vllm_s_delta_shape(tool_client: openai.OpenAI) -> None:
    """The first delta of a call carries index, id, type and the name; the later ones argument
    pieces only; the pieces add up to the whole answer's arguments."""
    options: Any = {"model": TOOL_MODEL, "messages": MESSAGES, "tools": [WEATHER],
                    "tool_choice": "required", "parallel_tool_calls": False,
                    "max_tokens": 64, "temperature": 0}
    whole = tool_client.chat.completions.create(**options)
    chunks = list(tool_client.chat.completions.create(**options, stream=True))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    first, *rest = deltas
    assert first.index == 0 and first.id is not None and first.type == "function"
    assert first.function is not None and first.function.name == "get_weather"
    assert all(d.id is None and d.function is not None and d.function.name is None
               for d in rest)
    arguments = "".join((d.function.arguments or "") for d in deltas if d.function)
    expected = whole.choices[0].message.tool_calls
    assert expected is not None and json.loads(arguments) == json.loads(
        expected[0].function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_named_function_is_called_with_its_parameters(tool_client: openai.OpenAI) -> None:
    answer = tool_client.chat.completions.create(
        model=TOOL_MODEL, messages=MESSAGES, tools=[CLOCK, WEATHER], max_tokens=64,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0)
    choice = answer.choices[0]
    calls = choice.message.tool_calls
    assert calls is not None and [c.function.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].function.arguments)["city"] in ("Paris", "Tokyo")
    assert choice.finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_hermes_calls(tool_client: openai.OpenAI, stream: bool) -> None:
    """A regex forces the output into the hermes format: the parser makes it a call."""
    options: Any = {"model": TOOL_MODEL, "messages": MESSAGES, "tools": [WEATHER],
                    "max_tokens": 64, "temperature": 0,
                    "extra_body": {"structured_outputs": {"regex": HERMES_CALL}}}
    if not stream:
        choice = tool_client.chat.completions.create(**options).choices[0]
        calls = choice.message.tool_calls
        assert calls is not None and choice.message.content is None
        names, arguments = [c.function.name for c in calls], calls[0].function.arguments
        reason = choice.finish_reason
    else:
        chunks = list(tool_client.chat.completions.create(**options, stream=True))
        deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
        assert not "".join(c.choices[0].delta.content or "" for c in chunks)
        names = [d.function.name for d in deltas if d.function and d.function.name]
        arguments = "".join(d.function.arguments or "" for d in deltas if d.function)
        reason = chunks[-1].choices[0].finish_reason
    assert names == ["get_weather"] and reason == "tool_calls"
    assert json.loads(arguments)["city"] in ("Paris", "Tokyo")
