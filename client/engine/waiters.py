"""The callers waiting on an engine's requests: one queue each, fed from the engine's loop.

`Engine.stream` wants an output after each step that changed its request; `Engine.generate`
only the final one (an output per step costs the loop a copy of every token so far). A failure
reaches the waiter as the exception to raise; closing the engine cancels every waiter.
"""

import asyncio
from collections.abc import Iterator

from pagedkv.client.engine.outputs import RequestOutput
from pagedkv.client.engine.requests import Request

# What a waiter receives: an output, or the exception its request ended with.
Item = RequestOutput | BaseException


class Waiters:
    """Each running request's waiter, by request id."""

    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue[Item]] = {}
        # Requests whose waiter wants only the final output (`generate`).
        self._final_only: set[str] = set()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._queues

    def __iter__(self) -> Iterator[str]:
        """The ids of the requests someone waits on."""
        return iter(list(self._queues))

    def open(self, request_id: str, every_step: bool) -> "asyncio.Queue[Item]":
        """The queue of a new request's waiter."""
        queue: asyncio.Queue[Item] = asyncio.Queue()
        self._queues[request_id] = queue
        if not every_step:
            self._final_only.add(request_id)
        return queue

    def close(self, request_id: str) -> None:
        """The waiter went away (its request finished, failed or was abandoned)."""
        self._queues.pop(request_id, None)
        self._final_only.discard(request_id)

    def progressed(self, request: Request) -> None:
        """A step changed `request` (not finished): its output, to a waiter wanting each."""
        if request.request_id not in self._final_only:
            self.publish(request)

    def publish(self, request: Request) -> None:
        """`request`'s output as it is now."""
        queue = self._queues.get(request.request_id)
        if queue is not None:
            queue.put_nowait(request.output())

    def fail(self, request_id: str, exc: BaseException) -> None:
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(exc)

    def fail_all(self, exc: BaseException) -> None:
        for queue in self._queues.values():
            queue.put_nowait(exc)
