"""`Envelope`: a stream's chunk written from its once-serialized fields and its choices is, byte
for byte, the chunk `send` writes from the whole dict."""

import json
from typing import Any, cast

from aiohttp import web

from pagedkv.server.sse import Envelope, send

FIELDS = {"id": "cmpl-r\u00e9q \"1\"", "object": "text_completion", "created": 1700000000,
          "model": "m/\u6a21\u578b"}
CHOICES: list[list[dict[str, Any]]] = [
    [{"index": 0, "text": " the", "logprobs": None, "finish_reason": None, "stop_reason": None}],
    [{"index": 3, "text": "\u00e9\n\"\\</", "logprobs": {"tokens": ["a"], "token_logprobs": [-0.5]},
      "finish_reason": "length", "stop_reason": None}, {"index": 4, "delta": {}}],
    [],
]


class Written:
    """What a response's writes carried."""

    def __init__(self) -> None:
        self.data: list[bytes] = []

    async def write(self, data: bytes) -> None:
        self.data.append(data)


async def test_an_envelope_writes_the_bytes_of_the_whole_chunk() -> None:
    envelope, by_envelope, by_send = Envelope(FIELDS), Written(), Written()
    for choices in CHOICES:
        await envelope.send(cast(web.StreamResponse, by_envelope), choices)
        await send(cast(web.StreamResponse, by_send), {**FIELDS, "choices": choices})
    assert by_envelope.data == by_send.data
    assert json.loads(by_envelope.data[1].removeprefix(b"data: "))["choices"] == CHOICES[1]
