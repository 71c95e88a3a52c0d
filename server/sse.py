"""Server-sent events as OpenAI streams them: `data: {json}` per chunk, `data: [DONE]` last.

A client that goes away makes the next write fail (ConnectionResetError, or the handler is
cancelled): the error propagates to the handler, whose request streams close and so abort their
requests in the engine.
"""

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from pagedkv.process.log_setup import get_logger
from pagedkv.server.errors import ApiError

log = get_logger("pagedkv.server")


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


@contextlib.asynccontextmanager
async def errors_as_event(response: web.StreamResponse) -> AsyncIterator[None]:
    """A failure once the headers (200) are sent ends the stream with OpenAI's error event and
    `data: [DONE]`, as vLLM ends it: the `openai` client raises it, instead of waiting for an
    end that would never come. A client gone (OSError) is not written to."""
    try:
        yield
    except OSError:
        raise
    except Exception as exc:
        if not isinstance(exc, ApiError):
            log.exception("stream_failed")
            exc = ApiError(500, f"internal error: {type(exc).__name__}: {exc}")
        await send(response, exc.body())
        await done(response)
