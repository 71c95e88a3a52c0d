"""The HTTP server's connections, bounded before aiohttp sees them (slowloris protection).

Each accepted connection meets a `ConnectionGuard` first, through a thin protocol in front of
aiohttp's `RequestHandler`:

- it is refused (reset at once, no handler made, no byte read) when its address already holds
  `max_per_address` connections (an IPv6 /64 counts as one address: a host is given a whole
  /64), or when `max_connections` are open in all: a cap kept below the process's descriptor
  limit (listener.py), so the server never runs out of descriptors for its daemon, its runner
  and its files, and asyncio never meets "accept() out of system resource";
- it is reset when its first request head is not complete `header_timeout_s` after it was
  accepted (a peer that sends its head a byte at a time, or never, holds nothing for long).
  After each answer aiohttp's keep-alive timer takes over: the next head must be complete
  within `idle_timeout_s` (listener.py sets it), else the connection is closed.

A peer can repeat refusals and timeouts at will, so each kind is logged at most once per
`HOSTILE_LOG_INTERVAL_S` with how many happened since; so are the accept errors asyncio
reports when descriptors run out anyway (other code of the process may take them).
"""

import asyncio
import errno
import ipaddress
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from pagedkv.process.log_setup import HOSTILE_LOG_INTERVAL_S, RateLimitedLog, get_logger

# The accept errors of a process out of descriptors or memory (asyncio's selector loop stops
# accepting for a second after each).
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
# The prefix length of one IPv6 client: its whole subnet counts as one address.
IPV6_CLIENT_PREFIX = 64

_log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """The bounds on the HTTP server's connections (the flags of `pagedkv serve`)."""

    # Seconds a new connection may take to send its first complete request head.
    header_timeout_s: float
    # Seconds a connection may wait, after an answer, for its next complete request head.
    idle_timeout_s: float
    # Connections open at once, all addresses together (below the descriptor limit).
    max_connections: int
    # Connections open at once from one address (an IPv6 /64); 0: no bound.
    max_per_address: int


def address_key(host: str) -> str:
    """The address a connection from `host` counts against: an IPv4 address (also when written
    IPv4-mapped), or an IPv6 /64."""
    address = ipaddress.ip_address(host.partition("%")[0])  # without an IPv6 zone
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    if isinstance(address, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((address, IPV6_CLIENT_PREFIX), strict=False))
    return str(address)


class ConnectionGuard:
    """Counts the open connections, refuses those over a cap, times out slow heads. One per
    listening socket's protocol factory (`protocol_factory`); used on the event loop only."""

    def __init__(self, limits: ConnectionLimits,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        # Connections open now: all, and by address (only addresses with one open).
        self.open_connections = 0
        self.open_by_address: Counter[str] = Counter()
        # The header timer of each connection whose first request head is not complete yet.
        self._awaiting_head: dict[RequestHandler, asyncio.TimerHandle] = {}
        # One rate limit per kind of line a peer can repeat at will (event and flag).
        self._logs: dict[str, RateLimitedLog] = {}
        self._clock = clock

    def protocol_factory(self, server: web.Server) -> Callable[[], asyncio.Protocol]:
        """The protocol factory to listen with: each connection guarded, then handled by
        `server` (aiohttp's). Call it before `server` makes any handler: it learns of complete
        heads from `server`'s request factory, which each handler takes when made."""
        make_request = server.request_factory

        def request_factory(*args: Any) -> web.BaseRequest:
            # aiohttp asks for a request once a connection's head is parsed (args[2]: its
            # handler), a bad head's 400 included.
            self._head_arrived(args[2])
            return make_request(*args)

        server.request_factory = request_factory
        return lambda: _GuardedConnection(self, server)

    def admit(self, transport: asyncio.BaseTransport) -> str | None:
        """Count a new connection in and return its address, or None when a cap refuses it
        (then log, rarely, the flag that did)."""
        peer = transport.get_extra_info("peername")
        address = address_key(peer[0]) if peer else ""
        if self.limits.max_per_address and \
                self.open_by_address[address] >= self.limits.max_per_address:
            self._log_rarely("http_connection_refused", limit="--max-connections-per-address",
                             value=self.limits.max_per_address, address=address)
            return None
        if self.open_connections >= self.limits.max_connections:
            self._log_rarely("http_connection_refused", limit="--max-connections",
                             value=self.limits.max_connections, address=address)
            return None
        self.open_connections += 1
        self.open_by_address[address] += 1
        return address

    def release(self, address: str, handler: RequestHandler) -> None:
        """Count out a connection `admit` counted in, whose handler was `handler`."""
        self.open_connections -= 1
        self.open_by_address[address] -= 1
        if not self.open_by_address[address]:
            del self.open_by_address[address]
        timer = self._awaiting_head.pop(handler, None)
        if timer is not None:
            timer.cancel()

    def await_head(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        """Reset `transport` unless `handler` has a complete request head in time."""
        loop = asyncio.get_running_loop()
        self._awaiting_head[handler] = loop.call_later(
            self.limits.header_timeout_s, self._head_late, handler, transport)

    def _head_arrived(self, handler: RequestHandler) -> None:
        timer = self._awaiting_head.pop(handler, None)
        if timer is not None:
            timer.cancel()

    def _head_late(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        del self._awaiting_head[handler]
        peer = transport.get_extra_info("peername")
        self._log_rarely("http_connection_timed_out", limit="--header-timeout-s",
                         value=self.limits.header_timeout_s,
                         address=address_key(peer[0]) if peer else "")
        transport.abort()  # connection_lost follows: the counts go down there

    def accept_errors(self, loop: asyncio.AbstractEventLoop,
                      context: dict[str, Any]) -> None:
        """A loop exception handler: asyncio's accept errors for lack of descriptors or
        memory, logged rarely; anything else to the loop's default handler."""
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in RESOURCE_ERRNOS:
            self._log_rarely("http_accept_out_of_resources", error=str(exc))
        else:
            loop.default_exception_handler(context)

    def _log_rarely(self, event: str, **fields: Any) -> None:
        """Warn of `event`, at most once per HOSTILE_LOG_INTERVAL_S for each flag it names,
        with how many happened."""
        rate = self._logs.setdefault(f"{event} {fields.get('limit', '')}",
                                     RateLimitedLog(HOSTILE_LOG_INTERVAL_S, self._clock))
        count = rate.event()
        if count is not None:
            _log.warning(event, **fields, count=count, interval_s=HOSTILE_LOG_INTERVAL_S)


class _GuardedConnection(asyncio.Protocol):
    """One accepted connection: refused when the guard says so, else passed through to a
    handler of aiohttp's, made only then."""

    def __init__(self, guard: ConnectionGuard, server: web.Server) -> None:
        self._guard = guard
        self._server = server
        # The address it counts against, and aiohttp's handler; None: refused (or not yet).
        self._address: str | None = None
        self._handler: RequestHandler | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        connection = cast(asyncio.Transport, transport)  # a TCP server's
        self._address = self._guard.admit(connection)
        if self._address is None:
            connection.abort()  # a reset: nothing read, nothing lingers in TIME_WAIT here
            return
        self._handler = self._server()
        self._handler.connection_made(connection)
        self._guard.await_head(self._handler, connection)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._handler is not None and self._address is not None:
            self._guard.release(self._address, self._handler)
            self._handler.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._handler is not None:
            self._handler.data_received(data)

    def eof_received(self) -> None:
        # None: the transport closes, as aiohttp's handler wants (it keeps no half-closed
        # connection).
        if self._handler is not None:
            self._handler.eof_received()

    def pause_writing(self) -> None:
        if self._handler is not None:
            self._handler.pause_writing()

    def resume_writing(self) -> None:
        if self._handler is not None:
            self._handler.resume_writing()
