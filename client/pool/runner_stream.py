"""A session's runner steps on one long-lived stream (runner.proto's Runner.StepStream), for a
`RunnerClient` made with `stream_steps=True` (as the engine's is).

A message on an open stream costs about a third of a unary Step's round trip, and the runner
handles each message exactly as a Step call with the same request, so a step's errors are the
same classes as a Step call's. One step is in flight at a time (steps of one session are
serialized by the runner anyway); a second caller waits for the first's answer.

The stream is opened at the first step and again after a break. A step whose answer does not
come within its timeout, or whose stream breaks, is one without an answer (`DeadlineExceeded`,
`RunnerUnreachable`: an `OutcomeUnknown`, whose read-back `RunnerLink` does): the stream is
cancelled first, so the runner computes the step but does not answer it, as a cancelled Step
call. A step cancelled by its caller cancels the stream too (its answer would else be read as
the next step's). A stream found ended before a step is written on it (the runner restarted
between two steps) is replaced: nothing of the step was sent on it.
"""

import asyncio
import itertools
from collections.abc import Callable

import grpc

from pagedkv.client.pool.errors import (
    STATUS_BY_NUMBER,
    DeadlineExceeded,
    RunnerUnreachable,
    error_from_rpc,
    error_from_status,
)
from pagedkv.proto import runner_pb2 as rpb

# One Runner.StepStream call: steps written, their answers read, in order.
StepStreamCall = grpc.aio.StreamStreamCall[rpb.RunnerStreamRequest, rpb.RunnerStreamResponse]


class RunnerStream:
    """The steps of one session, on one stream at a time opened by `open_stream`."""

    def __init__(self, open_stream: Callable[[], StepStreamCall]) -> None:
        self._open_stream = open_stream
        # The open stream, or None until the next step opens one.
        self._call: StepStreamCall | None = None
        # Held from a step's write to its answer: one step in flight.
        self._lock = asyncio.Lock()
        # Step ids, distinct on every stream of this session.
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
                    answer = await self._exchange(message)
            except BaseException as exc:
                self._end()
                if isinstance(exc, TimeoutError):
                    raise DeadlineExceeded(grpc.StatusCode.DEADLINE_EXCEEDED,
                                           f"no answer to step {message.step_id} within "
                                           f"{timeout} s") from None
                if isinstance(exc, grpc.aio.AioRpcError):
                    raise error_from_rpc(exc, RunnerUnreachable) from None
                raise
        if answer.code:
            raise error_from_status(STATUS_BY_NUMBER.get(answer.code, grpc.StatusCode.UNKNOWN),
                                    answer.cause, answer.message, RunnerUnreachable)
        return answer.answer

    async def _exchange(self, message: rpb.RunnerStreamRequest) -> rpb.RunnerStreamResponse:
        """Write the step and read its answer, on a stream that has not ended."""
        call = await self._write(message)
        answer = await call.read()
        if not isinstance(answer, rpb.RunnerStreamResponse):  # EOF: the stream ended, no status
            raise RunnerUnreachable(grpc.StatusCode.UNAVAILABLE, "the runner ended the step "
                                    f"stream without answering step {message.step_id}")
        if answer.step_id != message.step_id:
            raise RunnerUnreachable(grpc.StatusCode.UNAVAILABLE, f"the runner answered step "
                                    f"{answer.step_id} for step {message.step_id}")
        return answer

    async def _write(self, message: rpb.RunnerStreamRequest) -> StepStreamCall:
        """The open stream with `message` written on it: the current one, or a new one if it
        ended (a write on an ended call fails before anything is sent)."""
        call = self._call
        if call is not None and not call.done():
            try:
                await call.write(message)
                return call
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                self._end()  # it ended unnoticed
        call = self._call = self._open_stream()
        self.opened += 1
        await call.write(message)
        return call

    def _end(self) -> None:
        call, self._call = self._call, None
        if call is not None:
            call.cancel()
