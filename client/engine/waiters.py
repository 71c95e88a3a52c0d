"""The callers waiting on an engine's requests: one queue each, fed from the engine's loop.

`Engine.stream` wants an output after each step that changed its request: every token so far
("cumulative"), or only the tokens new since its last output ("delta", vLLM's
RequestOutputKind.DELTA: a step costs the loop the new tokens, not a copy of all so far);
`Engine.generate` only the final one ("final"). A failure reaches the waiter as the exception
to raise; closing the engine cancels every waiter.
"""

import asyncio
from collections.abc import Iterator
from typing import Literal

from pagedkv.client.engine.outputs import RequestOutput
from pagedkv.client.engine.requests import Request

# What a waiter receives: an output, or the exception its request ended with.
Item = RequestOutput | BaseException
# Which outputs a waiter receives (the module's docstring).
OutputKind = Literal["final", "cumulative", "delta"]


class Waiters:
    """Each running request's waiter, by request id."""

    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue[Item]] = {}
        # Which outputs each waiter wants, by request id.
        self._kinds: dict[str, OutputKind] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._queues

    def __iter__(self) -> Iterator[str]:
        """The ids of the requests someone waits on."""
        return iter(list(self._queues))

    def open(self, request_id: str, kind: OutputKind) -> "asyncio.Queue[Item]":
        """The queue of a new request's waiter, which wants `kind` outputs."""
        queue: asyncio.Queue[Item] = asyncio.Queue()
        self._queues[request_id] = queue
        self._kinds[request_id] = kind
        return queue

    def close(self, request_id: str) -> None:
        """The waiter went away (its request finished, failed or was abandoned)."""
        self._queues.pop(request_id, None)
        self._kinds.pop(request_id, None)

    def progressed(self, request: Request) -> None:
        """A step changed `request` (not finished): its output, to a waiter wanting each."""
        if self._kinds.get(request.request_id, "final") != "final":
            self.publish(request)

    def publish(self, request: Request) -> None:
        """`request`'s output as it is now (a delta waiter: what is new since its last)."""
        queue = self._queues.get(request.request_id)
        if queue is not None:
            queue.put_nowait(request.output(delta=self._kinds[request.request_id] == "delta"))

    def fail(self, request_id: str, exc: BaseException) -> None:
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(exc)

    def fail_all(self, exc: BaseException) -> None:
        for queue in self._queues.values():
            queue.put_nowait(exc)
