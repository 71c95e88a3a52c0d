"""The peer-credential gate: unix callers told apart by uid, which grpc cannot tell the daemon.

grpc's Python API gives a handler the caller's address (`context.peer()`) and an auth context.
For a unix caller the address is "unix:" followed by the name the caller's own socket was
bound to (nothing, for the usual unbound client), and no credentials, local ones included,
carry its uid. So when a tenant lists `uids`, gRPC does not serve the public unix sockets
itself: this gate does, and gRPC listens in a private folder beside each one,
`<socket>.gate/grpc.sock`. For each connection the gate accepts on a public socket it

1. reads the uid and pid of the process that connected (SO_PEERCRED: the kernel's record,
   made at connect, not anything the caller sends);
2. connects to gRPC's socket from a socket bound to `<socket>.gate/peer-<uid>-<pid>-<n>`, and
   removes that file at once: the connection keeps the name as its address, the file is not
   needed;
3. copies bytes both ways until either side closes, then closes both (gate_link.py).

gRPC reports the calls of that connection as coming from
"unix:<socket>.gate/peer-<uid>-<pid>-<n>", and the interceptor maps the uid to a tenant
(`peer_credentials`; tenants.py).

The runner socket is always served through the gate, for the pid: the daemon must be able to
stop a runner that stalls past its hold (fence.py), so the gate takes a pidfd of each process
that connects there (`RunnerProcesses.connected`) and the interceptor names the runner process
of each call. Who may connect there is the socket's mode and group alone (no tenant maps
runners' uids); the connection bounds below hold there too. The folder is the
daemon's (mode 0o700, made afresh at start), so only the daemon's user can bind a name in it
or connect to gRPC's socket there: a peer named in it was named by the gate. The gate decides
nothing but the uid, and bounds what one uid can hold (limits.py), so that no caller can lock
the others out by holding connections open:

- a uid no tenant lists is closed as soon as it is accepted when `unmapped_uids = "refuse"`
  (it could make no call but a health check, yet it would hold a connection);
- at most `max_unix_connections_per_uid` connections of one uid are open at once, and at most
  `max_unix_connections` of all uids together;
- a connection that passes no byte either way for `max_unix_connection_idle_ms` is closed (a
  gRPC client reconnects on its next call).

A connection refused is closed at once (the caller sees UNAVAILABLE), with a warning naming the
setting, rate-limited per setting.

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
import threading
from collections import Counter
from collections.abc import Callable, Collection, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedkv.daemon.edge.gate_link import CallerSide
from pagedkv.daemon.service.fence import PeerCredentials, RunnerProcesses, socket_credentials
from pagedkv.daemon.service.limits import Limits
from pagedkv.daemon.service.tenants import MAX_UID, Tenants
from pagedkv.process.log_setup import HOSTILE_LOG_INTERVAL_S, RateLimitedLog, get_logger
from pagedkv.process.socket_files import bind_unix_socket, make_private_folder
from pagedkv.vocab.paths import MAX_UNIX_PATH_BYTES

# The private folder beside a public socket is "<socket>.gate"; gRPC listens in it here.
GATE_SUFFIX = ".gate"
GRPC_SOCKET_NAME = "grpc.sock"
# A connection's name is removed once it is connected, so its number need only differ from
# the few names bound at the same moment; wrapping keeps names (and the path check) bounded.
NAME_NUMBERS = 10**9
# A connection's name in the private folder: its caller's uid and pid, then a number.
_PEER_NAME = re.compile(r"^peer-([0-9]+)-([0-9]+)-[0-9]+$")
# The largest pid Linux gives (pid_max's ceiling, 2^22).
MAX_PID = 2**22

_log = get_logger(__name__)


def gate_folder(public: Path) -> Path:
    """The private folder of the gate serving the socket `public`."""
    return public.with_name(public.name + GATE_SUFFIX)


def peer_name(folder: Path, credentials: PeerCredentials, number: int) -> Path:
    return folder / f"peer-{credentials.uid}-{credentials.pid}-{number}"


def check_gate_paths(public: Path) -> None:
    """ValueError if a name the gate may bind beside `public` is too long for a unix socket."""
    longest = peer_name(gate_folder(public), PeerCredentials(MAX_PID, MAX_UID),
                        NAME_NUMBERS - 1)
    excess = len(os.fsencode(longest)) - MAX_UNIX_PATH_BYTES
    if excess > 0:
        raise ValueError(f"{public}: the peer-credential gate names each "
                         f"connection in {gate_folder(public)} (up to {longest.name}), "
                         f"{excess} bytes over the {MAX_UNIX_PATH_BYTES} a socket path may "
                         "have; use a shorter socket path")


def peer_credentials(peer: str, folders: Collection[str]) -> PeerCredentials | None:
    """The caller's uid and pid, from gRPC's address of a peer the gate connected from one of
    `folders`; None for any other peer."""
    if not peer.startswith("unix:"):
        return None
    folder, _, name = peer.removeprefix("unix:").rpartition("/")
    match = _PEER_NAME.match(name)
    if match is None or folder not in folders:
        return None
    return PeerCredentials(pid=int(match.group(2)), uid=int(match.group(1)))


@dataclass(frozen=True, slots=True)
class _Route:
    """One public socket the gate serves."""

    # The socket, bound and listening, and its path.
    listener: socket.socket
    public: Path
    # The private folder its connections go to (gRPC's socket, their names).
    folder: Path
    # The runner socket: admitted by its mode and group alone, each process's pidfd taken.
    runners: bool


class PeerGate:
    """Unix sockets served on the gate's own thread, each connection named by its caller's
    uid. Used from the daemon's loop: `add` each socket, `start`, and at the end `stop`."""

    def __init__(self, limits: Limits, tenants: Tenants,
                 processes: RunnerProcesses | None = None) -> None:
        # Connections open at once: all uids together, and one uid.
        self.max_connections = limits.max_unix_connections
        self.max_per_uid = limits.max_unix_connections_per_uid
        # Seconds a connection may pass no byte either way before it is closed.
        self.idle_s = limits.max_unix_connection_idle_ms / 1000
        # Who may connect: a uid the tenants map (all of them, with unmapped_uids =
        # "unix_tenant").
        self._tenants = tenants
        # The processes connected to the runner socket, by pid (fence.py).
        self.processes = processes or RunnerProcesses()
        # Connections open now, all and by uid; changed on the gate's loop only (others may
        # read them).
        self.open_connections = 0
        self.open_by_uid: Counter[int] = Counter()
        # The public sockets served.
        self._routes: list[_Route] = []
        # The open connections, by their caller's side (to close them at stop).
        self._links: set[CallerSide] = set()
        self._numbers = itertools.count()
        # One rate limit per setting a refusal names.
        self._refusals: dict[str, RateLimitedLog] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._servers: list[asyncio.Server] = []

    def folders(self, *, runners: bool = False) -> frozenset[str]:
        """The private folders of the public sockets, or of the runner socket."""
        return frozenset(str(route.folder) for route in self._routes if route.runners == runners)

    def add(self, public: Path, socket_mode: int, *, group: int | None = None,
            runners: bool = False) -> str:
        """Serve the socket path `public` (claimed: no live daemon there) through the gate:
        make its private folder, bind it with exactly `socket_mode` (given to `group` when
        given); `runners`: it is the runner socket. Returns the target gRPC must listen on
        instead."""
        folder = gate_folder(public)
        make_private_folder(folder)
        listener = bind_unix_socket(public, socket_mode, group)
        self._routes.append(_Route(listener, public, folder, runners))
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
                functools.partial(CallerSide, self, route.folder, route.runners),
                sock=route.listener))

    async def _close_all(self) -> None:
        for server in self._servers:
            server.close()
        links = list(self._links)
        for link in links:
            link.abort()
        await asyncio.gather(*(link.joining for link in links if link.joining is not None),
                             return_exceptions=True)
        await asyncio.sleep(0)  # let the aborted transports report their loss

    def credentials(self, sock: Any, runners: bool) -> PeerCredentials:
        """Who connected `sock`; on the runner socket, its process is noted (its pidfd)."""
        return self.processes.connected(sock) if runners else socket_credentials(sock)

    def admit(self, link: "CallerSide") -> bool:
        """Count a new connection in, unless its uid may not connect or holds its share, or
        the gate is full (then warn, rarely, naming the setting)."""
        refusal = self._refusal(link.uid, link.runners)
        if refusal is not None:
            setting, value = refusal
            count = self._refusals.setdefault(
                setting, RateLimitedLog(HOSTILE_LOG_INTERVAL_S)).event()
            if count is not None:
                _log.warning("unix_connections_refused", limit=setting, **{setting: value},
                             uid=link.uid, count=count, interval_s=HOSTILE_LOG_INTERVAL_S)
            return False
        self.open_connections += 1
        self.open_by_uid[link.uid] += 1
        self._links.add(link)
        return True

    def _refusal(self, uid: int, runners: bool) -> tuple[str, object] | None:
        """The setting refusing a new connection of `uid`, and its value; None to admit it."""
        if not runners and self._tenants.for_uid(uid) is None:
            return "unmapped_uids", "refuse"
        if self.open_by_uid[uid] >= self.max_per_uid:
            return "max_unix_connections_per_uid", self.max_per_uid
        if self.open_connections >= self.max_connections:
            return "max_unix_connections", self.max_connections
        return None

    def release(self, link: "CallerSide") -> None:
        self.open_connections -= 1
        self.open_by_uid[link.uid] -= 1
        if not self.open_by_uid[link.uid]:
            del self.open_by_uid[link.uid]
        self._links.discard(link)

    async def connect_grpc(self, folder: Path, credentials: PeerCredentials,
                           protocol: Callable[[], asyncio.Protocol]) -> None:
        """Connect a new `protocol` to gRPC's socket in `folder`, from a name that says the
        caller's `credentials`."""
        loop = asyncio.get_running_loop()
        name = peer_name(folder, credentials, next(self._numbers) % NAME_NUMBERS)
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
