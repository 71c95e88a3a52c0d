"""The access log and request ids, without processes: the app over an engine whose scripted
runner samples token 7 every step (support/scripted_engine.py), with the chat model's tokenizer
(support/chat_model.py).

A client's X-Request-Id names the request, its answer and its log line; a made-up or malformed
one is replaced by a new id; every response (refusals and streams included) echoes the id; the
`http_request` line carries the usage, the finish reasons, the time to first token and a
refusal's reason.
"""

import io
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest
from aiohttp.test_utils import TestClient, TestServer

from pagedkv.llm.tokenizer import Tokenizer
from pagedkv.server.access_log import request_id
from pagedkv.server.app import build_app
from pagedkv.server.backend import Backend, ServeConfig
from pagedkv.server.metrics import ServerMetrics
from pagedkv.vocab.request_ids import MAX_REQUEST_ID_CHARS

from chat_model import chat_tokenizer
from log_capture import events
from scripted_engine import ScriptedRunner, engine

NAME = "m"
HEADER = "X-Request-Id"


@pytest.fixture
async def client() -> AsyncIterator[TestClient[Any, Any]]:
    tokenizer = chat_tokenizer()
    generating = engine(ScriptedRunner(set()), max_model_len=64, vocab_size=len(tokenizer))
    backend = Backend(generating, cast(Tokenizer, tokenizer), "", ServeConfig(NAME),
                      ServerMetrics(NAME))
    async with TestClient(TestServer(build_app(backend))) as test_client:
        yield test_client
    await generating.close()


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": NAME, "prompt": [1, 2, 3], "max_tokens": 4, **fields}


@pytest.mark.parametrize("given", ["job-17", "a" * MAX_REQUEST_ID_CHARS,
                                   "3f2a0c1e-1b7d-4c49-9a35-0e0b6f1d2c3a", "x.y:z_0"])
def test_a_plausible_client_id_is_kept(given: str) -> None:
    assert request_id(given) == given


@pytest.mark.parametrize("given", [None, "", "a" * (MAX_REQUEST_ID_CHARS + 1), "a b",
                                   'x" status=200', "id\nforged=1", "é"])
def test_any_other_is_replaced_by_a_new_id(given: str | None) -> None:
    made = request_id(given)
    assert made != given and len(made) == 32 and made == made.strip()
    assert request_id(given) != made  # each request its own


async def test_the_client_id_names_the_answer_and_the_log_line(
        client: TestClient[Any, Any], log_lines: io.StringIO) -> None:
    response = await client.post("/v1/completions", json=completion(n=2),
                                 headers={HEADER: "job-17"})
    assert response.status == 200 and response.headers[HEADER] == "job-17"
    assert (await response.json())["id"] == "cmpl-job-17"
    [line] = events(log_lines, "http_request")
    assert line["request_id"] == "job-17" and line["status"] == 200
    assert line["prompt_tokens"] == 3 and line["completion_tokens"] == 8
    assert line["finish_reasons"] == ["length", "length"] and "error" not in line
    assert 0 <= line["ttft_ms"] <= line["duration_ms"]  # arrival to the first token, in the line


async def test_a_chat_answer_is_named_by_the_request_id(
        client: TestClient[Any, Any], log_lines: io.StringIO) -> None:
    response = await client.post("/v1/chat/completions", headers={HEADER: "chat-1"}, json={
        "model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert response.status == 200 and response.headers[HEADER] == "chat-1"
    assert (await response.json())["id"] == "chatcmpl-chat-1"
    [line] = events(log_lines, "http_request")
    assert line["completion_tokens"] == 3 and line["finish_reasons"] == ["length"]


async def test_a_stream_echoes_a_made_id_and_logs_its_usage(
        client: TestClient[Any, Any], log_lines: io.StringIO) -> None:
    response = await client.post("/v1/completions", json=completion(stream=True),
                                 headers={HEADER: "not an id"})
    made = response.headers[HEADER]
    assert made != "not an id" and f'"id":"cmpl-{made}"' in await response.text()
    [line] = events(log_lines, "http_request")
    assert line["request_id"] == made and line["completion_tokens"] == 4
    assert line["finish_reasons"] == ["length"] and 0 <= line["ttft_ms"] <= line["duration_ms"]


async def test_a_refusal_logs_its_reason_and_echoes_the_id(
        client: TestClient[Any, Any], log_lines: io.StringIO) -> None:
    bad = await client.post("/v1/completions", json=completion(max_tokens=0),
                            headers={HEADER: "job-18"})
    missing = await client.get("/v1/nothing")
    assert bad.status == 400 and bad.headers[HEADER] == "job-18"
    assert missing.status == 404 and len(missing.headers[HEADER]) == 32
    first, second = events(log_lines, "http_request")
    assert first["request_id"] == "job-18" and first["status"] == 400
    assert first["error"] == (await bad.json())["error"]["message"]
    assert "max_tokens" in str(first["error"]) and "prompt_tokens" not in first
    assert "ttft_ms" not in first  # no token came
    assert second["status"] == 404 and second["error"] == "Not Found"
