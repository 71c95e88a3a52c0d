"""One connection through the peer-credential gate (peer_gate.py): the caller's side and gRPC's.

The caller's side is admitted (or closed) by the gate as it arrives, reads its caller's uid and
pid (SO_PEERCRED), opens gRPC's side from a name that says them, and copies bytes both ways with
backpressure until either side closes. It also keeps the connection's idle clock: a connection
that passes no byte either way for the gate's `idle_s` is closed (one timer per connection,
re-armed from its last byte).
"""

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pagedkv.daemon.service.fence import PeerCredentials
from pagedkv.process.log_setup import get_logger

if TYPE_CHECKING:  # the gate imports this module
    from pagedkv.daemon.edge.peer_gate import PeerGate

_log = get_logger(__name__)


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
        self.caller_side().last_bytes = time.monotonic()

    def caller_side(self) -> "CallerSide":
        """The connection's caller side, which keeps its idle clock (this is the gRPC side)."""
        assert isinstance(self.other, CallerSide), "the gRPC side's other is the caller's"
        return self.other

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


class CallerSide(_Side):
    """The side a caller connected to: admitted (or closed) by the gate, it opens the gRPC
    side and reads nothing until that is connected."""

    def __init__(self, gate: "PeerGate", folder: Path, runners: bool) -> None:
        super().__init__()
        self._gate = gate
        # The private folder of the public socket this caller came through, and whether that
        # is the runner socket.
        self._folder = folder
        self.runners = runners
        # The caller's uid and pid (SO_PEERCRED), read once connected.
        self.credentials = PeerCredentials(pid=0, uid=-1)
        # When a byte last passed either way (time.monotonic()), and the timer that closes the
        # connection once none has for the gate's idle_s.
        self.last_bytes = time.monotonic()
        self._idle_timer: asyncio.TimerHandle | None = None
        # Opening the gRPC side; None if the gate refused the connection (it is not counted).
        self.joining: asyncio.Task[None] | None = None

    @property
    def uid(self) -> int:
        return self.credentials.uid

    def caller_side(self) -> "CallerSide":
        return self

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        assert self.transport is not None
        self.credentials = self._gate.credentials(self.transport.get_extra_info("socket"),
                                                  self.runners)
        if not self._gate.admit(self):
            self.transport.abort()
            return
        self.transport.pause_reading()
        self._arm_idle_timer(self._gate.idle_s)
        self.joining = asyncio.get_running_loop().create_task(self._join())

    def _arm_idle_timer(self, delay_s: float) -> None:
        self._idle_timer = asyncio.get_running_loop().call_later(delay_s, self._check_idle)

    def _check_idle(self) -> None:
        """Close the connection if no byte passed for idle_s; else look again when that could
        first be so."""
        idle_s = time.monotonic() - self.last_bytes
        if idle_s < self._gate.idle_s:
            self._arm_idle_timer(self._gate.idle_s - idle_s)
            return
        _log.debug("unix_connection_idle_closed", uid=self.uid, idle_s=round(idle_s, 3))
        self.abort()

    async def _join(self) -> None:
        assert self.transport is not None
        try:
            await self._gate.connect_grpc(self._folder, self.credentials, self._grpc_side)
        except OSError as exc:  # gRPC stopping, or out of file descriptors
            _log.debug("unix_connection_failed", uid=self.uid, error=str(exc))
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
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        if self.joining is not None:
            self._gate.release(self)

    def abort(self) -> None:
        """Close both sides at once (the gate is stopping, or the connection was idle)."""
        if self.joining is not None:
            self.joining.cancel()
        for side in (self, self.other):
            if side is not None and side.transport is not None:
                side.transport.abort()
