"""The peer-credential gate: unix callers told apart by uid, which grpc cannot tell the daemon.

grpc's Python API gives a handler the caller's address (`context.peer()`) and an auth context.
For a unix caller the address is "unix:" followed by the name the caller's own socket was
bound to (nothing, for the usual unbound client), and no credentials, local ones included,
carry its uid. So when a tenant lists `uids`, gRPC does not serve the public unix sockets
itself: this gate does, and gRPC listens in a private folder beside each one,
`<socket>.gate/grpc.sock`. For each connection the gate accepts on a public socket it

1. reads the uid of the process that connected (SO_PEERCRED: the kernel's record, made at
   connect, not anything the caller sends);
2. connects to gRPC's socket from a socket bound to `<socket>.gate/peer-<uid>-<n>`, and removes
   that file at once: the connection keeps the name as its address, the file is not needed;
3. copies bytes both ways until either side closes, then closes both.

gRPC reports the calls of that connection as coming from "unix:<socket>.gate/peer-<uid>-<n>",
and the interceptor maps the uid to a tenant (`peer_uid`; tenants.py). The folder is the
daemon's (mode 0o700, made afresh at start), so only the daemon's user can bind a name in it
or connect to gRPC's socket there: a peer named in it was named by the gate. The gate decides
nothing but the uid, and holds one cap: at most `max_unix_connections` connections at once
(limits.py); one more is closed as soon as it is accepted, with a rate-limited warning naming
the cap.

The gate runs its own event loop on its own thread, so copying never waits behind a callback
of the daemon's loop and puts none on it (it still shares the interpreter lock with the
daemon). Its cost, about 0.1 ms a small call's round trip: benchmarks/bench_peer_gate.py.
"""

import asyncio
import functools
import itertools
import os
import re
import shutil
import socket
import struct
import threading
from collections.abc import Callable, Collection, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedkv.process.log_setup import HOSTILE_LOG_INTERVAL_S, RateLimitedLog, get_logger
from pagedkv.process.socket_files import bind_unix_socket, make_private_folder

from .addresses import MAX_UNIX_PATH_BYTES
from .tenants import MAX_UID

# The private folder beside a public socket is "<socket>.gate"; gRPC listens in it here.
GATE_SUFFIX = ".gate"
GRPC_SOCKET_NAME = "grpc.sock"
# A connection's name is removed once it is connected, so its number need only differ from
# the few names bound at the same moment; wrapping keeps names (and the path check) bounded.
NAME_NUMBERS = 10**9
# SO_PEERCRED's struct ucred: pid, uid, gid.
_UCRED = struct.Struct("=iII")
# A connection's name in the private folder: its caller's uid, then a number.
_PEER_NAME = re.compile(r"^peer-([0-9]+)-[0-9]+$")

_log = get_logger(__name__)


def gate_folder(public: Path) -> Path:
    """The private folder of the gate serving the socket `public`."""
    return public.with_name(public.name + GATE_SUFFIX)


def peer_name(folder: Path, uid: int, number: int) -> Path:
    return folder / f"peer-{uid}-{number}"


def check_gate_paths(public: Path) -> None:
    """ValueError if a name the gate may bind beside `public` is too long for a unix socket."""
    longest = peer_name(gate_folder(public), MAX_UID, NAME_NUMBERS - 1)
    excess = len(os.fsencode(longest)) - MAX_UNIX_PATH_BYTES
    if excess > 0:
        raise ValueError(f"{public}: with tenants' uids, the peer-credential gate names each "
                         f"connection in {gate_folder(public)} (up to {longest.name}), "
                         f"{excess} bytes over the {MAX_UNIX_PATH_BYTES} a socket path may "
                         "have; use a shorter socket path")


def peer_uid(peer: str, folders: Collection[str]) -> int | None:
    """The caller's uid, from gRPC's address of a peer the gate connected from one of
    `folders`; None for any other peer."""
    if not peer.startswith("unix:"):
        return None
    folder, _, name = peer.removeprefix("unix:").rpartition("/")
    match = _PEER_NAME.match(name)
    return int(match.group(1)) if match is not None and folder in folders else None


def caller_uid(sock: Any) -> int:
    """The uid of the process that connected `sock` (a socket, or asyncio's wrapper of one)."""
    _pid, uid, _gid = _UCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return int(uid)


@dataclass(frozen=True, slots=True)
class _Route:
    """One public socket the gate serves."""

    # The socket, bound and listening, and its path.
    listener: socket.socket
    public: Path
    # The private folder its connections go to (gRPC's socket, their names).
    folder: Path


class PeerGate:
    """Unix sockets served on the gate's own thread, each connection named by its caller's
    uid. Used from the daemon's loop: `add` each socket, `start`, and at the end `stop`."""

    def __init__(self, max_connections: int) -> None:
        # Connections open at once, at most (max_unix_connections).
        self.max_connections = max_connections
        # Connections open now; changed on the gate's loop only (others may read it).
        self.open_connections = 0
        # The public sockets served.
        self._routes: list[_Route] = []
        # The open connections, by their caller's side (to close them at stop).
        self._links: set[_CallerSide] = set()
        self._numbers = itertools.count()
        self._refusals = RateLimitedLog(HOSTILE_LOG_INTERVAL_S)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._servers: list[asyncio.Server] = []

    @property
    def folders(self) -> frozenset[str]:
        return frozenset(str(route.folder) for route in self._routes)

    def add(self, public: Path, socket_mode: int) -> str:
        """Serve the socket path `public` (claimed: no live daemon there) through the gate:
        make its private folder, bind it with exactly `socket_mode`. Returns the target gRPC
        must listen on instead."""
        folder = gate_folder(public)
        make_private_folder(folder)
        self._routes.append(_Route(bind_unix_socket(public, socket_mode), public, folder))
        return f"unix://{folder / GRPC_SOCKET_NAME}"

    async def start(self) -> None:
        """Accept on every socket added, on the gate's thread (started here)."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever,
                                        name="pagedkv-peer-gate", daemon=True)
        self._thread.start()
        await self._on_gate(self._listen())

    async def stop(self) -> None:
        """Stop accepting, close every connection, end the thread, remove the sockets and
        folders it made."""
        if self._loop is not None and self._thread is not None:
            await self._on_gate(self._close_all())
            self._loop.call_soon_threadsafe(self._loop.stop)
            await asyncio.to_thread(self._thread.join)
            self._loop.close()
            self._loop = None
        for route in self._routes:
            route.listener.close()
            route.public.unlink(missing_ok=True)
            shutil.rmtree(route.folder, ignore_errors=True)

    async def _on_gate(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` on the gate's loop and wait for it from the calling loop."""
        assert self._loop is not None, "the gate is started"
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(work, self._loop))

    async def _listen(self) -> None:
        loop = asyncio.get_running_loop()
        for route in self._routes:
            self._servers.append(await loop.create_unix_server(
                functools.partial(_CallerSide, self, route.folder), sock=route.listener))

    async def _close_all(self) -> None:
        for server in self._servers:
            server.close()
        links = list(self._links)
        for link in links:
            link.abort()
        await asyncio.gather(*(link.joining for link in links if link.joining is not None),
                             return_exceptions=True)
        await asyncio.sleep(0)  # let the aborted transports report their loss

    def admit(self, link: "_CallerSide") -> bool:
        """Count a new connection in, unless max_connections are open (then warn, rarely)."""
        if self.open_connections >= self.max_connections:
            count = self._refusals.event()
            if count is not None:
                _log.warning("unix_connections_refused", limit="max_unix_connections",
                             max_unix_connections=self.max_connections, count=count,
                             interval_s=HOSTILE_LOG_INTERVAL_S)
            return False
        self.open_connections += 1
        self._links.add(link)
        return True

    def release(self, link: "_CallerSide") -> None:
        self.open_connections -= 1
        self._links.discard(link)

    async def connect_grpc(self, folder: Path, uid: int,
                           protocol: Callable[[], asyncio.Protocol]) -> None:
        """Connect a new `protocol` to gRPC's socket in `folder`, from a name that says `uid`."""
        loop = asyncio.get_running_loop()
        name = peer_name(folder, uid, next(self._numbers) % NAME_NUMBERS)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            sock.bind(str(name))
            try:
                await loop.sock_connect(sock, str(folder / GRPC_SOCKET_NAME))
            finally:
                name.unlink(missing_ok=True)  # the connection keeps its address
            await loop.create_unix_connection(protocol, sock=sock)
        except BaseException:
            sock.close()
            raise


class _Side(asyncio.Protocol):
    """One socket of a connection through the gate: what it receives is written to the other
    side. Backpressure passes through: while this side cannot write as fast as the other
    reads, the other stops reading."""

    def __init__(self, other: "_Side | None" = None) -> None:
        self.transport: asyncio.Transport | None = None
        # The other side; the caller's side gets it when the gRPC side is made.
        self.other = other

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._other_transport().write(data)

    def pause_writing(self) -> None:
        self._other_transport().pause_reading()

    def resume_writing(self) -> None:
        self._other_transport().resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.other is not None and self.other.transport is not None:
            self.other.transport.close()  # once it has written what it holds

    def _other_transport(self) -> asyncio.Transport:
        assert self.other is not None and self.other.transport is not None, \
            "a side reads, or is written to, only once both sides are connected"
        return self.other.transport


class _CallerSide(_Side):
    """The side a caller connected to: admitted (or closed) by the gate, it opens the gRPC
    side and reads nothing until that is connected."""

    def __init__(self, gate: PeerGate, folder: Path) -> None:
        super().__init__()
        self._gate = gate
        # The private folder of the public socket this caller came through.
        self._folder = folder
        # Opening the gRPC side; None if the gate refused the connection (it is not counted).
        self.joining: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        assert self.transport is not None
        uid = caller_uid(self.transport.get_extra_info("socket"))
        if not self._gate.admit(self):
            self.transport.abort()
            return
        self.transport.pause_reading()
        self.joining = asyncio.get_running_loop().create_task(self._join(uid))

    async def _join(self, uid: int) -> None:
        assert self.transport is not None
        try:
            await self._gate.connect_grpc(self._folder, uid, self._grpc_side)
        except OSError as exc:  # gRPC stopping, or out of file descriptors
            _log.debug("unix_connection_failed", uid=uid, error=str(exc))
            self.transport.close()
            return
        if self.transport.is_closing():  # the caller left meanwhile
            self._other_transport().close()
            return
        self.transport.resume_reading()

    def _grpc_side(self) -> _Side:
        """The gRPC side's protocol, joined to this side before it reads anything (gRPC
        speaks first: its settings frame)."""
        self.other = _Side(other=self)
        return self.other

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self.joining is not None:
            self._gate.release(self)

    def abort(self) -> None:
        """Close both sides at once (the gate is stopping)."""
        if self.joining is not None:
            self.joining.cancel()
        for side in (self, self.other):
            if side is not None and side.transport is not None:
                side.transport.abort()
