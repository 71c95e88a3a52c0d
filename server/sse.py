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
    await response.write(b"data: " + _json(chunk) + b"\n\n")


class Envelope:
    """What every chunk of one stream repeats before its choices (id, object, created, model),
    serialized once: a chunk then costs the JSON of its choices only, and its bytes are those
    `send` writes for {**fields, "choices": choices}."""

    def __init__(self, fields: dict[str, Any]) -> None:
        # `data: {...,"choices":`, from the JSON of the fields with empty choices less `[]}`.
        self._head = b"data: " + _json({**fields, "choices": []})[:-3]

    async def send(self, response: web.StreamResponse, choices: list[dict[str, Any]]) -> None:
        await response.write(self._head + _json(choices) + b"}\n\n")


def _json(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


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
