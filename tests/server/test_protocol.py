"""Request bodies read into typed requests (server/protocol.py; the JSON body, app.py), without
a server process: a bad field is a 400 naming the field the client sent."""

from typing import cast

import pytest
from aiohttp.test_utils import TestClient, TestServer

from pagedkv.client.engine.engine import Engine
from pagedkv.server.app import build_app
from pagedkv.server.backend import Backend, ServeConfig
from pagedkv.server.errors import ApiError
from pagedkv.server.metrics import ServerMetrics
from pagedkv.server.protocol import Limits, read_chat, read_completion

from failing_engine import FailingEngine

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("value", [0, "8", 1.5])
def test_a_bad_max_completion_tokens_names_that_field(value: object) -> None:
    with pytest.raises(ApiError) as refused:
        read_chat({"model": "m", "messages": MESSAGES, "max_completion_tokens": value},
                  Limits(max_model_len=64))
    assert refused.value.status == 400 and refused.value.param == "max_completion_tokens"
    assert refused.value.message.startswith("max_completion_tokens")


def test_max_completion_tokens_null_leaves_max_tokens() -> None:
    chat = read_chat({"model": "m", "messages": MESSAGES, "max_tokens": 5,
                      "max_completion_tokens": None}, Limits(max_model_len=64))
    assert chat.sampling.params.max_tokens == 5 and chat.sampling.max_tokens_given


async def test_json_nested_too_deep_is_a_400() -> None:
    """A small body of nested lists makes json.loads recurse too deep: a bad body (400), not
    the server's fault (500)."""
    backend = Backend(cast(Engine, FailingEngine()), None, "a preset", ServeConfig("m"),
                      ServerMetrics("m"))
    async with TestClient(TestServer(build_app(backend))) as client:
        response = await client.post("/v1/completions", data="[" * 100_000,
                                     headers={"Content-Type": "application/json"})
        assert response.status == 400
        assert "not valid JSON" in (await response.json())["error"]["message"]


def test_a_non_bool_include_usage_is_a_400() -> None:
    with pytest.raises(ApiError) as refused:
        read_chat({"model": "m", "messages": MESSAGES, "stream": True,
                   "stream_options": {"include_usage": "false"}}, Limits())
    assert refused.value.param == "stream_options.include_usage"


def test_ignore_eos_reaches_the_sampling_params() -> None:
    body = {"model": "m", "prompt": "hi", "ignore_eos": True}
    assert read_completion(body, Limits()).sampling.params.ignore_eos
    assert not read_chat({"model": "m", "messages": MESSAGES}, Limits()).sampling.params.ignore_eos
    with pytest.raises(ApiError) as refused:
        read_completion({**body, "ignore_eos": "yes"}, Limits())
    assert refused.value.param == "ignore_eos"


@pytest.mark.parametrize(("field", "value"), [
    ("functions", [{"name": "f"}]), ("function_call", "auto"), ("logit_bias", {"5": 1.0}),
    ("no_such_field", 1)])
def test_fields_not_honoured_are_refused_by_name(field: str, value: object) -> None:
    """A field that would change the answer and is not honoured is a 400 naming it, on both
    endpoints, instead of a 200 with free text."""
    for read, body in ((read_chat, {"model": "m", "messages": MESSAGES}),
                       (read_completion, {"model": "m", "prompt": "hi"})):
        with pytest.raises(ApiError) as refused:
            read({**body, field: value}, Limits())
        assert refused.value.status == 400 and refused.value.param == field


def test_values_of_those_fields_that_change_nothing_are_accepted() -> None:
    body = {"model": "m", "messages": MESSAGES, "response_format": {"type": "text"},
            "tool_choice": "none", "tools": [], "functions": None, "function_call": "none"}
    assert read_chat(body, Limits()).messages == MESSAGES
