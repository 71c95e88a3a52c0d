"""The one way the bundled clients open a gRPC channel (PoolClient to a daemon, RunnerClient to
a runner).

Every channel sends and accepts messages up to MAX_MESSAGE_BYTES (pagedkv.proto.limits), the
limit both servers set through their shared bring-up (process/grpc_server.py): an answer a
daemon or runner may send is never refused by the client's own receive limit (gRPC's default is
4 MiB). The channel is returned once connected; a peer that does not answer in time is
`unreachable` (DaemonUnavailable or RunnerUnreachable; nothing was sent), the channel closed.
A channel whose peer went away tries to connect again at most RECONNECT_MAX_MS apart, so a
restarted runner (or daemon) is reached within that of its start, not after gRPC's default
backoff (1 s growing 1.6x per failure up to 120 s: seconds after a runner restart). A channel
over a unix socket (a peer on this host: a refused connect costs a syscall) tries every
LOCAL_RECONNECT_MS, so a daemon back from an upgrade is reached within that of its READY=1.
"""

import asyncio
from types import TracebackType
from typing import Self

import grpc

from pagedkv.client.pool.errors import OutcomeUnknown
from pagedkv.client.pool.tls import TlsOptions
from pagedkv.proto.limits import MESSAGE_SIZE_OPTIONS

# Reconnect backoff of a channel whose peer is down: the first retry after RECONNECT_FIRST_MS,
# then growing to at most RECONNECT_MAX_MS (a refused connect costs little). Not
# grpc.min_reconnect_backoff_ms: gRPC also takes it for the connect timeout (20 s), which a
# slow TLS link may need.
RECONNECT_FIRST_MS = 100
RECONNECT_MAX_MS = 500
RECONNECT_OPTIONS = (("grpc.initial_reconnect_backoff_ms", RECONNECT_FIRST_MS),
                     ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_MS))
# Over a unix socket: every LOCAL_RECONNECT_MS (gRPC's floor for both settings: shorter values
# are taken as 100 ms), at most ten connects a second on a daemon that stays down.
LOCAL_RECONNECT_MS = 100
LOCAL_RECONNECT_OPTIONS = (("grpc.initial_reconnect_backoff_ms", LOCAL_RECONNECT_MS),
                           ("grpc.max_reconnect_backoff_ms", LOCAL_RECONNECT_MS))


async def open_channel(target: str, peer: str, unreachable: type[OutcomeUnknown],
                       ready_timeout: float, tls: TlsOptions | None = None) -> grpc.aio.Channel:
    """A channel to `target` (over TLS with `tls`), connected within `ready_timeout` seconds;
    `peer` names what should answer there ("daemon", "runner") in the `unreachable` error."""
    local = target.startswith("unix")  # unix: and unix-abstract:
    options = [*MESSAGE_SIZE_OPTIONS, *(LOCAL_RECONNECT_OPTIONS if local else RECONNECT_OPTIONS)]
    channel = (grpc.aio.insecure_channel(target, options=options) if tls is None else
               grpc.aio.secure_channel(target, tls.credentials(),
                                       options + tls.channel_options()))
    try:
        await asyncio.wait_for(channel.channel_ready(), ready_timeout)
    except TimeoutError:
        await channel.close(grace=None)
        raise unreachable(grpc.StatusCode.UNAVAILABLE, f"no pagedkv {peer} answered at "
                          f"{target} within {ready_timeout} s") from None
    return channel


class ChannelOwner:
    """A client that owns one channel: `close()` closes it, and so does leaving `async with`."""

    _channel: grpc.aio.Channel

    async def close(self) -> None:
        await self._channel.close(grace=None)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()
