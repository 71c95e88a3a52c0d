"""The server's streams when the engine fails mid-stream, without processes: the app over a
stand-in engine whose request fails after its first step. The headers (200) are sent by then, so
the failure must reach the client as OpenAI's error event (the `openai` package raises it), then
`data: [DONE]`, never as a second response written into the body.
"""

import json
from typing import Any, cast

from aiohttp import ClientTimeout
from aiohttp.test_utils import TestClient, TestServer

from pagedkv.client.engine.engine import Engine
from pagedkv.server.app import build_app
from pagedkv.server.backend import Backend, ServeConfig
from pagedkv.server.metrics import ServerMetrics

from failing_engine import FailingEngine


async def events(path: str, body: dict[str, Any]) -> list[str]:
    backend = Backend(cast(Engine, FailingEngine()), None, "a preset", ServeConfig("m"),
                      ServerMetrics("m"))
    async with TestClient(TestServer(build_app(backend))) as client:
        response = await client.post(path, json=body, timeout=ClientTimeout(total=10))
        assert response.status == 200
        text = await response.text()
    return [line.removeprefix("data: ") for line in text.split("\n\n") if line]


async def test_a_failure_mid_stream_ends_it_with_an_error_event() -> None:
    sent = await events("/v1/completions", {"model": "m", "prompt": [1, 2], "stream": True,
                                            "max_tokens": 8})
    assert json.loads(sent[0])["choices"][0]["finish_reason"] is None
    error = json.loads(sent[-2])["error"]
    assert error["code"] == 500 and "the runner is gone" in error["message"]
    assert sent[-1] == "[DONE]"
