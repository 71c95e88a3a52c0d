"""A session's runner steps on one long-lived stream (runner.proto's Runner.StepStream), for a
`RunnerClient` made with `stream_steps=True` (as the engine's is).

A message on an open stream costs about a third of a unary Step's round trip, and the runner
handles each message exactly as a Step call with the same request, so a step's errors are the
same classes as a Step call's. One step is in flight at a time (steps of one session are
serialized by the runner anyway); a second caller waits for the first's answer. One task reads
the stream and hands each answer to its step by step_id (message_stream.py, the mechanism
shared with the daemon's stream client); an answer no step awaits ends the stream.

The stream is opened at the first step and again after a break. A step whose answer does not
come within its timeout, or whose stream breaks or is ended by the runner, is one without an
answer (`DeadlineExceeded`, `RunnerUnreachable`: an `OutcomeUnknown`, whose read-back
`RunnerLink` does): the stream is cancelled first, so the runner computes the step but does not
answer it, as a cancelled Step call. A step cancelled by its caller cancels the stream too, as
a cancelled Step call. A stream found ended before a step is written on it (the runner
restarted between two steps) is replaced: nothing of the step was sent on it.
"""

from __future__ import annotations

import asyncio
import itertools
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
    """One opened Runner.StepStream: answers matched by step_id; a break without a cause, or an
    end with a step unanswered, is RunnerUnreachable (the step may have been applied)."""

    name = "Runner.StepStream"

    def answer_id(self, answer: rpb.RunnerStreamResponse) -> int:
        return answer.step_id

    def broken(self, error: grpc.aio.AioRpcError) -> PagedKVError:
        return error_from_rpc(error, RunnerUnreachable)

    def ended_ok(self) -> PagedKVError:
        return RunnerUnreachable(grpc.StatusCode.UNAVAILABLE, "the runner ended the step stream")

    def unawaited(self, answer: rpb.RunnerStreamResponse) -> None:
        raise RunnerUnreachable(grpc.StatusCode.UNAVAILABLE, f"the runner answered step "
                                f"{answer.step_id}, which no step awaits")


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

    async def step(self, request: rpb.RunnerStepRequest,
                   timeout: float) -> rpb.RunnerStepResponse:
        """`request`'s answer, within `timeout` seconds, or its error (as a Step call's)."""
        message = rpb.RunnerStreamRequest(step_id=next(self._step_ids), step=request)
        async with self._lock:
            try:
                async with asyncio.timeout(timeout):
                    answer = await (await self._send(message))
            except TimeoutError:
                error = DeadlineExceeded(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer to "
                                         f"step {message.step_id} within {timeout} s")
                self._cancel(error, message.step_id)
                raise error from None
            except BaseException:  # the stream's end, or the caller cancelled: as a Step call
                self._cancel(Cancelled(grpc.StatusCode.CANCELLED,
                                       f"step {message.step_id} was cancelled"), message.step_id)
                raise
        if answer.code:
            raise error_from_status(STATUS_BY_NUMBER.get(answer.code, grpc.StatusCode.UNKNOWN),
                                    answer.cause, answer.message, RunnerUnreachable)
        return answer.answer

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

    async def _send(self, message: rpb.RunnerStreamRequest
                    ) -> asyncio.Future[rpb.RunnerStreamResponse]:
        """Write `message` on the open stream, or on a new one if it had ended (its write sent
        nothing); the future of its answer, which the stream's end fails instead."""
        stream = self._stream
        if stream is not None and stream.ended is None:
            answer = stream.expect(message.step_id)
            if await stream.write(message):
                return answer
            stream.forget(message.step_id)
        stream = self._stream = _RunnerCall(self._open_stream())
        self.opened += 1
        answer = stream.expect(message.step_id)
        await stream.write(message)  # if it fails, the stream's end fails `answer`
        return answer
