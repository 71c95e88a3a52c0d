"""The long-lived streams of one servicer, ended when its process drains: the daemon's
KVPool.StepStream and the runner's Runner.StepStream.

A stream handler reads each message with `next_message` and ends (status OK) when it returns
None: the client ended the stream, or the process drains (`end`, hooked on
`GrpcServers.on_drain`). A stream waiting for its next message ends at once; one with a
message in progress ends once that message is answered. Without this an idle stream would
hold the drain for all of SHUTDOWN_GRACE_S and then be cancelled.
"""

import asyncio
from collections.abc import AsyncIterator
from typing import Any, TypeVar

Message = TypeVar("Message")


class DrainableStreams:
    """The streams of one servicer that `end` ends between two messages."""

    def __init__(self) -> None:
        # The tasks of streams waiting for their next message.
        self._idle: set[asyncio.Task[Any]] = set()
        # Whether the process drains: every stream then ends at its next message.
        self._draining = False

    @property
    def draining(self) -> bool:
        """Whether the process drains (a stream that does more than wait for messages, the
        runner's following one, stops at this)."""
        return self._draining

    async def next_message(self, requests: AsyncIterator[Message]) -> Message | None:
        """The stream's next message; None when the client has ended it or the process
        drains."""
        task = asyncio.current_task()
        assert task is not None, "a handler runs in a task"
        if self._draining:
            return None
        self._idle.add(task)
        try:
            return await anext(requests, None)
        except asyncio.CancelledError:
            if not self._draining:  # the client's cancel, or the server's
                raise
            task.uncancel()  # end's own: the stream ends
            return None
        finally:
            self._idle.discard(task)

    def end(self) -> None:
        """The process drains: every stream ends, at once if it waits for its next message,
        else once its message in progress is answered."""
        self._draining = True
        for task in self._idle:
            task.cancel()
