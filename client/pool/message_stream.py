"""One opened bidirectional stream of request messages and their answers, matched by id: the
mechanism under both stream clients (step_stream.py, a PoolClient's StepMany calls on
KVPool.StepStream; runner_stream.py, a session's steps on Runner.StepStream).

    stream = _DaemonCall(stub.StepStream(None))          # a subclass naming its hop
    answer = stream.expect(call_id)                      # before writing: no answer is missed
    if not await stream.write(message): ...              # False: the stream had ended, unsent
    reply = await answer                                 # or the stream's end error

Several messages may be in flight: one task reads the answers and hands each to the future of
the message with its id (`answer_id`); an answer nobody awaits goes to `unawaited` (the runner
hop's pushed answers; dropped by default). Writes are serialized, so the answers' order is the
writes'. The stream ends once: broken (the rpc's status, through `broken`), ended OK by the
peer (`ended_ok`), or cancelled here (`cancel`, with the error the caller names); every message
still awaited then fails with an error of its own of the end's class, and `ended` keeps it.
A subclass names its hop: `answer_id`, `broken`, `ended_ok` and, if it needs them,
`unawaited` and `on_end`.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Generic, TypeVar

import grpc

from pagedkv.client.pool.errors import Cancelled, PagedKVError

# The request and answer messages of the stream.
RequestT = TypeVar("RequestT")
AnswerT = TypeVar("AnswerT")

if TYPE_CHECKING:
    # One opened stream call (grpc-stubs' generic; the runtime class takes no parameters).
    Call = grpc.aio.StreamStreamCall[RequestT, AnswerT]


class MessageStream(ABC, Generic[RequestT, AnswerT]):
    """One opened stream: its call, the answers awaited by id, the task reading them."""

    # What the stream is, in errors and the reader task's name ("StepStream").
    name = "stream"

    def __init__(self, call: Call[RequestT, AnswerT]) -> None:
        self.call = call
        # Message id -> the future of its answer, for every message written and not answered.
        self.waiting: dict[int, asyncio.Future[AnswerT]] = {}
        # Why the stream ended (each message still waiting failed with it); None while open.
        self.ended: PagedKVError | None = None
        # Writes one message at a time: their order on the wire is the answers' order.
        self._writing = asyncio.Lock()
        self._reader = asyncio.create_task(self._read(), name=f"pagedkv-{self.name}")

    @abstractmethod
    def answer_id(self, answer: AnswerT) -> int:
        """The id of the message `answer` answers."""

    @abstractmethod
    def broken(self, error: grpc.aio.AioRpcError) -> PagedKVError:
        """The end error of a stream that ended with the failed status `error`."""

    @abstractmethod
    def ended_ok(self) -> PagedKVError:
        """The end error of a stream the peer ended OK (for the messages it left unanswered)."""

    def unawaited(self, answer: AnswerT) -> None:
        """An answer no message awaits: dropped here. A subclass may keep it, or raise a
        PagedKVError to end the stream with it (an answer the stream cannot go on after)."""

    def on_end(self) -> None:
        """Called once, when the stream has ended (`ended` is set)."""

    def expect(self, message_id: int) -> asyncio.Future[AnswerT]:
        """The future of message `message_id`'s answer (or of the stream's end)."""
        future = self.waiting[message_id] = asyncio.get_running_loop().create_future()
        return future

    def forget(self, message_id: int) -> None:
        """Stop waiting for `message_id` (its write sent nothing)."""
        future = self.waiting.pop(message_id, None)
        if future is not None and not future.cancel() and not future.cancelled():
            future.exception()  # failed by the stream's end meanwhile: retrieved, unused

    async def write(self, message: RequestT) -> bool:
        """Write `message`; False if the stream had ended (nothing of it was sent)."""
        async with self._writing:
            if self.ended is not None or self.call.done():
                return False
            try:
                await self.call.write(message)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                return False  # a failed write sends nothing; the reader ends the stream
            return True

    def cancel(self, error: PagedKVError) -> None:
        """End the stream here: cancelled (the peer handles the message it had not finished
        as a cancelled call's), every message still waiting failing with `error`."""
        self.call.cancel()
        self._end(error)

    async def ended_here(self) -> None:
        """Return once the reader has seen the end (nothing more is read from the stream)."""
        await asyncio.wait([self._reader])

    async def _read(self) -> None:
        """Hand each answer to its caller until the stream ends; then fail those left."""
        try:
            async for answer in self.call:
                future = self.waiting.pop(self.answer_id(answer), None)
                if future is None:
                    self.unawaited(answer)
                elif not future.done():
                    future.set_result(answer)
            self._end(self.ended_ok())
        except PagedKVError as exc:  # from `unawaited`: the stream cannot go on
            self.cancel(exc)
        except grpc.aio.AioRpcError as exc:
            self._end(self.broken(exc))
        except asyncio.CancelledError:  # the call cancelled here (or the loop closing)
            self._end(Cancelled(grpc.StatusCode.CANCELLED, f"the {self.name} was cancelled"))
            raise

    def _end(self, error: PagedKVError) -> None:
        """Mark the stream ended by `error` (the first end counts); fail every waiting
        message with an error of its own of that class."""
        first = self.ended is None
        if self.ended is None:
            self.ended = error
        for future in self.waiting.values():
            if not future.done():
                future.set_exception(type(self.ended)(self.ended.code, self.ended.message))
        self.waiting.clear()
        if first:
            self.on_end()
