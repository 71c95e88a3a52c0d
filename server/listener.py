"""The HTTP server's listening socket: aiohttp's runner of the app, a site whose connections a
`ConnectionGuard` bounds (connections.py), and the flags that size the bounds.

The total cap must fit the process's descriptors: `pagedkv serve` raises its soft
RLIMIT_NOFILE to the hard limit at start (asyncio polls with epoll, so no select() limit
applies), keeps `FD_RESERVE + LISTEN_BACKLOG` descriptors for everything but connections, and
refuses a `--max-connections` that does not fit in the rest (the default is the rest).

`pagedkv serve` binds its port (`listen`) before it starts anything else, as vLLM does: a port
in use fails the start at once, before a daemon, a runner or a model is loaded for nothing.
"""

import argparse
import asyncio
import resource
import socket

from aiohttp import web

from pagedkv.server.connections import ConnectionGuard, ConnectionLimits

# The listening socket's backlog; asyncio also accepts up to this many connections in one turn
# of its loop before the guard can reset any, so that many descriptors are kept free for them.
LISTEN_BACKLOG = 128
# Descriptors kept for all but the connections: standard streams and the log, the channels to
# the daemon and the runner (and to a restarted runner), the model's and the tokenizer's files.
FD_RESERVE = 256
DEFAULT_HEADER_TIMEOUT_S = 10.0
# Above the 60 s idle time of common reverse proxies' upstream connections, so that a proxy
# does not send a request on a connection the server is closing.
DEFAULT_IDLE_TIMEOUT_S = 75.0
# Above --max-requests-per-peer's default (64): a client may keep idle connections besides.
DEFAULT_MAX_PER_ADDRESS = 128


def add_flags(cli: argparse.ArgumentParser) -> None:
    """The flags of the connection bounds."""
    cli.add_argument("--header-timeout-s", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
                     help="a new connection whose first request head is not complete this "
                          f"many seconds after it was accepted is reset (default "
                          f"{DEFAULT_HEADER_TIMEOUT_S:g}; at most --idle-timeout-s)")
    cli.add_argument("--idle-timeout-s", type=float, default=DEFAULT_IDLE_TIMEOUT_S,
                     help="a kept-alive connection whose next request head is not complete "
                          "this many seconds after its last answer is closed (default "
                          f"{DEFAULT_IDLE_TIMEOUT_S:g})")
    cli.add_argument("--max-connections", type=int, help="connections open at once, all "
                     "addresses together; more are reset when accepted (default: the "
                     f"process's descriptor limit less {FD_RESERVE + LISTEN_BACKLOG} kept for "
                     "its other files; a larger value is refused)")
    cli.add_argument("--max-connections-per-address", type=int,
                     default=DEFAULT_MAX_PER_ADDRESS, help="connections open at once from one "
                     "client address (an IPv6 /64); more are reset when accepted (default "
                     f"{DEFAULT_MAX_PER_ADDRESS}; 0: no bound, e.g. behind a reverse proxy)")


def raise_fd_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit; return the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return soft


def connection_limits(args: argparse.Namespace, fd_limit: int) -> ConnectionLimits:
    """The bounds of `add_flags`' flags in a process that may open `fd_limit` descriptors
    (ValueError naming the flag that is out of range or does not fit)."""
    if not 0 < args.header_timeout_s <= args.idle_timeout_s:
        raise ValueError(f"--header-timeout-s must be > 0 and at most --idle-timeout-s "
                         f"({args.idle_timeout_s:g}): a new connection is idle until its first "
                         f"request, got {args.header_timeout_s:g}")
    if args.max_connections_per_address < 0:
        raise ValueError("--max-connections-per-address must be >= 0 (0: no bound), got "
                         f"{args.max_connections_per_address}")
    room = fd_limit - FD_RESERVE - LISTEN_BACKLOG
    max_connections = room if args.max_connections is None else args.max_connections
    if not 0 < max_connections <= room:
        raise ValueError(f"--max-connections must be between 1 and {room}: the process may "
                         f"open {fd_limit} descriptors (RLIMIT_NOFILE) and keeps "
                         f"{FD_RESERVE + LISTEN_BACKLOG} for all but connections; got "
                         f"{max_connections} (raise LimitNOFILE= to allow more)")
    return ConnectionLimits(args.header_timeout_s, args.idle_timeout_s, max_connections,
                            args.max_connections_per_address)


def listen(host: str, port: int) -> list[socket.socket]:
    """Listening sockets on each address of `host` (IPv6 ones v6-only), as asyncio's
    create_server binds them; OSError naming the address when one cannot be bound."""
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in socket.getaddrinfo(
                host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise OSError(f"cannot listen on http://{host}:{port}: "
                      f"{exc.strerror or exc}") from None
    return sockets


def http_runner(app: web.Application, limits: ConnectionLimits,
                shutdown_timeout_s: float) -> web.AppRunner:
    """aiohttp's runner of `app`: no access log of its own (the app logs), handler cancellation
    on, the keep-alive timer at `limits.idle_timeout_s`, `shutdown_timeout_s` for handlers to
    end at cleanup."""
    return web.AppRunner(app, access_log=None, handler_cancellation=True,
                         shutdown_timeout=shutdown_timeout_s,
                         keepalive_timeout=limits.idle_timeout_s)


class GuardedSite(web.BaseSite):
    """A site of a runner of `http_runner` serving the sockets of `listen`, whose connections
    `guard` bounds; the loop's exception handler logs accept errors through the guard while the
    site listens. Stopping it closes them."""

    def __init__(self, runner: web.AppRunner, sockets: list[socket.socket],
                 guard: ConnectionGuard) -> None:
        super().__init__(runner, backlog=LISTEN_BACKLOG)
        assert sockets, "listen() gives a socket per address of the host"
        self._sockets = sockets
        # One asyncio server per socket (create_server takes one socket at a time).
        self._servers: list[asyncio.Server] = []
        self.guard = guard

    @property
    def name(self) -> str:
        host, port = self._sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    @property
    def port(self) -> int:
        """The port listened on (the one the system chose, for port 0)."""
        return int(self._sockets[0].getsockname()[1])

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None, "the runner is set up"
        loop.set_exception_handler(self.guard.accept_errors)
        for sock in self._sockets:
            self._servers.append(await loop.create_server(self.guard.protocol_factory(server),
                                                          sock=sock, backlog=self._backlog))

    async def stop(self) -> None:
        for server in self._servers:  # each closes its socket
            server.close()
        await super().stop()
        asyncio.get_running_loop().set_exception_handler(None)
