"""The fuzz client's KVPool.StepStream: StepMany calls sent as messages on one stream.

The stream stays open across calls, one message in flight at a time; a message's answer is
turned back into what the unary StepMany would have given (the StepManyResponse's bytes, or a
`Refused` error carrying the status the message was refused with as a whole), so the fuzzer
judges and applies both transports' answers the same way. A stream that breaks fails the message
in flight with the stream's status, and the next message opens a new stream.
"""

import itertools
import queue
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import grpc
from fuzz_shadow import Violation

from pagedkv.client.pool.errors import STATUS_BY_NUMBER
from pagedkv.proto import kvpool_pb2 as pb


class Refused(grpc.RpcError):
    """A message refused as a whole: its answer's status, as the unary call's error."""

    def __init__(self, reply: pb.StepStreamResponse) -> None:
        super().__init__(reply.message)
        # The answer refusing the message (code, cause, message; no StepManyResponse).
        self.reply = reply

    def code(self) -> grpc.StatusCode:
        return STATUS_BY_NUMBER.get(self.reply.code, grpc.StatusCode.UNKNOWN)

    def details(self) -> str:
        return self.reply.message


class StepStreamClient:
    """One stream at a time, kept open; call ids distinct over every stream."""

    def __init__(self, channel: grpc.Channel, timeout_s: float) -> None:
        self.method = channel.stream_stream(
            "/pagedkv.v1.KVPool/StepStream",
            request_serializer=pb.StepStreamRequest.SerializeToString,
            response_deserializer=pb.StepStreamResponse.FromString)
        # How long a message waits for its answer (missing it is a finding).
        self.timeout_s = timeout_s
        self.call_ids = itertools.count(1)
        # Streams opened so far (1 + reopenings after a break).
        self.opened = 0
        # The open stream's outgoing messages (None half-closes it) and its call; None if closed.
        self.outbox: queue.Queue[pb.StepStreamRequest | None] | None = None
        self.call: Any = None
        # Reads answers, so that waiting for one can time out.
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="fuzz-step-stream")

    def send(self, request: pb.StepManyRequest) -> bytes:
        """`request`'s answer as the unary StepMany's bytes; Refused if refused as a whole; the
        stream's RpcError if it broke (closed here: the next message opens a new one)."""
        if self.call is None:
            self.open()
        assert self.outbox is not None
        call_id = next(self.call_ids)
        self.outbox.put(pb.StepStreamRequest(call_id=call_id, many=request))
        try:
            reply: pb.StepStreamResponse = self.reader.submit(next, self.call).result(
                self.timeout_s)
        except grpc.RpcError:
            self.close()
            raise
        except StopIteration:
            self.close()
            raise Violation(f"the daemon ended the StepStream before answering message "
                            f"{call_id}") from None
        except FutureTimeout:
            self.close()
            raise Violation(f"no answer to StepStream message {call_id} within "
                            f"{self.timeout_s} s") from None
        if reply.call_id != call_id:
            raise Violation(f"StepStream answered call {reply.call_id} to message {call_id}")
        if reply.code:
            raise Refused(reply)
        return reply.many.SerializeToString()

    def open(self) -> None:
        outbox: queue.Queue[pb.StepStreamRequest | None] = queue.Queue()
        self.outbox, self.call = outbox, self.method(iter(outbox.get, None))
        self.opened += 1

    def close(self) -> None:
        """End the open stream (half-closed, then cancelled); the reader stays for the next."""
        if self.call is not None:
            assert self.outbox is not None
            self.outbox.put(None)
            self.call.cancel()
        self.outbox, self.call = None, None
