"""The routes and shapes a vLLM user expects of `pagedkv serve`, without processes: the app over
an engine with a scripted runner (support/scripted_engine.py) or a stand-in that streams given
tokens, and the chat model's tokenizer (support/chat_model.py, byte-level BPE).

/version, /ping, /tokenize and /detokenize in vLLM's shapes; `model` optional with one model
served; real `created` times; no empty chat deltas while a UTF-8 character is incomplete; the
engine's error causes as HTTP statuses (PoolExhausted 400, RunnerUnavailable 503).
"""

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from types import SimpleNamespace
from typing import Any, cast

import grpc
import pytest
from aiohttp.test_utils import TestClient, TestServer
from transformers import PreTrainedTokenizerFast

from pagedkv.client import RunnerUnavailable, SamplingParams, Unsupported
from pagedkv.client.engine.engine import Engine
from pagedkv.client.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.llm.tokenizer import Tokenizer
from pagedkv.server.app import BACKEND, build_app
from pagedkv.server.backend import Backend, ServeConfig
from pagedkv.server.metrics import ServerMetrics

from chat_model import chat_tokenizer
from scripted_engine import BS, ScriptedRunner, engine

NAME = "m"


class TokensEngine:
    """Streams `tokens` one a step, the last with finish reason "length", as an engine does
    (each output with every token so far, or with `delta` only the step's); or fails with
    `failure` after them."""

    max_model_len = 64
    scheduler = SimpleNamespace(waiting=[], running=[])

    def __init__(self, tokens: Sequence[int], vocab_size: int,
                 failure: Exception | None = None) -> None:
        self.tokens = tuple(tokens)
        self.vocab_size = vocab_size
        self.failure = failure

    async def stream(self, prompt_ids: list[int], params: SamplingParams, key: str = "",
                     client_request_id: str | None = None,
                     delta: bool = False) -> AsyncGenerator[RequestOutput]:
        for count in range(1, len(self.tokens) + 1):
            last = count == len(self.tokens) and self.failure is None
            yield RequestOutput("req-0", tuple(prompt_ids), [CompletionOutput(
                0, self.tokens[count - 1 if delta else 0:count], 0.0, None, None,
                "length" if last else None)], last, len(prompt_ids), 0, count)
        if self.failure is not None:
            raise self.failure


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return chat_tokenizer()


async def client_of(engine_: object, tokenizer: Tokenizer | None = None) -> TestClient:
    backend = Backend(cast(Engine, engine_), tokenizer, "the model is a preset (no tokenizer)",
                      ServeConfig(NAME), ServerMetrics(NAME))
    client = TestClient(TestServer(build_app(backend)))
    await client.start_server()
    return client


@pytest.fixture
async def scripted() -> AsyncIterator[TestClient]:
    """The app over an engine with a scripted runner (samples token 7), no tokenizer."""
    generating = engine(ScriptedRunner(full=set()))
    client = await client_of(generating)
    yield client
    await client.close()
    await generating.close()


@pytest.fixture
async def text(tokenizer: PreTrainedTokenizerFast) -> AsyncIterator[TestClient]:
    """The app over a stand-in engine, with the chat tokenizer."""
    client = await client_of(TokensEngine([5], len(tokenizer)), cast(Tokenizer, tokenizer))
    yield client
    await client.close()


async def post(client: TestClient, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    response = await client.post(path, json=body)
    return response.status, await response.json()


async def test_version_says_pagedkvs_version(scripted: TestClient) -> None:
    response = await scripted.get("/version")
    assert (response.status, await response.json()) == (200, {"version": "0.1.0"})


async def test_ping_answers_get_and_post_as_health_does(scripted: TestClient) -> None:
    for method in ("GET", "POST"):
        response = await scripted.request(method, "/ping")
        assert (response.status, await response.text()) == (200, "ok\n")
    scripted.server.app[BACKEND].down = "the runner is restarting"
    response = await scripted.get("/ping")
    assert (response.status, await response.text()) == (
        503, "unhealthy: the runner is restarting\n")


async def test_tokenize_and_detokenize_in_vllms_shapes(
        text: TestClient, tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode("the cat sat")
    assert await post(text, "/tokenize", {"prompt": "the cat sat", "return_token_strs": True}) \
        == (200, {"count": len(ids), "max_model_len": 64, "tokens": ids,
                  "token_strs": [tokenizer.decode([i]) for i in ids]})
    chat_ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True,
                                             return_dict=False, add_generation_prompt=True)
    status, answer = await post(text, "/tokenize", {"model": NAME, "messages": [
        {"role": "user", "content": "hi"}]})
    assert (status, answer["tokens"], answer["token_strs"]) == (200, list(chat_ids), None)
    assert await post(text, "/detokenize", {"tokens": ids}) == (200, {"prompt": "the cat sat"})


async def test_tokenize_refuses_bad_input_naming_it(text: TestClient,
                                                    scripted: TestClient) -> None:
    status, answer = await post(text, "/detokenize", {"tokens": [1, 300]})
    assert (status, answer["error"]["param"]) == (400, "tokens")
    status, answer = await post(text, "/tokenize", {"prompt": 3})
    assert (status, answer["error"]["param"]) == (400, "prompt")
    status, answer = await post(text, "/tokenize", {"model": "other", "prompt": "a"})
    assert status == 404
    status, answer = await post(scripted, "/tokenize", {"prompt": "a"})
    assert status == 400
    assert "the model is a preset (no tokenizer)" in answer["error"]["message"]


async def test_model_may_be_left_out_with_one_model_served(scripted: TestClient) -> None:
    status, answer = await post(scripted, "/v1/completions", {"prompt": [1, 2, 3],
                                                              "max_tokens": 2})
    assert (status, answer["model"], answer["choices"][0]["finish_reason"]) == (
        200, NAME, "length")
    status, answer = await post(scripted, "/v1/completions", {"model": "other",
                                                              "prompt": [1], "max_tokens": 2})
    assert (status, answer["error"]["param"]) == (404, "model")


async def test_created_is_the_start_time_for_models_and_now_for_answers() -> None:
    before = int(time.time())
    generating = engine(ScriptedRunner(full=set()))
    client = await client_of(generating)
    try:
        models = await (await client.get("/v1/models")).json()
        status, answer = await post(client, "/v1/completions", {"model": NAME, "prompt": [1],
                                                                "max_tokens": 1})
    finally:
        await client.close()
        await generating.close()
    assert before <= models["data"][0]["created"] <= answer["created"] <= int(time.time())
    assert status == 200


async def test_a_chat_stream_sends_no_empty_delta_while_a_character_is_incomplete(
        tokenizer: PreTrainedTokenizerFast) -> None:
    """"é" as its two byte tokens, one a step: the first step has no text to send."""
    halves = tokenizer.convert_tokens_to_ids(["Ã", "©"])
    client = await client_of(TokensEngine(halves, len(tokenizer)), cast(Tokenizer, tokenizer))
    try:
        response = await client.post("/v1/chat/completions", json={
            "model": NAME, "messages": [{"role": "user", "content": "hi"}], "stream": True})
        body = await response.text()
    finally:
        await client.close()
    events = [line.removeprefix("data: ") for line in body.split("\n\n") if line]
    deltas = [json.loads(event)["choices"][0]["delta"] for event in events[:-1]]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "é"}]
    assert events[-1] == "[DONE]"


async def test_a_request_larger_than_the_pool_is_a_400(scripted: TestClient) -> None:
    """The engine fails it with PoolExhausted: it could never fit, so vLLM's answer, a 400."""
    status, answer = await post(scripted, "/v1/completions", {"model": NAME, "max_tokens": 1,
                                                              "prompt": [1] * 9 * BS})
    assert status == 400
    assert "needs 9 blocks; the pool has 8" in answer["error"]["message"]


async def test_a_runner_that_cannot_compute_is_a_503_to_retry() -> None:
    """The engine fails the request with RunnerUnavailable (the runner's daemon is away)."""
    away = RunnerUnavailable(grpc.StatusCode.UNAVAILABLE, "the daemon is away")
    client = await client_of(TokensEngine([], 100, away))
    try:
        response = await client.post("/v1/completions", json={"model": NAME, "prompt": [1],
                                                               "max_tokens": 1})
        assert (response.status, response.headers["Retry-After"]) == (503, "1")
        assert "the daemon is away" in (await response.json())["error"]["message"]
    finally:
        await client.close()


async def test_what_the_runner_cannot_do_is_a_400() -> None:
    """Unsupported (structured outputs on a runner with no tokenizer): the request must change,
    so a 400 with the runner's reason, as vLLM refuses what its backend cannot do."""
    refused = Unsupported(grpc.StatusCode.FAILED_PRECONDITION, "the runner has no tokenizer")
    client = await client_of(TokensEngine([], 100, refused))
    try:
        response = await client.post("/v1/completions", json={"model": NAME, "prompt": [1],
                                                               "max_tokens": 1})
        assert response.status == 400
        assert "the runner has no tokenizer" in (await response.json())["error"]["message"]
    finally:
        await client.close()
