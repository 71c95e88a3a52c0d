"""Server-sent events as OpenAI streams them: `data: {json}` per chunk, `data: [DONE]` last.

A client that goes away makes the next write fail (ConnectionResetError, or the handler is
cancelled): the error propagates to the handler, whose request streams close and so abort their
requests in the engine.
"""

import json
from typing import Any

from aiohttp import web


async def open_stream(request: web.Request) -> web.StreamResponse:
    """The response, its headers sent: an event stream, never cached or buffered by a proxy."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
    await response.prepare(request)
    return response


async def send(response: web.StreamResponse, chunk: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n")


async def done(response: web.StreamResponse) -> None:
    """The end marker OpenAI's clients wait for, then the end of the body."""
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
