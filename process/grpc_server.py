"""The one gRPC server bring-up of pagedkv's processes (pagedkvd and `pagedkv runner`).

Both serve one gRPC service the same way, through `grpc_servers`:

- build: each server carries its service, health and reflection; messages up to
  MAX_MESSAGE_BYTES both ways (pagedkv.proto.limits: the limit every bundled channel sets too);
  the process's `ServerBounds` (calls at once, keepalive, idle connections); no SO_REUSEPORT;
- bind: a unix socket is claimed (a crashed process's removed, a live one's refused) and gets
  exactly its mode whatever the umask, and its group when given (`socket_files`);
- start, then SERVING in health for "" and the service;
- drain (`GrpcServers.drain`, on the process's stop event): STOPPING=1 to systemd, health
  NOT_SERVING so balancers and clients move away, long-lived streams told to end (`on_drain`:
  a stream ends once its message in progress is answered), new calls refused, in-flight ones
  finish for up to SHUTDOWN_GRACE_S and are then cancelled;
- on exit: every server stopped at once and the socket files it created removed.
"""

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pagedkv.process.log_setup import get_logger
from pagedkv.process.notify import notify
from pagedkv.process.server_bounds import ServerBounds
from pagedkv.process.socket_files import SocketInUse, claim_socket_path, socket_umask
from pagedkv.proto.limits import MESSAGE_SIZE_OPTIONS

# How long in-flight calls may run after SIGTERM before they are cancelled. The unit's
# TimeoutStopSec must be larger, or systemd kills the process mid-drain.
SHUTDOWN_GRACE_S = 5.0

log = get_logger(__name__)

# grpc_health's stubs predate its asyncio servicer (`health.aio`), so mypy sees it as Any.
AsyncHealthServicer: Any = health.aio.HealthServicer  # type: ignore[attr-defined]


class StartupError(RuntimeError):
    """A process could not start for a reason outside its settings (e.g. a socket in use)."""


class GrpcServers:
    """The gRPC servers of one process: one service, one health servicer, one set of bounds.
    Made by `grpc_servers`, which stops them and removes their socket files on exit."""

    def __init__(self, service_name: str, bounds: ServerBounds) -> None:
        # The full name of the service every server carries (health and reflection name it).
        self.service_name = service_name
        # What every server bounds (its calls at once, its connections).
        self.bounds = bounds
        # Shared by every server: drain() turns them all NOT_SERVING at once.
        self.health = AsyncHealthServicer()
        # Every server built, in order.
        self.servers: list[grpc.aio.Server] = []
        # Socket files these servers created; only these are removed (never a live process's).
        self.sockets: list[Path] = []
        # Called when the drain starts: servicers end their long-lived streams (which would
        # otherwise hold the drain for all of SHUTDOWN_GRACE_S).
        self.on_drain: list[Callable[[], None]] = []

    def add_server(self, add_service: Callable[[grpc.aio.Server], None],
                   interceptors: Sequence["grpc.aio.ServerInterceptor[Any, Any]"] = ()
                   ) -> grpc.aio.Server:
        """A new server of the service (added by `add_service`), health and reflection, every
        call through `interceptors`."""
        server = grpc.aio.server(
            interceptors=interceptors,
            options=[*MESSAGE_SIZE_OPTIONS, *self.bounds.options(),
                     # Without this a second process on the same TCP port would share it silently.
                     ("grpc.so_reuseport", 0)],
            # One call more is refused by gRPC itself (RESOURCE_EXHAUSTED): what calls waiting
            # for the service hold is bounded.
            maximum_concurrent_rpcs=self.bounds.max_concurrent_rpcs,
        )
        add_service(server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (self.service_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        self.servers.append(server)
        return server

    def bind_unix(self, server: grpc.aio.Server, path: Path, mode: int,
                  group: int | None = None) -> str:
        """Listen on the unix socket `path` with exactly `mode` whatever the umask (its folder,
        when made, with `socket_files.folder_mode`), given to `group` when given: bound with the
        owner's bits alone, then chown'ed, then opened to the group. Returns its target."""
        target = f"unix://{path}"
        try:
            claim_socket_path(path, mode)
            with socket_umask(mode if group is None else mode & 0o700):
                server.add_insecure_port(target)  # grpc creates the file here
        except SocketInUse as exc:
            raise StartupError(str(exc)) from exc
        except RuntimeError as exc:
            raise StartupError(f"cannot listen on {target}: address in use or not "
                               "permitted") from exc
        self.sockets.append(path)
        if group is not None:
            try:
                os.chown(path, -1, group)
            except PermissionError as exc:
                raise StartupError(f"cannot give {path} to group {group}: {exc.strerror} "
                                   "(this process's user must be a member)") from exc
        os.chmod(path, mode)
        return target

    async def start(self) -> None:
        """Start every server (each accepts calls from now on)."""
        for server in self.servers:
            await server.start()

    async def set_serving(self) -> None:
        """Health SERVING for the process ("") and its service."""
        for name in ("", self.service_name):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def drain(self) -> None:
        """STOPPING=1, health NOT_SERVING, streams told to end, then stop: in-flight calls get
        SHUTDOWN_GRACE_S."""
        log.info("stopping", grace_s=SHUTDOWN_GRACE_S)
        notify("STOPPING=1", "STATUS=draining")
        await self.health.enter_graceful_shutdown()
        for end_streams in self.on_drain:
            end_streams()
        await self.stop(SHUTDOWN_GRACE_S)

    async def stop(self, grace: float | None) -> None:
        """Stop every server: new calls refused at once, in-flight ones cancelled after
        `grace` seconds (None: at once)."""
        await asyncio.gather(*(server.stop(grace) for server in self.servers))


@contextlib.asynccontextmanager
async def grpc_servers(service_name: str, bounds: ServerBounds) -> AsyncIterator[GrpcServers]:
    """A `GrpcServers` to build, bind and start; on exit (a failed start included) every
    server is stopped at once and the socket files they created are removed."""
    servers = GrpcServers(service_name, bounds)
    try:
        yield servers
    finally:
        await servers.stop(None)
        for path in servers.sockets:
            path.unlink(missing_ok=True)
