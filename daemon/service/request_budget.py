"""A byte budget for the requests the daemon holds parsed at once.

Calls wait for the pool lock one behind the other, and a waiting call holds its request. A
request's wire bytes (at most MAX_MESSAGE_BYTES) grow several times over once parsed (a packed
million-token prompt of 6 MB is a few dozen MB of Python objects), so eight queued Allocates of
6 MB once took 400 MiB. The interceptor therefore admits each request to this budget before
parsing it, and holds its bytes until the call ends: the requests parsed and not yet answered
take at most `max_queued_request_bytes` wire bytes. A request that does not fit waits, still
unparsed, until earlier calls end; one larger than the whole budget cannot exist (the budget is
at least MAX_MESSAGE_BYTES, the largest request gRPC accepts).

Small requests (at most SMALL_REQUEST_BYTES: KeepAlives, decode Steps, most Batches) are
admitted at once and not counted: a KeepAlive must never wait behind big prompts for its lease,
and `max_concurrent_rpcs` already bounds them (x SMALL_REQUEST_BYTES).
"""

import asyncio
import contextlib
from collections.abc import AsyncIterator

# Requests up to this many wire bytes are admitted at once, uncounted.
SMALL_REQUEST_BYTES = 64 * 1024


class RequestBudget:
    """Wire bytes of large requests admitted (parsed, not yet answered) at once."""

    def __init__(self, limit: int) -> None:
        # max_queued_request_bytes.
        self.limit = limit
        # Bytes of the large requests admitted now.
        self.admitted = 0
        # One future per request waiting for room; each is woken when bytes are returned.
        self._waiters: list[asyncio.Future[None]] = []

    @property
    def waiting(self) -> int:
        """Requests waiting for room, unparsed."""
        return len(self._waiters)

    @contextlib.asynccontextmanager
    async def admit(self, nbytes: int) -> AsyncIterator[None]:
        """Hold `nbytes` of the budget for the duration (at once for a small request)."""
        if nbytes <= SMALL_REQUEST_BYTES:
            yield
            return
        assert nbytes <= self.limit, "the budget is at least the largest request gRPC accepts"
        while self.admitted + nbytes > self.limit:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                self._waiters.remove(waiter)
        self.admitted += nbytes
        try:
            yield
        finally:
            self.admitted -= nbytes
            for waiter in self._waiters:  # each checks again whether it fits now
                if not waiter.done():
                    waiter.set_result(None)
