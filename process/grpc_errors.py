"""Exceptions to gRPC statuses at a server's edge: the one decorator of the daemon's and the
runner's servicer methods.

Each edge says how an exception becomes a status (`Failure`: its code, its cause of
pagedkv.vocab.causes and its message, and whatever logging the edge wants); this wraps every
handler so that an exception never escapes as gRPC's own UNKNOWN: the call ends with that
status and the cause in the trailing metadata `pagedkv-error` (none when the cause is ""), and
the server keeps serving.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from pagedkv.proto.metadata import ERROR_KEY

if TYPE_CHECKING:
    Context = grpc.aio.ServicerContext[Any, Any]

Servicer = TypeVar("Servicer")
Request = TypeVar("Request")
Response = TypeVar("Response")
Handler = Callable[[Servicer, Request, "Context"], Awaitable[Response]]
# (servicer, exception, RPC name) -> (code, cause, message).
Failure = Callable[[Any, Exception, str], tuple[grpc.StatusCode, str, str]]


def errors_to_status(failure: Failure) -> Callable[[Handler[Servicer, Request, Response]],
                                                   Handler[Servicer, Request, Response]]:
    """A decorator for async servicer methods: every exception becomes `failure`'s status."""

    def grpc_errors(handler: Handler[Servicer, Request, Response],
                    ) -> Handler[Servicer, Request, Response]:
        @functools.wraps(handler)
        async def wrapper(self: Servicer, request: Request, context: Context) -> Response:
            try:
                return await handler(self, request, context)
            except grpc.aio.AbortError:
                raise  # the handler aborted with a status of its own
            except Exception as exc:
                code, cause, message = failure(self, exc, handler.__name__)
                # The cause tells apart causes that share a code (unknown session vs sequence).
                await context.abort(code, message,
                                    trailing_metadata=((ERROR_KEY, cause),) if cause else ())
                raise  # abort raises; this line is never reached

        return wrapper

    return grpc_errors
