"""The field walk: every field of OpenAI's completion and chat request schemas (read from the
installed `openai` package, so a new field fails here until it is placed) and of vLLM's extras,
sent with a non-default value through the real `openai` client to a real `pagedkv serve`: each
is honoured (an observable effect here, or in the test named in COVERED, or a documented inert
label) or refused with a 400 whose `param` names it."""

from collections.abc import Callable
from typing import Any

import openai
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from pagedkv.server.fields import CHAT, COMPLETION, HONOURED, INERT_STRINGS

from tool_model import TOOL_MODEL

# vLLM's extra fields (vllm/entrypoints/openai/protocol.py, CompletionRequest and
# ChatCompletionRequest: their sampling-params and extra-params blocks).
VLLM_BOTH = ["use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty",
             "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens",
             "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
             "allowed_token_ids", "prompt_logprobs", "bad_words", "add_special_tokens",
             "response_format", "structured_outputs", "guided_json", "guided_regex",
             "guided_choice", "guided_grammar", "guided_decoding_backend",
             "guided_whitespace_pattern", "priority", "request_id", "logits_processors",
             "return_tokens_as_token_ids", "return_token_ids", "cache_salt",
             "kv_transfer_params", "vllm_xargs", "structural_tag", "mm_processor_kwargs",
             "media_io_kwargs"]
VLLM_EXTRAS = {COMPLETION: [*VLLM_BOTH, "prompt_embeds"],
               CHAT: [*VLLM_BOTH, "best_of", "echo", "add_generation_prompt",
                      "continue_final_message", "documents", "chat_template",
                      "chat_template_kwargs", "include_reasoning"]}
SCHEMAS = {COMPLETION: completion_create_params.CompletionCreateParamsStreaming,
           CHAT: chat_create_params.CompletionCreateParamsStreaming}
TOOL: Any = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}
# A non-default value of each field.
VALUES: dict[str, Any] = {
    "model": TOOL_MODEL, "prompt": "a dog ran", "messages": [{"role": "user", "content": "x"}],
    "best_of": 2, "echo": True, "frequency_penalty": 1.5, "logit_bias": {"5": 10},
    "logprobs": 2, "max_tokens": 2, "n": 2, "presence_penalty": 1.5, "seed": 7,
    "stop": ["e"], "stream": True, "stream_options": {"include_usage": True}, "suffix": "end",
    "temperature": 1.5, "top_p": 0.5, "user": "someone", "audio": {"voice": "alloy"},
    "function_call": "auto", "functions": [TOOL["function"]], "max_completion_tokens": 2,
    "metadata": {"a": "b"}, "modalities": ["text", "audio"], "moderation": {"a": 1},
    "parallel_tool_calls": False, "prediction": {"type": "content", "content": "x"},
    "prompt_cache_key": "k", "prompt_cache_options": {"a": 1},
    "prompt_cache_retention": "24h", "reasoning_effort": "high",
    "response_format": {"type": "json_object"}, "safety_identifier": "s",
    "service_tier": "flex", "store": True, "tool_choice": "required", "tools": [TOOL],
    "top_logprobs": 2, "verbosity": "low", "web_search_options": {},
    "use_beam_search": True, "top_k": 1, "min_p": 0.5, "repetition_penalty": 1.5,
    "length_penalty": 0.5, "stop_token_ids": [0], "include_stop_str_in_output": True,
    "ignore_eos": True, "min_tokens": 1, "skip_special_tokens": False,
    "spaces_between_special_tokens": False, "truncate_prompt_tokens": 2,
    "allowed_token_ids": [1, 2], "prompt_logprobs": 1, "bad_words": ["x"],
    "add_special_tokens": "flip", "structured_outputs": {"choice": ["yes", "no"]},
    "guided_json": {"type": "object"}, "guided_regex": "[ab]{2}", "guided_choice": ["a"],
    "guided_grammar": 'root ::= "a"', "guided_decoding_backend": "outlines",
    "guided_whitespace_pattern": " ", "priority": 1, "request_id": "r",
    "logits_processors": ["m.P"], "return_tokens_as_token_ids": True,
    "return_token_ids": True, "cache_salt": "salt", "kv_transfer_params": {"a": 1},
    "vllm_xargs": {"a": 1}, "structural_tag": "{}", "mm_processor_kwargs": {"a": 1},
    "media_io_kwargs": {"a": 1}, "prompt_embeds": "AAAA", "add_generation_prompt": False,
    "continue_final_message": True, "documents": [{"title": "t", "text": "x"}],
    "chat_template": "{{ messages }}", "chat_template_kwargs": {"be_brief": True},
    "include_reasoning": False}
# Honoured fields whose effect another test shows (tests/server/...), or the baseline's own.
COVERED = {
    "model": "the baseline names it", "prompt": "the baseline's", "messages": "the baseline's",
    "stream": "test_openai.py::test_streamed_text_equals_the_whole_answer",
    "stream_options": "test_openai.py::test_streamed_text_equals_the_whole_answer",
    "seed": "test_openai.py (seeded sampling)", "temperature": "test_openai.py",
    "top_p": "test_openai.py", "top_k": "test_openai.py", "min_p": "test_openai.py",
    "frequency_penalty": "test_openai.py", "presence_penalty": "test_openai.py",
    "repetition_penalty": "test_openai.py", "length_penalty": "test_openai.py (beams)",
    "use_beam_search": "test_openai.py (beams)", "best_of": "test_openai.py",
    "ignore_eos": "test_openai.py::test_ignore_eos_runs_every_choice_to_max_tokens",
    "stop_token_ids": "test_openai.py", "min_tokens": "test_structured.py::min_tokens",
    "tools": "tools/test_serve_tools.py", "tool_choice": "tools/test_serve_tools.py",
    "parallel_tool_calls": "tools/test_serve_tools.py (one call)",
    "add_generation_prompt": "tools/test_serve_tools.py::test_template_options_reach_*",
    "continue_final_message": "tools/test_serve_tools.py::test_template_options_reach_*",
    "chat_template_kwargs": "tools/test_serve_tools.py::test_template_options_reach_*",
    "include_stop_str_in_output": "checked below", "skip_special_tokens": "checked below",
    "return_token_ids": "checked below", "echo": "checked below",
}
Check = Callable[[dict[str, Any]], bool]
# Effects seen in the answer itself.
EFFECTS: dict[str, Check] = {
    "max_tokens": lambda a: a["usage"]["completion_tokens"] == 2,
    "max_completion_tokens": lambda a: a["usage"]["completion_tokens"] == 2,
    "n": lambda a: len(a["choices"]) == 2,
    "logprobs": lambda a: a["choices"][0]["logprobs"] is not None,
    "top_logprobs": lambda a: len(a["choices"][0]["logprobs"]["content"][0]["top_logprobs"])
    == 2,
    "stop": lambda a: "e" not in _text(a),
    "response_format": lambda a: _text(a).startswith("{"),
    "structured_outputs": lambda a: _text(a) in ("yes", "no"),
    "guided_json": lambda a: _text(a).startswith("{"),
    "guided_regex": lambda a: _text(a) in ("aa", "ab", "ba", "bb"),
    "guided_choice": lambda a: _text(a) == "a",
    "guided_grammar": lambda a: _text(a) == "a",
}
# Fields that must come with others to mean something.
WITH = {"top_logprobs": {"logprobs": True}, "stream_options": {"stream": True},
        "continue_final_message": {"add_generation_prompt": False,
                                   "messages": [{"role": "user", "content": "x"},
                                                {"role": "assistant", "content": "a"}]},
        "use_beam_search": {"temperature": 0}, "min_tokens": {"max_tokens": 4},
        "tool_choice": {"tools": [TOOL]}, "parallel_tool_calls": {"tools": [TOOL],
                                                                   "tool_choice": "required"}}


def _text(answer: dict[str, Any]) -> str:
    choice = answer["choices"][0]
    return str(choice["text"] if "text" in choice else choice["message"]["content"])


def _fields(endpoint: str) -> list[str]:
    schema = SCHEMAS[endpoint]
    return sorted(set(schema.__required_keys__ | schema.__optional_keys__)
                  | set(VLLM_EXTRAS[endpoint]))


def _send(client: openai.OpenAI, endpoint: str, body: dict[str, Any]) -> Any:
    path = "/completions" if endpoint == COMPLETION else "/chat/completions"
    if body.get("stream"):
        chunks = client.post(path, body=body, cast_to=object, stream=True,
                             stream_cls=openai.Stream[object])
        return {"streamed": list(chunks)}
    return client.post(path, body=body, cast_to=object)


@pytest.mark.parametrize("endpoint", [COMPLETION, CHAT])
def test_every_field_is_honoured_or_refused_by_name(tool_client: openai.OpenAI,
                                                    endpoint: str) -> None:
    base: dict[str, Any] = {"model": TOOL_MODEL, "max_tokens": 8, "temperature": 0}
    base |= {"prompt": "a dog ran"} if endpoint == COMPLETION else {
        "messages": [{"role": "user", "content": "a dog ran"}]}
    unplaced = [f for f in _fields(endpoint) if f not in VALUES]
    assert not unplaced, f"fields with no value in this walk (new in openai?): {unplaced}"
    for field in _fields(endpoint):
        value = VALUES[field]
        if field == "add_special_tokens":
            value = endpoint == CHAT  # the value opposite to the endpoint's default
        if field == "logprobs" and endpoint == CHAT:
            value = True  # chat's logprobs is a flag
        body = {**base, **WITH.get(field, {}), field: value}
        if field in HONOURED[endpoint]:
            answer = _send(tool_client, endpoint, body)
            if field in EFFECTS:
                assert EFFECTS[field](answer), (field, answer)
            else:
                assert field in COVERED or field in INERT_STRINGS, field
        else:
            with pytest.raises(openai.BadRequestError) as refused:
                _send(tool_client, endpoint, body)
            assert refused.value.param == field, (field, refused.value.message)


def test_the_cheap_text_fields_have_their_effect(tool_client: openai.OpenAI) -> None:
    """include_stop_str_in_output keeps the stop string; skip_special_tokens false shows the
    end-of-sequence token; echo repeats the prompt; return_token_ids returns the ids."""
    plain = tool_client.completions.create(model=TOOL_MODEL, prompt="a dog ran",
                                           max_tokens=8, temperature=0)
    text = plain.choices[0].text
    stop = text[2:4]
    cut = tool_client.completions.create(model=TOOL_MODEL, prompt="a dog ran", max_tokens=8,
                                         temperature=0, stop=[stop])
    kept = tool_client.completions.create(model=TOOL_MODEL, prompt="a dog ran", max_tokens=8,
                                          temperature=0, stop=[stop],
                                          extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == cut.choices[0].text + stop
    special = tool_client.completions.create(model=TOOL_MODEL, prompt="a dog ran",
                                             max_tokens=8, temperature=0,
                                             extra_body={"skip_special_tokens": False})
    if plain.choices[0].finish_reason == "stop":  # the model's <eos> ended it
        assert special.choices[0].text == text + "<eos>"
    echo = tool_client.completions.create(model=TOOL_MODEL, prompt="a dog ran", max_tokens=2,
                                          temperature=0, echo=True)
    assert echo.choices[0].text.startswith("a dog ran")
    ids = tool_client.post("/completions", cast_to=object, body={
        "model": TOOL_MODEL, "prompt": "a dog ran", "max_tokens": 2, "return_token_ids": True})
    assert len(ids["choices"][0]["token_ids"]) == 2  # type: ignore[index]
