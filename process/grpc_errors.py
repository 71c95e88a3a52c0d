"""Exceptions to gRPC statuses at a server's edge: the one decorator of the daemon's and the
runner's servicer methods.

Each edge says how an exception becomes a status (`Failure`: its code, its cause of
pagedkv.vocab.causes and its message, and whatever logging the edge wants); this wraps every
handler so that an exception never escapes as gRPC's own UNKNOWN: the call ends with that
status and the cause in the trailing metadata `pagedkv-error` (none when the cause is ""), and
the server keeps serving.

A failed call ends by setting its status and returning nothing (grpc sends no message with a
status other than OK), never by `context.abort`: abort raises an AbortError that grpc keeps on
the call's state, and the traceback it gathers on its way out holds the handler's frames, whose
`context` holds that state. That cycle kept each refused request (its wire bytes and its parsed
arrays: 110 MiB for a 6 MB Allocate of token ids) alive until Python's cycle collector ran,
which in a daemon may be never (issue 31).
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Sequence
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


def end_with_status(context: Context, code: grpc.StatusCode, message: str,
                    trailing_metadata: Sequence[tuple[str, str]] = ()) -> None:
    """Give the call `code` and `message`; the handler then returns None (not context.abort:
    see the module docstring)."""
    context.set_code(code)
    context.set_details(message)
    if trailing_metadata:
        context.set_trailing_metadata(tuple(trailing_metadata))


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
            except Exception as exc:  # `exc` and its traceback go at the end of this block
                code, cause, message = failure(self, exc, handler.__name__)
            # The cause tells apart causes that share a code (unknown session vs sequence).
            end_with_status(context, code, message, ((ERROR_KEY, cause),) if cause else ())
            return None  # type: ignore[return-value]  # grpc sends no message with the status

        return wrapper

    return grpc_errors
