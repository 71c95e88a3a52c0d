"""A session's runner steps on one long-lived stream (runner.proto's Runner.StepStream), for a
`RunnerClient` made with `stream_steps=True` (as the engine's is).

A message on an open stream costs about a third of a unary Step's round trip, and the runner
handles each message exactly as a Step call with the same request, so a step's errors are the
same classes as a Step call's. One step is in flight at a time (steps of one session are
serialized by the runner anyway); a second caller waits for the first's answer. One task reads
the stream (message_stream.py, the mechanism shared with the daemon's stream client): it hands
each answer to its step by step_id and queues the pushed answers (step_id 0) of a runner that
follows the session (`step(..., follow=True)`), which arrive while no step is in flight; any
other answer no step awaits ends the stream.

Pushes. `next_push` waits for the next one, `take_push` takes a queued one or None; both give
them in the runner's order, raise a pushed failure's status (StalePlan, PoolExhausted...), and
raise the stream's end (an OutcomeUnknown: RunnerUnreachable...) once, after the pushes read
before it are taken. A step's pushes_read is the pushes taken on the open stream when the step
is called (its plan saw those). A stream reopened starts at 0 and the old stream's queued pushes
are gone: runner.proto says what a client does about pushes a broken stream lost. Cancelling a
`next_push` only stops its wait; a push not within its timeout cancels the stream.

The stream is opened at the first step and again after a break. A step whose answer does not
come within its timeout, or whose stream breaks or is ended by the runner, is one without an
answer (`DeadlineExceeded`, `RunnerUnreachable`: an `OutcomeUnknown`, whose read-back
`RunnerLink` does): the stream is cancelled first (its queued pushes dropped), so the runner
computes the step but does not answer it, as a cancelled Step call. A step cancelled by its
caller cancels the stream too, as a cancelled Step call. A stream found ended before a step is
written on it (the runner restarted between two steps) is replaced: nothing of the step was
sent on it.
"""
from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable

import grpc

from pagedkv.client.pool.errors import (
    STATUS_BY_NUMBER,
    Cancelled,
    DeadlineExceeded,
    PagedKVError,
    RunnerUnreachable,
    error_from_rpc,
    error_from_status,
)
from pagedkv.client.pool.message_stream import MessageStream
from pagedkv.proto import runner_pb2 as rpb

# One Runner.StepStream call: steps written, their answers read, in order.
StepStreamCall = grpc.aio.StreamStreamCall[rpb.RunnerStreamRequest, rpb.RunnerStreamResponse]


class _RunnerCall(MessageStream[rpb.RunnerStreamRequest, rpb.RunnerStreamResponse]):
    """One opened Runner.StepStream: answers matched by step_id, pushed answers queued in
    order; a break without a cause, or an end with a step unanswered, is RunnerUnreachable
    (the step may have been applied)."""

    name = "Runner.StepStream"

    def __init__(self, call: StepStreamCall) -> None:
        # Pushed answers read from the stream and not yet taken, in the runner's order.
        self.pushes: deque[rpb.RunnerStreamResponse] = deque()
        # Pushed answers taken by the caller: the pushes_read of a step planned now.
        self.taken = 0
        # Set when a push arrives or the stream ends: wakes `next_push`.
        self._changed = asyncio.Event()
        super().__init__(call)

    def answer_id(self, answer: rpb.RunnerStreamResponse) -> int:
        return answer.step_id

    def broken(self, error: grpc.aio.AioRpcError) -> PagedKVError:
        return error_from_rpc(error, RunnerUnreachable)

    def ended_ok(self) -> PagedKVError:
        return RunnerUnreachable(grpc.StatusCode.UNAVAILABLE, "the runner ended the step stream")

    def unawaited(self, answer: rpb.RunnerStreamResponse) -> None:
        if not answer.push:
            raise RunnerUnreachable(grpc.StatusCode.UNAVAILABLE, f"the runner answered step "
                                    f"{answer.step_id}, which no step awaits")
        self.pushes.append(answer)
        self._changed.set()

    def on_end(self) -> None:
        self._changed.set()

    def take(self) -> rpb.RunnerStreamResponse | None:
        """The next push (counted taken), None if none is queued; once every push is taken,
        the stream's end error if it ended."""
        if self.pushes:
            self.taken += 1
            return self.pushes.popleft()
        if (end := self.ended) is not None:
            raise type(end)(end.code, end.message)
        return None

    async def changed(self) -> None:
        """Return once a push arrives or the stream ends (call right after `take` gave None)."""
        self._changed.clear()
        await self._changed.wait()


class RunnerStream:
    """The steps of one session, on one stream at a time opened by `open_stream`."""

    def __init__(self, open_stream: Callable[[], StepStreamCall]) -> None:
        self._open_stream = open_stream
        # The open stream, or None until the next step opens one.
        self._stream: _RunnerCall | None = None
        # Held from a step's write to its answer: one step in flight.
        self._lock = asyncio.Lock()
        # Step ids, distinct on every stream of this session (0 is a pushed answer's).
        self._step_ids = itertools.count(1)
        # Streams opened so far (1 + the reopenings after a break).
        self.opened = 0

    async def step(self, request: rpb.RunnerStepRequest, timeout: float, *,
                   follow: bool = False) -> rpb.RunnerStepResponse:
        """`request`'s answer, within `timeout` seconds, or its error (as a Step call's);
        `follow`: the runner then follows the session (runner.proto). The step is planned now:
        its pushes_read is the pushes taken so far on the open stream (0 on a new one)."""
        message = rpb.RunnerStreamRequest(step_id=next(self._step_ids), step=request,
                                          follow=follow)
        planned_on = self._stream
        read = 0 if planned_on is None else planned_on.taken
        async with self._lock:
            try:
                async with asyncio.timeout(timeout):
                    answer = await (await self._send(message, planned_on, read))
            except TimeoutError:
                error = DeadlineExceeded(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer to "
                                         f"step {message.step_id} within {timeout} s")
                self._cancel(error, message.step_id)
                raise error from None
            except BaseException:  # the stream's end, or the caller cancelled: as a Step call
                self._cancel(Cancelled(grpc.StatusCode.CANCELLED,
                                       f"step {message.step_id} was cancelled"), message.step_id)
                raise
        return _answer(answer)

    async def next_push(self, timeout: float) -> rpb.RunnerStepResponse:
        """The open stream's next pushed answer, in order, waiting up to `timeout` seconds (no
        push by then: DeadlineExceeded, the stream cancelled). A pushed failure raises its
        status; the stream's end raises its end error once the pushes before it are taken;
        RunnerUnreachable at once if no stream is open. Cancelling the caller loses nothing."""
        stream = self._stream
        if stream is None:
            raise RunnerUnreachable(grpc.StatusCode.UNAVAILABLE, "no step stream is open: "
                                    "nothing can be pushed")
        try:
            async with asyncio.timeout(timeout):
                while (push := self._take(stream)) is None:
                    await stream.changed()
        except TimeoutError:
            error = DeadlineExceeded(grpc.StatusCode.DEADLINE_EXCEEDED,
                                     f"no pushed answer within {timeout} s")
            if self._stream is stream:
                self._cancel(error)
            raise error from None
        return _answer(push)

    def take_push(self) -> rpb.RunnerStepResponse | None:
        """The open stream's next queued push (or its failure, or the stream's end, raised as
        by `next_push`); None when none is queued or no stream is open."""
        stream = self._stream
        push = None if stream is None else self._take(stream)
        return None if push is None else _answer(push)

    def _take(self, stream: _RunnerCall) -> rpb.RunnerStreamResponse | None:
        """`stream.take()`; once it raised the stream's end, the stream is forgotten (the end
        is raised once, the next step opens another stream)."""
        try:
            return stream.take()
        except PagedKVError:
            if self._stream is stream:
                self._stream = None
            raise

    async def close(self) -> None:
        """End the open stream (a step in flight fails as cancelled)."""
        stream = self._cancel(Cancelled(grpc.StatusCode.CANCELLED, "the client was closed"))
        if stream is not None:
            await stream.ended_here()

    def _cancel(self, error: PagedKVError, step_id: int = 0) -> _RunnerCall | None:
        """Cancel the open stream (if it has not ended), its waiting step failing with `error`
        (but step `step_id`, whose caller failed already); the next step opens another.
        Returns it."""
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.forget(step_id)
            stream.cancel(error)
        return stream

    async def _send(self, message: rpb.RunnerStreamRequest, planned_on: _RunnerCall | None,
                    read: int) -> asyncio.Future[rpb.RunnerStreamResponse]:
        """Write `message` on the open stream, or on a new one if it had ended (its write sent
        nothing), its pushes_read `read` on `planned_on` (0 on another stream: the plan saw
        none of its pushes); the future of its answer, which the stream's end fails instead."""
        stream = self._stream
        if stream is not None and stream.ended is None:
            message.pushes_read = read if stream is planned_on else 0
            answer = stream.expect(message.step_id)
            if await stream.write(message):
                return answer
            stream.forget(message.step_id)
        stream = self._stream = _RunnerCall(self._open_stream())
        self.opened += 1
        message.pushes_read = 0
        answer = stream.expect(message.step_id)
        await stream.write(message)  # if it fails, the stream's end fails `answer`
        return answer


def _answer(reply: rpb.RunnerStreamResponse) -> rpb.RunnerStepResponse:
    """A step's or push's answer, or its status raised (as a Step call's error)."""
    if reply.code:
        raise error_from_status(STATUS_BY_NUMBER.get(reply.code, grpc.StatusCode.UNKNOWN),
                                reply.cause, reply.message, RunnerUnreachable)
    return reply.answer
