"""One gRPC server interceptor: bearer-token auth on TCP, a log line and metrics per RPC.

Auth: a call that arrives over TCP must carry `authorization: Bearer <token>`; a call over a
unix socket needs none, because the socket file's owner, group and mode already decide who
may connect. Health checks (grpc.health.v1) are exempt so that load balancers and
`grpc_health_probe` work without the secret; they reveal only SERVING or NOT_SERVING.
Reflection is not exempt: `grpcurl -H 'authorization: Bearer ...'` lists the services.

Every handler kind is wrapped (unary or streamed requests and responses, generators or
context.write), so a new RPC can never slip past the check. Session ids are credentials and
never logged: a log line names the session by its number (`session=#7`), which GetStats
shows as `client_name#7`.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Any, TypeAlias

import grpc

from pagedkv.process.log_setup import get_logger

from .metrics import RpcMetrics

# Services any peer may call without a token.
UNAUTHENTICATED_SERVICES = frozenset({"grpc.health.v1.Health"})
# "{pool_id}-{number}-{secret}" (see sessions.py): only the number is safe to log.
_SESSION_NUMBER = re.compile(r"-([0-9]+)-[0-9a-f]+$")

_log = get_logger(__name__)

if TYPE_CHECKING:
    # Generic in the stubs only: at run time these grpc classes take no type arguments.
    Handler: TypeAlias = grpc.RpcMethodHandler[Any, Any]
    Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]
    # What runs around one call, given its request and context.
    CallScope: TypeAlias = Callable[[Any, Context], AbstractAsyncContextManager[None]]

# A handler's behavior: (request or request iterator, context) -> response or async generator.
# The stubs type behaviors with the sync context; the aio server passes its own.
Behavior = Callable[..., Any]


def session_label(request: object) -> str | None:
    """"#<number>" for a request naming a session, "invalid" for a malformed id, else None."""
    session_id = getattr(request, "session_id", None)
    if not isinstance(session_id, str) or not session_id:
        return None
    match = _SESSION_NUMBER.search(session_id)
    return f"#{match.group(1)}" if match else "invalid"


def single_authorization(metadata: Iterable[tuple[str, str | bytes]]) -> bytes | None:
    """The call's one `authorization` value; None when it carries none, or more than one (which
    of several counts must not depend on their order: such a call is refused)."""
    values = [value for key, value in metadata if key == "authorization"]
    if len(values) != 1:
        return None
    return values[0].encode() if isinstance(values[0], str) else values[0]


def is_unix_peer(peer: str) -> bool:
    """grpc names unix-socket peers "unix:..." or "unix-abstract:...", TCP ones "ipv4:..."."""
    return peer.startswith("unix")


class ServerInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Auth, logging and metrics around every RPC handler of the server."""

    def __init__(self, auth_token: str | None, rpc_metrics: RpcMetrics | None) -> None:
        # The expected "Bearer <token>" value, as bytes for the constant-time compare.
        self._expected = None if auth_token is None else f"Bearer {auth_token}".encode()
        self._metrics = rpc_metrics

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler:
        handler = await continuation(handler_call_details)
        if handler is None:  # unknown method: grpc answers UNIMPLEMENTED itself
            return handler
        service, _, method = handler_call_details.method.lstrip("/").rpartition("/")
        return _wrap(handler, lambda request, context: self._call(service, method, request,
                                                                  context))

    def _authorized(self, service: str, context: Context) -> bool:
        if service in UNAUTHENTICATED_SERVICES or is_unix_peer(context.peer()):
            return True
        if self._expected is None:
            # No token configured: config refuses TCP listeners then, so this is unreachable
            # unless a listener was added behind config's back. Refuse rather than trust.
            return False
        sent = single_authorization(context.invocation_metadata() or ())
        return sent is not None and hmac.compare_digest(sent, self._expected)

    @asynccontextmanager
    async def _call(
        self, service: str, method: str, request: object,
        context: Context,
    ) -> AsyncIterator[None]:
        """Runs around one call: refuse it, or time it and record its outcome."""
        start = time.perf_counter()
        session = session_label(request)
        if not self._authorized(service, context):
            self._record(service, method, session, grpc.StatusCode.UNAUTHENTICATED, start)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "TCP calls need metadata 'authorization: Bearer <token>'")
        try:
            yield
        except asyncio.CancelledError:
            self._record(service, method, session, grpc.StatusCode.CANCELLED, start)
            raise
        except Exception:
            # context.abort() sets the code before it raises; anything else is a bug (UNKNOWN).
            code = context.code()
            if code is None:
                _log.exception("rpc_failed", method=method, session=session)
            self._record(service, method, session, code or grpc.StatusCode.UNKNOWN, start)
            raise
        self._record(service, method, session, context.code() or grpc.StatusCode.OK, start)

    def _record(self, service: str, method: str, session: str | None,
                code: grpc.StatusCode, start: float) -> None:
        seconds = time.perf_counter() - start
        if self._metrics is not None:
            self._metrics.observe(service, method, code.name, seconds)
        level = _log.debug if code == grpc.StatusCode.OK else _log.warning
        level("rpc", service=service, method=method, session=session, code=code.name,
              latency_ms=round(seconds * 1000, 3))


# The four handler kinds, and the grpc factory that makes a handler of each kind.
_HANDLER_KINDS = (
    ("unary_unary", grpc.unary_unary_rpc_method_handler),
    ("unary_stream", grpc.unary_stream_rpc_method_handler),
    ("stream_unary", grpc.stream_unary_rpc_method_handler),
    ("stream_stream", grpc.stream_stream_rpc_method_handler),
)


def _wrap(handler: Handler, scope: CallScope) -> Handler:
    """The same handler with every call run inside `scope(request, context)`."""
    for kind, make in _HANDLER_KINDS:
        behavior = getattr(handler, kind)
        if behavior is not None:
            wrapped: Handler = make(_scoped(behavior, scope),
                                    request_deserializer=handler.request_deserializer,
                                    response_serializer=handler.response_serializer)
            return wrapped
    raise AssertionError(f"a method handler without a behavior: {handler}")


def _scoped(behavior: Behavior, scope: CallScope) -> Behavior:
    """`behavior` run inside `scope`, keeping its shape: grpc treats an async generator (which
    yields responses) differently from a coroutine (which returns one or calls context.write)."""
    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: Context) -> Any:
            async with scope(request, context):
                async for response in behavior(request, context):
                    yield response

        return stream

    async def call(request: Any, context: Context) -> Any:
        async with scope(request, context):
            result = behavior(request, context)
            return await result if inspect.isawaitable(result) else result

    return call
