"""Domain exceptions -> gRPC status codes, at the edge of the daemon.

The block pool and the service raise `PoolError` subclasses for everything a caller got wrong;
`grpc_errors` turns them into statuses with the exception's message, and names the exception in
the trailing metadata `pagedkv-error` so clients can tell apart causes that share a code.
Anything else is a bug in pagedkv: the caller gets INTERNAL, the log gets the traceback, and
the server keeps serving.
Every raise happens before state changes, so a failed call leaves the pool as it was.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from pagedkv.daemon.core import InvalidArgument, PoolError, SequenceExists, SequenceNotFound
from pagedkv.daemon.service.holds import SessionBusy
from pagedkv.daemon.service.limits import LimitExceeded
from pagedkv.daemon.service.operations import PoolExhausted
from pagedkv.daemon.service.sessions import SessionExpired, SessionNotFound
from pagedkv.daemon.service.tenants import PermissionDenied
from pagedkv.process.log_setup import get_logger
from pagedkv.proto.metadata import ERROR_KEY

if TYPE_CHECKING:
    Context = grpc.aio.ServicerContext[Any, Any]

log = get_logger(__name__)


# First match wins: subclasses before their bases.
_CODES: tuple[tuple[type[PoolError], grpc.StatusCode], ...] = (
    (SessionNotFound, grpc.StatusCode.NOT_FOUND),
    (SequenceNotFound, grpc.StatusCode.NOT_FOUND),
    (SequenceExists, grpc.StatusCode.ALREADY_EXISTS),
    (PoolExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (LimitExceeded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (SessionExpired, grpc.StatusCode.FAILED_PRECONDITION),
    (SessionBusy, grpc.StatusCode.FAILED_PRECONDITION),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (PoolError, grpc.StatusCode.INVALID_ARGUMENT),
)


def status_of(exc: Exception) -> tuple[grpc.StatusCode, str]:
    """The status code and message a client gets for `exc`."""
    for kind, code in _CODES:
        if isinstance(exc, kind):
            return code, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); see the daemon log"


def failure_of(exc: Exception, rpc: str) -> tuple[grpc.StatusCode, str, str]:
    """(code, cause, message) of a failed call, or of one failed entry of a call that fails per
    entry (StepMany); the cause is empty for an internal error, which is logged with its
    traceback."""
    code, message = status_of(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.exception("unexpected error in an RPC", rpc=rpc)
        return code, "", message
    return code, type(exc).__name__, message


Servicer = TypeVar("Servicer")
Request = TypeVar("Request")
Response = TypeVar("Response")
Handler = Callable[[Servicer, Request, "Context"], Awaitable[Response]]


def grpc_errors(handler: Handler[Servicer, Request, Response],
                ) -> Handler[Servicer, Request, Response]:
    """Wrap an async servicer method so every exception becomes a gRPC status."""

    @functools.wraps(handler)
    async def wrapper(self: Servicer, request: Request, context: Context) -> Response:
        try:
            return await handler(self, request, context)
        except grpc.aio.AbortError:
            raise  # the handler aborted with a status of its own
        except Exception as exc:
            code, cause, message = failure_of(exc, handler.__name__)
            # The cause tells clients apart causes that share a code (unknown session vs
            # sequence).
            await context.abort(code, message,
                                trailing_metadata=((ERROR_KEY, cause),) if cause else ())

    return wrapper
