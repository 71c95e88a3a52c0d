"""One gRPC server interceptor: bearer-token auth on TCP, a log line and metrics per RPC.

Auth: a call that arrives over TCP must carry `authorization: Bearer <token>`, the token of
one of the daemon's tenants, and acts as that tenant; a call over a unix socket needs none,
because the socket file's owner, group and mode already decide who may connect, and acts as
the tenant listing its caller's uid when tenants list uids (the peer-credential gate names the
connection by uid, peer_gate.py; a uid no tenant lists is closed at accept there, and
PERMISSION_DENIED here, unless `unmapped_uids = "unix_tenant"`), else as the unix tenant (see
tenants.py). The runner socket has a server and an interceptor of its own (`runners`): every
call there is a runner's, and names the runner's process (the gate's pid: fence.py). The caller
is set for the call's duration (`tenants.calling_as`), where the service and the session
registry read it. Health checks (grpc.health.v1) are exempt so that load balancers and
`grpc_health_probe` work without the secret; they reveal only SERVING or NOT_SERVING.
Reflection is not exempt: `grpcurl -H 'authorization: Bearer ...'` lists the services.

Authentication comes before parsing. grpc would parse a unary request before any handler
runs, so a peer without the token could make the daemon parse whatever it sends (and a
request that does not parse would end as UNKNOWN with a traceback logged per call). The
interceptor therefore registers every handler with no request deserializer: the handler gets
the raw bytes, checks the caller, and only then parses them with the method's own
deserializer. A request that does not parse is answered INVALID_ARGUMENT, counted in the RPC
metrics like any other outcome, and logged at most once per HOSTILE_LOG_INTERVAL_S (with the
number of such requests since the last line), never with a traceback. Calls refused for want
of a token, or for an unmapped uid, are logged the same way: a peer must not be able to fill
the log. So are failed calls of authenticated and unix callers (one warning per method and
status code per interval, with the count); every outcome is still counted in the metrics.
A refused call ends with its status set and no answer (`Refused`), never through
`context.abort`, whose exception would keep the refused bytes alive in a reference cycle
(process/grpc_errors.py says how).

Admission comes before parsing too: after the auth check, a request over 64 KiB takes its wire
bytes from the daemon's request budget (`request_budget.py`, max_queued_request_bytes) and
waits there, unparsed, while the budget is full; it gives them back when the call ends. So
calls queued for the pool lock hold their wire bytes, not their parsed expansion. A request
stream's messages are admitted one by one: each holds its bytes from before it is parsed until
the handler reads the next one (StepStream answers a message before it reads the next).

Streams (KVPool.StepStream): the auth check runs once, when the stream opens, and the caller
holds for every message; the stream is one call of max_concurrent_rpcs and one outcome in the
RPC metrics when it ends. Each message a stream answers is counted too
(`pagedkv:stream_messages`, by the status code its answer carries, and its time from parse to
answer), and a failed one logged as a failed call is: a figure of daemon calls counts RPCs and
stream messages.

Every handler kind is wrapped (unary or streamed requests and responses, generators or
context.write), so a new RPC can never slip past the check. Session ids are credentials and
never logged: a log line names the session by its number (`session=#7`), which GetStats
shows as `client_name#7`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

import grpc

from pagedkv.daemon.edge.metrics import RpcMetrics
from pagedkv.daemon.edge.peer_gate import peer_credentials
from pagedkv.daemon.service.fence import RunnerProcesses
from pagedkv.daemon.service.request_budget import RequestBudget
from pagedkv.daemon.service.sessions import SESSION_ID
from pagedkv.daemon.service.tenants import Caller, Tenants, calling_as
from pagedkv.process.grpc_errors import end_with_status
from pagedkv.process.log_setup import HOSTILE_LOG_INTERVAL_S, RateLimitedLog, get_logger

# grpc.StatusCode by its number (the code a stream's answer message carries).
STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}

# Services any peer may call without a token.
UNAUTHENTICATED_SERVICES = frozenset({"grpc.health.v1.Health"})

_log = get_logger(__name__)

if TYPE_CHECKING:
    # Generic in the stubs only: at run time these grpc classes take no type arguments.
    Handler: TypeAlias = grpc.RpcMethodHandler[Any, Any]
    Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]
    # What runs around one call, given its context: auth, then timing and the outcome.
    # What runs around one call, given its context and its request's wire bytes (0 for a
    # request stream): auth, admission, then timing and the outcome.
    CallScope: TypeAlias = Callable[[Context, int], AbstractAsyncContextManager["Rpc"]]
    # Holds `nbytes` of request in the request budget for a block's duration.
    Admit: TypeAlias = Callable[[int], AbstractAsyncContextManager[None]]

# A handler's behavior: (request or request iterator, context) -> response or async generator.
# The stubs type behaviors with the sync context; the aio server passes its own.
Behavior = Callable[..., Any]
# A method's request deserializer: wire bytes -> message (None: the handler takes bytes).
Deserializer = Callable[[bytes], Any] | None


class Refused(Exception):
    """A call the interceptor answers itself, with `code` and the message, before its handler
    runs: `_scoped`'s wrapper sets that status and returns."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class MalformedRequest(Refused):
    """A request's bytes do not parse as the method's request message."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, message)


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a caller may not call (health checks excepted)."""

    # The status it gets, and the message.
    code: grpc.StatusCode
    message: str
    # The warning logged (rate-limited) about such calls.
    event: str


# A TCP call without exactly one valid token.
NO_TOKEN = Refusal(grpc.StatusCode.UNAUTHENTICATED,
                   "TCP calls need metadata 'authorization: Bearer <token>'",
                   "unauthenticated_calls")
# A unix caller the peer-credential gate did not name (only the daemon's own user can reach
# gRPC's socket in the gate's folder).
NOT_THROUGH_GATE = Refusal(grpc.StatusCode.UNAUTHENTICATED,
                           "unix callers are identified by uid through the daemon's socket",
                           "unidentified_unix_calls")


def unmapped_uid(uid: int) -> Refusal:
    """A unix caller whose uid no tenant lists, with unmapped_uids = "refuse" (the gate
    closes such connections at accept: this is the second check)."""
    return Refusal(grpc.StatusCode.PERMISSION_DENIED,
                   f"uid {uid} is in no tenant's uids, and the daemon refuses unix callers "
                   "of other uids (unmapped_uids = \"refuse\")", "unmapped_uid_calls")


class Rpc:
    """One call as the interceptor sees it: what it names, and its request once parsed."""

    def __init__(self, service: str, method: str, admit: Admit,
                 answered: Callable[[Rpc, int], None]) -> None:
        # Full service name and method name, e.g. "pagedkv.v1.KVPool", "Allocate".
        self.service = service
        self.method = method
        # "#<number>" of the session the request names, once parsed (see session_label).
        self.session: str | None = None
        # When the call started, and when its latest request was parsed (perf_counter seconds).
        self.start = time.perf_counter()
        self.parsed = self.start
        # Holds a streamed request's wire bytes in the request budget while the block runs.
        self.admit = admit
        # Records one answered message of a request stream, by the status code its answer
        # carries (google.rpc.Code numbering).
        self._answered = answered

    def answered(self, response: object) -> None:
        """A request stream's message answered: `response`'s `code` field, if any, its status."""
        code = getattr(response, "code", 0)
        self._answered(self, code if isinstance(code, int) else 0)

    def parse(self, raw: Any, deserializer: Deserializer) -> Any:
        """The request message from its wire bytes; MalformedRequest if they do not parse."""
        if deserializer is None:
            return raw
        try:
            request = deserializer(raw)
        except Exception as exc:  # protobuf raises DecodeError, and others for odd input
            raise MalformedRequest(f"the request is not a valid {self.method} message") from exc
        self.session = session_label(request)
        self.parsed = time.perf_counter()
        return request


def session_label(request: object) -> str | None:
    """"#<number>" for a request naming a session, "invalid" for a malformed id, else None."""
    session_id = getattr(request, "session_id", None)
    if not isinstance(session_id, str) or not session_id:
        return None
    match = SESSION_ID.match(session_id)  # only its number is safe to log
    return f"#{match['number']}" if match else "invalid"


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

    def __init__(self, tenants: Tenants, rpc_metrics: RpcMetrics | None,
                 gate_folders: frozenset[str], *, runners: RunnerProcesses | None = None,
                 requests: RequestBudget | None = None) -> None:
        # Who may call: each tenant's token and uids, and the tenant of unix callers.
        self._tenants = tenants
        # It serves the runner socket, whose mode alone decides who connects (runners): the
        # processes connected there, by pid (fence.py). None: the public listeners.
        self._runners = runners
        self._metrics = rpc_metrics
        # The peer-credential gate's private folders: unix peers named there carry a uid and
        # a pid.
        self._gate_folders = gate_folders
        self._malformed_log = RateLimitedLog(HOSTILE_LOG_INTERVAL_S)
        # Admits each large request before it is parsed (request_budget.py); None: no bound.
        self._requests = requests
        # One rate limit per kind of refused call (Refusal.event), and per method and code of
        # failed calls ("rpc Allocate NOT_FOUND"): a bounded set of keys.
        self._refusal_logs: dict[str, RateLimitedLog] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler:
        handler = await continuation(handler_call_details)
        if handler is None:  # unknown method: grpc answers UNIMPLEMENTED itself
            return handler
        service, _, method = handler_call_details.method.lstrip("/").rpartition("/")
        return _wrap(handler, lambda context, nbytes: self._call(service, method, context,
                                                                  nbytes))

    def _caller(self, context: Context) -> Caller | Refusal:
        """Who makes the call: a unix caller by uid or as the unix tenant, a TCP caller as the
        tenant whose token it carries; else why it is refused (no token: config refuses TCP
        listeners then, so only a listener added behind config's back gets here; refuse
        rather than trust)."""
        peer = context.peer()
        if self._runners is not None and is_unix_peer(peer):
            credentials = peer_credentials(peer, self._gate_folders)
            process = None if credentials is None else self._runners.get(credentials.pid)
            return Caller(self._tenants.unix, runner=True, process=process)
        if is_unix_peer(peer):
            return self._unix_caller(peer)
        # Exactly one authorization header: which of several counts must not depend on order.
        sent = single_authorization(context.invocation_metadata() or ())
        tenant = None if sent is None else self._tenants.for_bearer(sent)
        return NO_TOKEN if tenant is None else Caller(tenant)

    def _unix_caller(self, peer: str) -> Caller | Refusal:
        """The unix tenant, or when tenants list uids the tenant of the uid the gate gave."""
        if not self._tenants.maps_uids:
            return Caller(self._tenants.unix)
        credentials = peer_credentials(peer, self._gate_folders)
        if credentials is None:
            return NOT_THROUGH_GATE
        tenant = self._tenants.for_uid(credentials.uid)
        return unmapped_uid(credentials.uid) if tenant is None else Caller(tenant)

    @asynccontextmanager
    async def _call(self, service: str, method: str, context: Context,
                    nbytes: int) -> AsyncIterator[Rpc]:
        """Runs around one call: refuse it, or admit its `nbytes` of request to the request
        budget (waiting, unparsed, for room) and time it and record its outcome."""
        rpc = Rpc(service, method, self._admit, self._record_message)
        caller = self._caller(context)
        if isinstance(caller, Refusal) and service not in UNAUTHENTICATED_SERVICES:
            self._record(rpc, caller.code, log=False)
            limit = self._refusal_logs.setdefault(
                caller.event, RateLimitedLog(HOSTILE_LOG_INTERVAL_S))
            self._log_rarely(limit, caller.event, rpc)
            raise Refused(caller.code, caller.message)
        try:
            async with self._admit(nbytes):
                with (calling_as(caller) if isinstance(caller, Caller)
                      else contextlib.nullcontext()):
                    yield rpc
        except asyncio.CancelledError:
            self._record(rpc, grpc.StatusCode.CANCELLED)
            raise
        except MalformedRequest:
            self._record(rpc, grpc.StatusCode.INVALID_ARGUMENT, log=False)
            self._log_rarely(self._malformed_log, "malformed_requests", rpc)
            raise
        except Exception:
            # context.abort() sets the code before it raises; anything else is a bug (UNKNOWN).
            code = context.code()
            if code is None:
                _log.exception("rpc_failed", method=method, session=rpc.session)
            self._record(rpc, code or grpc.StatusCode.UNKNOWN)
            raise
        self._record(rpc, context.code() or grpc.StatusCode.OK)

    def _admit(self, nbytes: int) -> AbstractAsyncContextManager[None]:
        """`nbytes` of request held in the request budget (none: at once)."""
        if self._requests is None:
            return contextlib.nullcontext()
        return self._requests.admit(nbytes)

    @staticmethod
    def _log_rarely(limit: RateLimitedLog, event: str, rpc: Rpc) -> None:
        """A warning about `rpc` if one is due: how many such calls since the last line."""
        count = limit.event()
        if count is not None:
            _log.warning(event, service=rpc.service, method=rpc.method, count=count,
                         interval_s=HOSTILE_LOG_INTERVAL_S)

    def _record(self, rpc: Rpc, code: grpc.StatusCode, *, log: bool = True) -> None:
        seconds = time.perf_counter() - rpc.start
        if self._metrics is not None:
            self._metrics.observe(rpc.service, rpc.method, code.name, seconds)
        if log:
            self._log_outcome("rpc", rpc, code, seconds)

    def _record_message(self, rpc: Rpc, number: int) -> None:
        """One message of a request stream answered with status `number`: counted and timed
        from its parse, and logged as a call's outcome is."""
        code = STATUS_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)
        seconds = time.perf_counter() - rpc.parsed
        if self._metrics is not None:
            self._metrics.observe_message(rpc.service, rpc.method, code.name, seconds)
        self._log_outcome("stream_message", rpc, code, seconds)

    def _log_outcome(self, event: str, rpc: Rpc, code: grpc.StatusCode, seconds: float) -> None:
        fields = {"service": rpc.service, "method": rpc.method, "session": rpc.session,
                  "code": code.name, "latency_ms": round(seconds * 1000, 3)}
        if code == grpc.StatusCode.OK:
            _log.debug(event, **fields)
            return
        # A caller may fail calls as fast as it likes: one line per method and code at most
        # every HOSTILE_LOG_INTERVAL_S, counting the failures it stands for.
        limit = self._refusal_logs.setdefault(
            f"{event} {rpc.method} {code.name}", RateLimitedLog(HOSTILE_LOG_INTERVAL_S))
        count = limit.event()
        if count is not None:
            _log.warning(event, **fields, count=count, interval_s=HOSTILE_LOG_INTERVAL_S)


# The four handler kinds, and the grpc factory that makes a handler of each kind.
_HANDLER_KINDS = (
    ("unary_unary", grpc.unary_unary_rpc_method_handler),
    ("unary_stream", grpc.unary_stream_rpc_method_handler),
    ("stream_unary", grpc.stream_unary_rpc_method_handler),
    ("stream_stream", grpc.stream_stream_rpc_method_handler),
)


def _wrap(handler: Handler, scope: CallScope) -> Handler:
    """The same handler taking raw bytes, each call run inside `scope(context, nbytes)` and
    its request parsed there, after the scope's auth check and admission."""
    for kind, make in _HANDLER_KINDS:
        behavior = getattr(handler, kind)
        if behavior is not None:
            streamed = kind.startswith("stream")
            wrapped: Handler = make(_scoped(behavior, scope, handler.request_deserializer,
                                            streamed),
                                    request_deserializer=None,
                                    response_serializer=handler.response_serializer)
            return wrapped
    raise AssertionError(f"a method handler without a behavior: {handler}")


def _scoped(behavior: Behavior, scope: CallScope, deserializer: Deserializer,
            streamed: bool) -> Behavior:
    """`behavior` run inside `scope`, its request (or each streamed request) parsed after the
    scope's checks, keeping its shape: grpc treats an async generator (which yields responses)
    differently from a coroutine (which returns one or calls context.write). A streamed
    request's parser is closed when the call ends, giving back the budget its message held. A
    refused call ends with its status and no answer."""

    @asynccontextmanager
    async def parsed(raw: Any, rpc: Rpc) -> AsyncIterator[Any]:
        if not streamed:
            yield rpc.parse(raw, deserializer)
            return
        async with contextlib.aclosing(_parse_each(raw, rpc, deserializer)) as requests:
            yield requests

    if inspect.isasyncgenfunction(behavior):

        async def stream(raw: Any, context: Context) -> Any:
            with refusals_answered(context):
                async with scope(context, 0 if streamed else len(raw)) as rpc, \
                        parsed(raw, rpc) as request:
                    async for response in behavior(request, context):
                        if streamed:  # a message of a stream-stream call, answered
                            rpc.answered(response)
                        yield response

        return stream

    async def call(raw: Any, context: Context) -> Any:
        with refusals_answered(context):
            async with scope(context, 0 if streamed else len(raw)) as rpc, \
                    parsed(raw, rpc) as request:
                result = behavior(request, context)
                return await result if inspect.isawaitable(result) else result
        return None  # refused: the status is set

    return call


@contextlib.contextmanager
def refusals_answered(context: Context) -> Iterator[None]:
    """A `Refused` raised in the block ends the call with its status (the block's exception
    and traceback go with it, and the refused request's bytes with them)."""
    try:
        yield
    except Refused as refused:
        end_with_status(context, refused.code, str(refused))


async def _parse_each(raw_requests: AsyncIterator[Any], rpc: Rpc,
                      deserializer: Deserializer) -> AsyncGenerator[Any, None]:
    """Parse a request stream message by message, as the handler reads it, each message's wire
    bytes admitted to the request budget before it is parsed and held until the handler reads
    the next (or the call ends)."""
    async for raw in raw_requests:
        async with rpc.admit(len(raw)):
            yield rpc.parse(raw, deserializer)
