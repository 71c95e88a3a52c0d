"""A PoolClient's StepMany calls as messages on one long-lived stream (kvpool.proto's
KVPool.StepStream): a message on an open stream costs about a third of a unary round trip.

    steps = StepStream(stub, metadata)
    reply = await steps.call(pb.StepManyRequest(steps=[...]), timeout=5.0)

Several calls may be in flight at once (the runner's DaemonSteps sends a burst while the last
one is answered): each message carries a call_id, and one task reads the answers and hands each
to its caller (the mechanism, shared with the runner's stream client: message_stream.py). The
daemon handles each message exactly as a StepMany call, so a message refused as a whole raises
what that call would (`error_from_status`), and the stream goes on.

A message over MAX_MESSAGE_BYTES would end the stream (gRPC refuses it whole): it fails alone,
MessageTooLarge before it is sent, as a unary call that large fails alone.

The stream is opened at the first call and again after a break. A write that fails sent
nothing (the stream had ended unnoticed, e.g. the daemon restarted between two calls): the
message goes on a new stream. A message not answered within `timeout` ends the stream here
(cancelled, so the daemon undoes the message it had not finished, as a cancelled call), and
then every message not yet answered fails as a lost call: DeadlineExceeded for the late one,
Cancelled for the others, or the stream's own status when it broke (DaemonUnavailable...).
`PoolClient.step_many` reads such a call back entry by entry, as kvpool.proto's retry rules
say, once the stream has ended on this side. A daemon without StepStream (UNIMPLEMENTED) turns
`served` off: the client sends StepMany calls from then on.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import TYPE_CHECKING

import grpc

from pagedkv.client.pool.errors import (
    STATUS_BY_NUMBER,
    Cancelled,
    DeadlineExceeded,
    MessageTooLarge,
    PagedKVError,
    error_from_rpc,
    error_from_status,
)
from pagedkv.client.pool.message_stream import MessageStream
from pagedkv.proto import kvpool_pb2 as pb
from pagedkv.proto.limits import MAX_MESSAGE_BYTES

if TYPE_CHECKING:
    from pagedkv.proto.kvpool_pb2_grpc import KVPoolAsyncStub  # in the stubs only
# The call metadata every message's stream carries (the bearer token).
Metadata = tuple[tuple[str, str], ...]


class _DaemonCall(MessageStream[pb.StepStreamRequest, pb.StepStreamResponse]):
    """One opened KVPool.StepStream: answers matched by call_id; a break is the daemon's
    status (DaemonUnavailable without a cause), an OK end Cancelled (the daemon drained)."""

    name = "StepStream"

    def answer_id(self, answer: pb.StepStreamResponse) -> int:
        return answer.call_id

    def broken(self, error: grpc.aio.AioRpcError) -> PagedKVError:
        return error_from_rpc(error)

    def ended_ok(self) -> PagedKVError:
        return Cancelled(grpc.StatusCode.CANCELLED, "the daemon ended the StepStream")


class StepStream:
    """A client's StepMany calls on one stream at a time (see the module docstring)."""

    def __init__(self, stub: KVPoolAsyncStub, metadata: Metadata) -> None:
        self._stub = stub
        self._metadata = metadata
        # The open stream, or None until a call opens one.
        self._stream: _DaemonCall | None = None
        # Call ids, distinct over every stream of this client.
        self._call_ids = itertools.count(1)
        # False once the daemon answered StepStream UNIMPLEMENTED: send StepMany calls instead.
        self.served = True
        # Streams opened so far (1 + the reopenings after a break).
        self.opened = 0

    async def call(self, request: pb.StepManyRequest, timeout: float) -> pb.StepManyResponse:
        """`request`'s answer, as a StepMany call's: PagedKVError if refused as a whole; an
        OutcomeUnknown if its answer did not come within `timeout` seconds or the stream broke
        (the stream has then ended here)."""
        message = pb.StepStreamRequest(call_id=next(self._call_ids), many=request)
        if (size := message.ByteSize()) > MAX_MESSAGE_BYTES:  # would end the stream: alone
            raise MessageTooLarge(grpc.StatusCode.RESOURCE_EXHAUSTED, f"a StepMany of {size} "
                                  f"bytes; the limit is {MAX_MESSAGE_BYTES}: split the call")
        try:
            async with asyncio.timeout(timeout):
                reply = await (await self._send(message))
        except TimeoutError:
            await self._cancel(Cancelled(grpc.StatusCode.CANCELLED, "the StepStream was ended: "
                                         f"message {message.call_id} got no answer in time"))
            raise DeadlineExceeded(grpc.StatusCode.DEADLINE_EXCEEDED, "no answer to StepStream "
                                   f"message {message.call_id} within {timeout} s") from None
        except PagedKVError as exc:
            if exc.code == grpc.StatusCode.UNIMPLEMENTED:
                self.served = False
            raise
        except asyncio.CancelledError:  # as a cancelled call: the daemon undoes it if it can
            self._cancel_now(Cancelled(grpc.StatusCode.CANCELLED, "a caller was cancelled"))
            raise
        if reply.code:
            raise error_from_status(STATUS_BY_NUMBER.get(reply.code, grpc.StatusCode.UNKNOWN),
                                    reply.cause, reply.message)
        return reply.many

    async def close(self) -> None:
        """End the open stream (a message in flight fails as cancelled)."""
        await self._cancel(Cancelled(grpc.StatusCode.CANCELLED, "the client was closed"))

    async def _cancel(self, error: PagedKVError) -> None:
        """End the open stream here, its waiting messages failing with `error`; return once
        its reader is done."""
        stream = self._cancel_now(error)
        if stream is not None:
            await stream.ended_here()

    def _cancel_now(self, error: PagedKVError) -> _DaemonCall | None:
        """Cancel the open stream, its waiting messages failing with `error`; returns it."""
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.cancel(error)
        return stream

    async def _send(self, message: pb.StepStreamRequest) -> asyncio.Future[pb.StepStreamResponse]:
        """Write `message` on the open stream, or on a new one if it had ended (its write sent
        nothing); the future of its answer, which the stream's end fails instead."""
        stream = self._stream
        if stream is not None and stream.ended is None:
            answer = stream.expect(message.call_id)
            if await stream.write(message):
                return answer
            stream.forget(message.call_id)
        stream = self._stream = self._open()
        answer = stream.expect(message.call_id)
        await stream.write(message)  # if it fails, the stream's end fails `answer`
        return answer

    def _open(self) -> _DaemonCall:
        self.opened += 1
        return _DaemonCall(self._stub.StepStream(None, metadata=self._metadata))  # written later
