"""A request's output constraint (server/structured.py): each spelling becomes one
StructuredOutputs, two are refused, and one xgrammar cannot compile is a 400 naming its field."""

import json
from typing import Any

import pytest

from pagedkv.client.pool.structured_outputs import StructuredOutputs
from pagedkv.server.errors import ApiError
from pagedkv.server.protocol import Limits, read_chat, read_completion
from pagedkv.server.structured import check_compiles, read_constraint

from tool_model import TOOL_MODEL

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("body", "field", "expected"), [
    ({"response_format": {"type": "json_object"}}, "response_format",
     StructuredOutputs(json_object=True)),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     "response_format.json_schema.schema", StructuredOutputs(json=json.dumps(SCHEMA))),
    ({"structured_outputs": {"json": SCHEMA}}, "structured_outputs.json",
     StructuredOutputs(json=json.dumps(SCHEMA))),
    ({"structured_outputs": {"regex": "[ab]+"}}, "structured_outputs.regex",
     StructuredOutputs(regex="[ab]+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "structured_outputs.choice",
     StructuredOutputs(choice=("yes", "no"))),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "structured_outputs.grammar",
     StructuredOutputs(grammar='root ::= "a"')),
    ({"structured_outputs": {"json_object": True}}, "structured_outputs.json_object",
     StructuredOutputs(json_object=True)),
    ({"guided_json": json.dumps(SCHEMA)}, "guided_json",
     StructuredOutputs(json=json.dumps(SCHEMA))),
    ({"guided_regex": "a+"}, "guided_regex", StructuredOutputs(regex="a+")),
    ({"guided_choice": ["x"]}, "guided_choice", StructuredOutputs(choice=("x",))),
    ({"guided_grammar": 'root ::= "a"'}, "guided_grammar",
     StructuredOutputs(grammar='root ::= "a"')),
])
def test_each_spelling_is_one_constraint(body: dict[str, object], field: str,
                                         expected: StructuredOutputs) -> None:
    found = read_constraint(body)
    assert found is not None and found.outputs == expected and found.field == field
    for read, base in ((read_chat, {"model": "m", "messages": MESSAGES}),
                       (read_completion, {"model": "m", "prompt": "hi"})):
        request = read({**base, **body}, Limits())
        assert request.sampling.params.structured_outputs == expected


def test_text_and_nothing_are_no_constraint() -> None:
    assert read_constraint({"response_format": {"type": "text"}}) is None
    assert read_constraint({}) is None


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a"}, "guided_json": {}}, "guided_json"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": "a"}, "structured_outputs"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format.json_schema.name"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": 5}, "guided_regex"),
])
def test_a_bad_or_second_constraint_names_its_field(body: dict[str, object], param: str) -> None:
    with pytest.raises(ApiError) as refused:
        read_chat({"model": "m", "messages": MESSAGES, **body}, Limits())
    assert refused.value.status == 400 and refused.value.param == param


@pytest.mark.parametrize(("body", "param"), [
    ({"guided_json": {"type": "nonsense"}}, "guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$ref": "#/$defs/missing"}}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "a("}}, "structured_outputs.regex"),
    ({"guided_grammar": "rule ::= \"a\""}, "guided_grammar"),
])
async def test_a_constraint_that_cannot_compile_is_a_400_naming_it(body: dict[str, object],
                                                                  param: str) -> None:
    with pytest.raises(ApiError) as refused:
        await check_compiles(read_constraint(body))
    assert refused.value.status == 400 and refused.value.param == param
    assert refused.value.message.startswith(f"{param} cannot be compiled: ")
    assert ".cc:" not in refused.value.message  # xgrammar's source location is left out


async def test_constraints_that_compile_pass() -> None:
    for body in ({"guided_json": SCHEMA}, {"guided_regex": "[0-9]{3}"},
                 {"guided_grammar": 'root ::= "a" | "b"'}, {"guided_choice": ["a"]},
                 {"response_format": {"type": "json_object"}}):
        await check_compiles(read_constraint(body))


def test_min_tokens_reaches_the_sampling_params() -> None:
    chat = read_chat({"model": "m", "messages": MESSAGES, "min_tokens": 3, "max_tokens": 5},
                     Limits())
    assert chat.sampling.params.min_tokens == 3
    with pytest.raises(ApiError) as refused:
        read_completion({"model": "m", "prompt": "hi", "min_tokens": 20}, Limits())
    assert refused.value.param == "min_tokens"


BOUNDED = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                            "color": {"enum": ["red", "green"]}},
           "required": ["ok", "color"], "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_json_schema_output_parses_and_validates(tool_client: Any, stream: bool) -> None:
    """Through the real openai client and `pagedkv serve` (tests/server/conftest.py): the
    runner masks the logits to the schema, so even a random model's greedy answer is valid."""
    options: Any = {"model": TOOL_MODEL, "messages": MESSAGES, "max_tokens": 48,
                    "temperature": 0, "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "answer", "schema": BOUNDED, "strict": True}}}
    if stream:
        chunks = tool_client.chat.completions.create(**options, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        text = tool_client.chat.completions.create(**options).choices[0].message.content
    answer = json.loads(text)
    assert set(answer) == {"ok", "color"} and isinstance(answer["ok"], bool)
    assert answer["color"] in ("red", "green")


def test_a_schema_that_cannot_compile_is_a_400_through_the_server(tool_client: Any) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as refused:
        tool_client.completions.create(model=TOOL_MODEL, prompt="hi", max_tokens=2,
                                       extra_body={"guided_json": {"type": "nonsense"}})
    assert refused.value.param == "guided_json"
